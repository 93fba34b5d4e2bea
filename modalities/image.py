"""Still images (png, jpg/jpeg, webp) -> RGB uint8 arrays, with typed errors.

Decoding uses Pillow in the calling process: Pillow's image decoders do not hang the way a video decoder can,
and ``Image.MAX_IMAGE_PIXELS`` (decompression-bomb guard) stays at Pillow's default. EXIF orientation is
honoured (the array is in display orientation).
"""

from __future__ import annotations

import os

import numpy as np

from specstream.errors import CorruptMediaError, UnreadableSourceError, UnsupportedMediaError

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp"})
_FORMATS = {"PNG", "JPEG", "WEBP"}


def load_image(path: str | os.PathLike) -> np.ndarray:
    """Load the image at ``path`` as ``[H, W, 3]`` uint8 RGB (alpha dropped, palette/greyscale converted).
    ``path`` may be an opened source's ``/proc/self/fd/N`` (`specstream.modalities.source`).

    Raises `UnreadableSourceError` (missing, directory, unreadable, empty), `UnsupportedMediaError` (not a
    png/jpeg/webp image), `CorruptMediaError` (recognised but damaged, e.g. truncated).
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    p = os.fspath(path)
    if not os.path.exists(p):
        raise UnreadableSourceError(f"no such file: {p}")
    if os.path.isdir(p):
        raise UnreadableSourceError(f"is a directory, not an image: {p}")
    if os.path.getsize(p) == 0:
        raise UnreadableSourceError(f"file is empty (0 bytes): {p}")
    try:
        with Image.open(p) as im:
            if im.format not in _FORMATS:
                raise UnsupportedMediaError(f"unsupported image format {im.format} (png, jpeg, webp): {p}")
            im.load()
            im = ImageOps.exif_transpose(im)
            rgb = im.convert("RGB")
    except PermissionError as exc:
        raise UnreadableSourceError(f"no permission to read: {p}") from exc
    except UnidentifiedImageError as exc:
        raise UnsupportedMediaError(f"not a supported image (png, jpeg, webp): {p}") from exc
    except (OSError, SyntaxError, ValueError) as exc:  # Pillow reports truncated/damaged data as OSError
        raise CorruptMediaError(f"damaged image {p}: {exc}") from exc
    return np.asarray(rgb, dtype=np.uint8)


def sniff_image(path: str | os.PathLike) -> str | None:
    """Pillow's name of the image format the file at ``path`` holds (``"PNG"``, ``"JPEG"``, ...), judged by its
    content: Pillow reads the header only, nothing is decoded. None when Pillow recognises no image, or the file
    cannot be read (the loader then reports why). Call :func:`~specstream.modalities.video.sniff_container`
    first: Pillow also opens GIF animations, which specstream treats as videos."""
    try:
        from PIL import Image
    except ImportError:
        return None
    try:
        with Image.open(os.fspath(path)) as im:
            return im.format
    except Exception:  # unidentified, unreadable, a decompression bomb: the loader says which
        return None


def is_image_path(path: str | os.PathLike) -> bool:
    """True when the file name has an image extension (png, jpg, jpeg, webp)."""
    return os.path.splitext(os.fspath(path))[1].lower() in IMAGE_EXTENSIONS
