"""Per-frame features for scene detection, computed on proxy frames (small RGB images).

A frame's feature is an HSV colour histogram (``H_BINS`` hue + ``S_BINS`` saturation + ``V_BINS`` value
bins; soft binning: each pixel is shared linearly between the two nearest bin centres, so a small colour shift
moves the histogram a little instead of flipping whole bins; hue is circular), its mean luma and the standard
deviation of its luma (a near-uniform frame — black, white, a flat colour — has almost none). Histogram
values are integers in units of 1e-4 of the pixels (``HIST_UNIT``), so a feature serialises exactly, as short
JSON integers or as a 88-character base64 string (`encode_hist` / `decode_hist`).
The distance between two frames is the mean over the three channels of the total-variation distance between
their normalised histograms: 0 for identical colour distributions, 1 for disjoint ones. Colour histograms
ignore where things are, so camera and object motion inside a scene move the distance little while a cut
moves it a lot.
"""

from __future__ import annotations

from dataclasses import dataclass

import base64

import numpy as np

H_BINS = 16
S_BINS = 8
V_BINS = 8
HIST_UNIT = 10_000  # histogram values are fractions of the pixels times HIST_UNIT, rounded


@dataclass(frozen=True)
class FrameFeature:
    """Features of one proxy frame."""

    hist: np.ndarray  # [H_BINS + S_BINS + V_BINS] int64 pixel fraction per bin * HIST_UNIT (channel sums ~HIST_UNIT)
    luma: float  # mean luma (BT.601) in [0, 1]
    luma_std: float  # standard deviation of the luma over the pixels, in [0, 1] (0 for a uniform frame)


def rgb_to_hsv(image: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``image`` [h, w, 3] uint8 RGB -> (hue in [0, 1), saturation in [0, 1], value in [0, 1]), each [h, w]."""
    rgb = image.astype(np.float32) * (1.0 / 255.0)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    v = rgb.max(axis=-1)
    c = v - rgb.min(axis=-1)
    s = np.where(v > 0, c / np.maximum(v, 1e-12), 0.0)
    safe = np.maximum(c, 1e-12)
    h = np.where(v == r, ((g - b) / safe) % 6.0, np.where(v == g, (b - r) / safe + 2.0, (r - g) / safe + 4.0))
    h = np.where(c > 0, h / 6.0, 0.0)
    return h, s, v


_LUT_BITS = 6  # RGB quantised to 6 bits per channel for the HSV lookup table (3 MB, built on first use)
_lut: np.ndarray | None = None


def _hsv_lut() -> np.ndarray:
    """[2**(3*_LUT_BITS), 3] float32: HSV of the centre of each quantised RGB cell."""
    global _lut
    if _lut is None:
        n = 1 << _LUT_BITS
        step = 256 // n
        levels = (np.arange(n, dtype=np.int32) * step + step // 2).astype(np.uint8)
        r, g, b = np.meshgrid(levels, levels, levels, indexing="ij")
        grid = np.stack([r, g, b], axis=-1).reshape(-1, 1, 3)
        h, s, v = rgb_to_hsv(grid)
        _lut = np.stack([h.ravel(), s.ravel(), v.ravel()], axis=-1).astype(np.float32)
    return _lut


def frame_feature(image: np.ndarray) -> FrameFeature:
    """Features of a proxy frame ``image`` [h, w, 3] uint8 RGB. Raises ValueError on another shape/dtype.

    HSV comes from a lookup table over RGB quantised to 6 bits per channel (error < 2% of the range, far below a
    bin width), which is ~10x faster than converting each pixel.
    """
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"expected [h, w, 3] uint8 RGB, got {image.shape} {image.dtype}")
    q = (image >> (8 - _LUT_BITS)).astype(np.int32)
    hsv = _hsv_lut()[(q[..., 0] << (2 * _LUT_BITS)) | (q[..., 1] << _LUT_BITS) | q[..., 2]]
    h, s, v = hsv[..., 0], hsv[..., 1], hsv[..., 2]
    hist = np.concatenate(
        [_soft_hist(h.ravel(), H_BINS, circular=True), _soft_hist(s.ravel(), S_BINS), _soft_hist(v.ravel(), V_BINS)]
    )
    hist = np.round(hist * HIST_UNIT).astype(np.int64)
    rgb = image.reshape(-1, 3).astype(np.float32)
    y = rgb @ np.array([0.299, 0.587, 0.114], np.float32)
    return FrameFeature(hist=hist, luma=float(y.mean() / 255.0), luma_std=float(y.std() / 255.0))


def _soft_hist(x: np.ndarray, bins: int, circular: bool = False) -> np.ndarray:
    """Histogram of values ``x`` in [0, 1] over ``bins`` bins with linear (triangular) soft assignment."""
    pos = x.astype(np.float64) * bins - 0.5  # position relative to bin centres
    lo = np.floor(pos)
    w_hi = pos - lo
    lo = lo.astype(np.int64)
    hi = lo + 1
    if circular:
        lo %= bins
        hi %= bins
    else:
        lo = np.clip(lo, 0, bins - 1)
        hi = np.clip(hi, 0, bins - 1)
    hist = np.bincount(lo, weights=1.0 - w_hi, minlength=bins) + np.bincount(hi, weights=w_hi, minlength=bins)
    return hist / max(len(x), 1)


def hist_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over H, S, V of the total-variation distance of two `FrameFeature.hist` vectors; in [0, 1]."""
    return min(1.0, float(np.abs(np.asarray(a) - np.asarray(b)).sum()) / (6.0 * HIST_UNIT))


def is_near_uniform(image: np.ndarray, max_luma_std: float = 4 / 255) -> bool:
    """True when the BT.601 luma of ``image`` ([H, W, 3] uint8 RGB, any size) has a standard deviation below
    ``max_luma_std`` (in [0, 1]): a black, white or flat-colour frame, which shows no scene. Raises ValueError on
    another shape/dtype."""
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"expected [h, w, 3] uint8 RGB, got {image.shape} {image.dtype}")
    y = image.reshape(-1, 3).astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)
    return float(y.std()) / 255.0 < max_luma_std


def encode_hist(hist: np.ndarray) -> str:
    """`FrameFeature.hist` -> base64 text of its values as little-endian uint16 (exact: values are <= HIST_UNIT)."""
    return base64.b64encode(np.asarray(hist, dtype="<u2").tobytes()).decode("ascii")


def decode_hist(text: str) -> np.ndarray:
    """Inverse of `encode_hist`: [H_BINS + S_BINS + V_BINS] int64."""
    return np.frombuffer(base64.b64decode(text), dtype="<u2").astype(np.int64)
