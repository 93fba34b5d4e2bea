"""Visual-attention maps: where the target VLM looked while it verified a caption.

The verification pass exports, per committed token, the target's attention mass on each visual token
(mean over heads of the chosen layers). Averaged over the caption's tokens and laid out on the vision tower's
patch grid, it is drawn as a heat overlay on the keyframe.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np


def patch_map(attention: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """Mean attention per patch ``[rows, cols]`` from per-token attention ``[n_tokens, n_visual]``.

    Visual tokens beyond ``rows * cols`` (OneVision's tiles and newlines) are ignored: the grid is the base
    image's.
    """
    if attention.ndim != 2:
        raise ValueError(f"attention must be [n_tokens, n_visual], got {attention.shape}")
    rows, cols = grid
    mean = attention.mean(0)[: rows * cols]
    if mean.shape[0] != rows * cols:
        raise ValueError(f"{mean.shape[0]} visual tokens do not fill a {rows}x{cols} grid")
    return mean.reshape(rows, cols)


def overlay(image: np.ndarray, heat: np.ndarray, alpha: float = 0.6) -> np.ndarray:
    """The keyframe ``[H, W, 3]`` uint8 with ``heat`` ``[rows, cols]`` (any scale) drawn over it in red."""
    from PIL import Image

    h, w = image.shape[:2]
    lo, hi = float(heat.min()), float(heat.max())
    norm = (heat - lo) / (hi - lo) if hi > lo else np.zeros_like(heat)
    up = np.asarray(Image.fromarray((norm * 255).astype(np.uint8)).resize((w, h), Image.NEAREST),
                    dtype=np.float32) / 255.0
    red = np.zeros_like(image, dtype=np.float32)
    red[..., 0] = 255
    a = (alpha * up)[..., None]
    return (image.astype(np.float32) * (1 - a) + red * a).clip(0, 255).astype(np.uint8)


def map_stem(source: str) -> str:
    """The file-name stem of a source's maps: its stem with unsafe characters replaced (at most 80)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(source).stem)[:80] or "input"


def save_attention_map(out_dir: Path, source: str, frame_index: int, image: np.ndarray, attention: np.ndarray,
                       grid: tuple[int, int] | None, stem: str | None = None, max_side: int = 1024) -> Path:
    """Write ``<out_dir>/<stem>_f<frame>.png``: the attention overlay of one caption. Returns the path.

    Args:
        image: the keyframe ``[H, W, 3]`` uint8; drawn at most ``max_side`` pixels on its longer side (an
            8000x8000 photo would otherwise cost gigabytes and a minute per map).
        attention: ``[n_tokens, n_visual]`` (see :func:`patch_map`).
        stem: the file-name stem; default :func:`map_stem` of ``source`` (two sources with the same stem, such as
            ``a/clip.mp4`` and ``b/clip.mp4``, need distinct stems: the caller keeps them apart).
    """
    from PIL import Image

    if grid is None:
        n = attention.shape[1]
        side = int(round(n ** 0.5))
        grid = (side, side) if side * side == n else (1, n)
    h, w = image.shape[:2]
    if max(h, w) > max_side:
        scale = max_side / max(h, w)
        size = (max(1, round(w * scale)), max(1, round(h * scale)))
        image = np.asarray(Image.fromarray(image).resize(size, Image.BILINEAR))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stem or map_stem(source)}_f{frame_index:06d}.png"
    Image.fromarray(overlay(image, patch_map(attention, grid))).save(path)
    return path
