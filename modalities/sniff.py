"""Video containers told by their signature (the first bytes of a file), as file(1)/libmagic does.

Read by the media limits (:mod:`specstream.modalities.limits`, before anything is decoded) and by the caption
stage's image-or-video choice; nothing here opens a decoder.
"""

from __future__ import annotations


#: ISO base media file format (ISO/IEC 14496-12) brands of still images (HEIF, AVIF): not videos
_STILL_BRANDS = frozenset({b"heic", b"heix", b"heim", b"heis", b"mif1", b"msf1", b"avif", b"avis"})
#: top-level QuickTime atoms a .mov may start with instead of ``ftyp`` (QuickTime File Format, "Movie atoms")
_QT_ATOMS = frozenset({b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot"})
SNIFF_BYTES = 192  # enough for every signature below (an MPEG-TS sync byte repeats at offset 188)


def sniff_container(head: bytes) -> str | None:
    """The video container a file starting with ``head`` (its first ``SNIFF_BYTES`` bytes) is, judged by the
    container's signature as file(1)/libmagic does, or None when no video signature matches.

    Returns one of ``"mp4"`` (ISO BMFF: mp4, m4v, 3gp; also audio-only m4a, which decoding then reports as
    ``no_video_stream``), ``"mov"``, ``"matroska"`` (mkv, webm), ``"avi"``, ``"gif"``, ``"flv"``, ``"ogg"``,
    ``"mpeg"`` (program stream or elementary video), ``"mpegts"``. Nothing is decoded; a damaged file with an
    intact signature is still named (decoding reports the damage).
    """
    if len(head) >= 12 and head[4:8] == b"ftyp":
        if head[8:12] in _STILL_BRANDS:
            return None
        return "mov" if head[8:12] == b"qt  " else "mp4"
    if len(head) >= 8 and head[4:8] in _QT_ATOMS:
        return "mov"
    if head.startswith(b"\x1a\x45\xdf\xa3"):  # EBML header
        return "matroska"
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "avi"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:4] == b"FLV\x01":
        return "flv"
    if head[:4] == b"OggS":
        return "ogg"
    if head[:4] in (b"\x00\x00\x01\xba", b"\x00\x00\x01\xb3"):  # pack header, sequence header
        return "mpeg"
    if len(head) > 188 and head[0] == 0x47 and head[188] == 0x47:  # two 188-byte packets' sync bytes
        return "mpegts"
    return None
