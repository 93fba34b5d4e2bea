"""Limits on decoded media, checked from the header before anything is decoded.

A small file can decode to an enormous one (a "decompression bomb": a 388 KB PNG of 20000 x 20000 pixels, a GIF of
thousands of tiny LZW frames, an mp4 whose stream claims 16000 x 16000). Two limits hold for every image and video
frame, on every entry point (the OpenAI chat routes, ``POST /v1/captions``, ``specstream caption`` and
``specstream qa``):

- ``max_pixels``: width x height of one image or one video frame;
- ``max_decoded_bytes``: the bytes the decoder would allocate for the whole item: width x height x bytes per pixel
  x frames for a still or animated image (GIF, APNG, animated WebP), width x height x 3 (RGB24) for one video
  frame (a video streams its frames one at a time).

The sizes come from headers only: Pillow's ``Image.open`` (which reads the header and, for ``n_frames``, skips
over the frames' data blocks without decompressing them) and, for ISO base media files (mp4, mov, m4v, 3gp), the
``tkhd`` and ``stsd`` boxes (ISO/IEC 14496-12 sections 8.3.2 and 8.5.2), read here before a decoder is started.
For other containers the decoding child checks the stream's dimensions from its probe, before the first frame
is converted. Exceeding a limit raises :class:`MediaLimitError` (``media_too_large``, a ``MediaError``: a 400 on
the HTTP routes with ``param`` set, an error record in ``caption``, an error line in ``qa``).

The process's limits are set once by the command that starts (``serve``, ``caption``, ``qa``) with
:func:`set_media_limits`; library callers may pass their own :class:`MediaLimits`.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from specstream.errors import MediaLimitError

DEFAULT_MAX_PIXELS = 50_000_000  # 50 megapixels: 8K video frames (33 MP) and large photos pass
DEFAULT_MAX_DECODED_BYTES = 1 << 30  # 1 GiB decoded for one image (all its frames) or one video frame


@dataclass(frozen=True)
class MediaLimits:
    """``max_pixels``: pixels of one image or video frame; ``max_decoded_bytes``: decoded bytes of one image (all
    its frames) or of one video frame."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES

    def __post_init__(self):
        if self.max_pixels < 1 or self.max_decoded_bytes < 1:
            raise ValueError("media limits must be positive")

    def check(self, width: int, height: int, bytes_per_pixel: int, frames: int, what: str) -> None:
        """Raise :class:`MediaLimitError` when a ``width`` x ``height`` item of ``frames`` frames at
        ``bytes_per_pixel`` exceeds a limit. ``what`` names the item in the message."""
        pixels = int(width) * int(height)
        if pixels > self.max_pixels:
            raise MediaLimitError(f"{what}: {width} x {height} = {pixels} pixels is over the limit of "
                                  f"{self.max_pixels} (max_pixels)", "max_pixels")
        decoded = pixels * int(bytes_per_pixel) * max(1, int(frames))
        if decoded > self.max_decoded_bytes:
            frames_txt = f" x {frames} frames" if frames > 1 else ""
            raise MediaLimitError(f"{what}: {width} x {height}{frames_txt} decodes to {decoded} bytes, over the "
                                  f"limit of {self.max_decoded_bytes} (max_decoded_bytes)", "max_decoded_bytes")


_limits = MediaLimits()


def media_limits() -> MediaLimits:
    """The process's limits (:func:`set_media_limits`; defaults until a command sets them)."""
    return _limits


def set_media_limits(limits: MediaLimits) -> None:
    """Set the process's limits (called by ``serve``, ``caption`` and ``qa`` from their settings and flags)."""
    global _limits
    if not isinstance(limits, MediaLimits):
        raise TypeError("set_media_limits takes a MediaLimits")
    _limits = limits


def check_pillow_image(im, what: str, limits: MediaLimits | None = None) -> None:
    """Check an opened, not yet loaded Pillow image (its header: size, mode, frame count). Raises
    :class:`MediaLimitError`."""
    import numpy as np
    from PIL import ImageMode

    limits = limits or _limits
    w, h = im.size
    limits.check(w, h, 1, 1, what)  # the pixel count first: n_frames below scans the file
    try:
        mode = ImageMode.getmode(im.mode)
        bpp = np.dtype(mode.typestr).itemsize * len(mode.bands)
    except Exception:  # an unusual raw mode: count 4 bytes per pixel
        bpp = 4
    frames = int(getattr(im, "n_frames", 1) or 1)
    limits.check(w, h, max(bpp, 3), frames, what)  # at least RGB: every image is converted to RGB


def check_image_file(path: str | os.PathLike, what: str | None = None, limits: MediaLimits | None = None) -> None:
    """Check the image (or GIF animation) at ``path`` from its header. A file Pillow cannot identify passes (its
    loader reports it). Raises :class:`MediaLimitError`."""
    from PIL import Image

    limits = limits or _limits
    what = what or os.fspath(path)
    try:
        im = Image.open(os.fspath(path))
    except Image.DecompressionBombError as exc:
        raise MediaLimitError(f"{what}: over the limit of {limits.max_pixels} pixels (max_pixels): {exc}",
                              "max_pixels") from None
    except Exception:
        return
    with im:
        check_pillow_image(im, what, limits)


# -- ISO base media file format (mp4, mov) --------------------------------------------------------------------------
_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl"}


def iso_bmff_video_sizes(path: str | os.PathLike, max_boxes: int = 10_000) -> list[tuple[int, int]]:
    """Every (width, height) an ISO BMFF file's header states for its tracks: ``tkhd`` (16.16 fixed point, the
    display size) and each visual sample entry of ``stsd`` (the coded size). Nothing is decoded; ``mdat`` is
    skipped by its size. An empty list when the file is not ISO BMFF or holds no such box."""
    sizes: list[tuple[int, int]] = []
    count = 0
    try:
        fh = open(os.fspath(path), "rb")
    except OSError:
        return sizes
    with fh:
        end_of_file = os.fstat(fh.fileno()).st_size

        def walk(start: int, end: int) -> None:
            nonlocal count
            pos = start
            while pos + 8 <= end and count < max_boxes:
                count += 1
                fh.seek(pos)
                head = fh.read(16)
                if len(head) < 8:
                    return
                size, kind = struct.unpack(">I4s", head[:8])
                hdr = 8
                if size == 1 and len(head) >= 16:
                    size, hdr = struct.unpack(">Q", head[8:16])[0], 16
                elif size == 0:
                    size = end - pos
                if size < hdr:
                    return
                if kind in _CONTAINERS:
                    walk(pos + hdr, min(end, pos + size))
                elif kind == b"tkhd":
                    fh.seek(pos + hdr)
                    body = fh.read(min(size - hdr, 96))
                    if len(body) >= 84:
                        off = 88 if body[0] == 1 else 76  # version 1 has 64-bit times
                        if len(body) >= off + 8:
                            w, h = struct.unpack(">II", body[off:off + 8])
                            if w or h:
                                sizes.append((w >> 16, h >> 16))
                elif kind == b"stsd":
                    fh.seek(pos + hdr)
                    body = fh.read(min(size - hdr, 4096))
                    if len(body) >= 8:
                        n = struct.unpack(">I", body[4:8])[0]
                        p = 8
                        for _ in range(min(n, 16)):
                            if p + 36 > len(body):
                                break
                            esize, fourcc = struct.unpack(">I4s", body[p:p + 8])
                            # VisualSampleEntry: 6 reserved + 2 index + 16 pre_defined/reserved, then width, height
                            w, h = struct.unpack(">HH", body[p + 32:p + 36])
                            if fourcc not in (b"mp4a", b"alac", b"Opus", b"fLaC", b"ac-3", b"ec-3", b"tx3g",
                                              b"text", b"wvtt", b"stpp", b"mp4s", b"sowt", b"twos", b"lpcm"):
                                sizes.append((w, h))
                            if esize < 8:
                                break
                            p += esize
                pos += size

        walk(0, end_of_file)
    return sizes


def check_video_file(path: str | os.PathLike, what: str | None = None, limits: MediaLimits | None = None) -> None:
    """Check a video file from its container header before a decoder starts: an ISO BMFF file by its ``tkhd`` and
    ``stsd`` sizes, a GIF by Pillow's header scan (every frame counts: an animation's frames are decoded in full).
    Other containers, and anything that is not a regular file (a FIFO would block this process), are checked by
    the decoding child from its probe (:func:`check_stream`). Raises :class:`MediaLimitError`."""
    from specstream.modalities.sniff import SNIFF_BYTES, sniff_container

    import stat

    limits = limits or _limits
    what = what or os.fspath(path)
    try:
        if not stat.S_ISREG(os.stat(os.fspath(path)).st_mode):
            return  # a pipe or device: opening it may block, so only the decoding child (killable) reads it
        with open(os.fspath(path), "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError:
        return
    kind = sniff_container(head)
    if kind in ("mp4", "mov"):
        for w, h in iso_bmff_video_sizes(path):
            limits.check(w, h, 3, 1, f"{what} (video stream header)")
    elif kind == "gif":
        check_image_file(path, what, limits)


def check_stream(width: int, height: int, what: str, limits: MediaLimits | None = None) -> None:
    """Check one video stream's frame size (RGB24, one frame at a time). Raises :class:`MediaLimitError`."""
    (limits or _limits).check(width, height, 3, 1, what)


# -- command-line flags (caption, qa; serve has them as settings) ---------------------------------------------------
def add_limit_arguments(parser) -> None:
    """``--max-image-pixels`` and ``--max-decoded-bytes`` on an argparse parser."""
    parser.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                        help=f"pixels of one image or video frame, at most (default {DEFAULT_MAX_PIXELS}); "
                             "larger ones are refused from the header (media_too_large)")
    parser.add_argument("--max-decoded-bytes", type=int, default=DEFAULT_MAX_DECODED_BYTES,
                        help=f"decoded bytes of one image (all its frames) or one video frame, at most "
                             f"(default {DEFAULT_MAX_DECODED_BYTES}); checked from the header")


def limits_from_args(args) -> MediaLimits:
    """The :class:`MediaLimits` of :func:`add_limit_arguments`' flags. Raises InvalidRequestError (not positive)."""
    from specstream.errors import InvalidRequestError

    for flag, value in (("--max-image-pixels", args.max_image_pixels), ("--max-decoded-bytes",
                                                                          args.max_decoded_bytes)):
        if value < 1:
            raise InvalidRequestError(f"{flag} must be >= 1, got {value}")
    return MediaLimits(args.max_image_pixels, args.max_decoded_bytes)
