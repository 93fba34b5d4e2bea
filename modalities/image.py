"""Still images (png, jpg/jpeg, webp) -> RGB uint8 arrays, with typed errors.

Decoding uses Pillow in the calling process: Pillow's image decoders do not hang the way a video decoder can.
Before anything is decoded the header is checked against the media limits (``specstream.modalities.limits``:
pixels, decoded bytes); ``Image.MAX_IMAGE_PIXELS`` stays at Pillow's default (its bomb error, raised by a header
over twice that, is reported as the same ``media_too_large``). EXIF orientation is honoured (the array is in
display orientation).
"""

from __future__ import annotations

import os

import numpy as np

from specstream.errors import CorruptMediaError, UnreadableSourceError, UnsupportedMediaError

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp"})
_FORMATS = {"PNG", "JPEG", "WEBP"}


def load_image(path: str | os.PathLike, limits=None) -> np.ndarray:
    """Load the image at ``path`` as ``[H, W, 3]`` uint8 RGB (alpha dropped, palette/greyscale converted).
    ``path`` may be an opened source's ``/proc/self/fd/N`` (`specstream.modalities.source`). ``limits``: a
    :class:`~specstream.modalities.limits.MediaLimits` (default: the process's).

    Raises `UnreadableSourceError` (missing, directory, unreadable, empty), `UnsupportedMediaError` (not a
    png/jpeg/webp image), `MediaLimitError` (the header states more pixels or decoded bytes than the limits;
    nothing decoded), `CorruptMediaError` (recognised but damaged, e.g. truncated).
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    from specstream.errors import MediaLimitError
    from specstream.modalities.limits import check_pillow_image, media_limits

    limits = limits or media_limits()

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
            check_pillow_image(im, p, limits)
            im.load()
            im = ImageOps.exif_transpose(im)
            rgb = im.convert("RGB")
    except Image.DecompressionBombError as exc:
        raise MediaLimitError(f"{p}: over the limit of {limits.max_pixels} pixels (max_pixels): {exc}",
                              "max_pixels") from None
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
    cannot be read (the loader then reports why). Call :func:`~specstream.modalities.sniff.sniff_container`
    first: Pillow also opens GIF animations, which specstream treats as videos. An image whose header is over
    twice Pillow's bomb limit is still an image: ``"OVERSIZED"`` (the loader refuses it by the media limits)."""
    try:
        from PIL import Image
    except ImportError:
        return None
    try:
        with Image.open(os.fspath(path)) as im:
            return im.format
    except Image.DecompressionBombError:
        return "OVERSIZED"
    except Exception:  # unidentified, unreadable: the loader says which
        return None


def is_image_path(path: str | os.PathLike) -> bool:
    """True when the file name has an image extension (png, jpg, jpeg, webp)."""
    return os.path.splitext(os.fspath(path))[1].lower() in IMAGE_EXTENSIONS
