"""Uploaded media: safe display names, stored suffixes and the form overhead a request body may add.

Shared by the server's caption route (:mod:`specstream.pipeline.server`) and the OpenAI routes
(:mod:`specstream.pipeline.openai_api`), which the server includes: kept apart so that neither imports the other
back.
"""

from __future__ import annotations

import os
import re
import unicodedata

FORM_OVERHEAD_BYTES = 64 * 1024  # a caption request body may exceed max_upload_bytes by this (fields, framing)


def upload_display_name(filename: str | None) -> str:
    """What an upload is called in its records: the client's file name reduced to a safe display form.

    The last path component (after ``/`` or ``\\``: some clients send a whole path), without control characters
    (NUL, newlines, ...; Unicode category C) and surrounding spaces, cut to at most 255 UTF-8 bytes keeping its
    extension; ``upload`` when nothing usable is left (``""``, ``/``, ``.``, ``..``). The file is stored under a
    name of the server's own (see :func:`media_suffix`), so no client name reaches the file system."""
    name = re.split(r"[/\\]", filename or "")[-1]
    name = "".join(ch for ch in name if unicodedata.category(ch)[0] != "C").strip()
    if name in ("", ".", ".."):
        return "upload"
    stem, ext = os.path.splitext(name)
    if len(ext.encode()) > 16:
        stem, ext = name, ""
    room = 255 - len(ext.encode())
    stem = stem.encode()[:room].decode("utf-8", errors="ignore")
    return (stem + ext) if stem else "upload" + ext


def media_suffix(name: str) -> str:
    """The stored upload's extension: the display name's, when it is a short alphanumeric one (the caption graph
    tells images from videos by it), else ``.bin``."""
    ext = os.path.splitext(name)[1].lower()
    return ext if re.fullmatch(r"\.[a-z0-9]{1,8}", ext) else ".bin"
