"""Decompression bombs are refused from their headers, with the named limit, on every entry point: the OpenAI chat
route (data URLs: 400 ``media_too_large`` with ``param``), ``POST /v1/captions`` (an error record),
``specstream caption`` (an error record) and ``specstream qa`` (error lines). Before: the PNG bomb was a 500
``internal_error`` carrying Pillow's ``DecompressionBombError`` text.

The bombs, all made here in well under a second:
- ``bomb.png``: a 20000 x 20000 one-bit PNG (400 M pixels; zlib of zero rows, about 50 KB), over twice Pillow's own
  limit, so ``Image.open`` itself refuses it;
- ``big.png``: 10000 x 10000 (100 M pixels), under Pillow's error threshold, over ``max_pixels`` (50 M);
- ``frames.gif``: a 400 x 400 GIF of 2500 frames (each a one-pixel image at its own place, written by hand: 57 KB): 1.2 GB decoded, over ``max_decoded_bytes`` (1 GiB);
- ``claims16k.mp4``: a real 64 x 64 h264 mp4 from ffmpeg whose ``tkhd`` and ``stsd`` boxes are patched to state
  16000 x 16000. Its SPS still says 64 x 64, so the old code decoded it at 64 x 64 (no error): the test shows the
  container header is read before any decoder starts. (Encoding a real 16000 x 16000 h264 takes 27 s and 3.8 GB
  with x264 here, and ffprobe then decodes a frame of it: 660 MB.)
"""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


def _png_1bit(path: Path, width: int, height: int) -> Path:
    """A one-bit greyscale PNG of zeros, written chunk by chunk (nothing of its size is allocated)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    row = b"\x00" * (1 + (width + 7) // 8)
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
                     + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    return path


def _many_frame_gif(path: Path, size: int = 400, frames: int = 2500) -> Path:
    """A GIF89a animation written by hand: a ``size`` x ``size`` logical screen and ``frames`` frames of one pixel
    each (at a different place), every one decoded to a full ``size`` x ``size`` picture."""
    out = [b"GIF89a", struct.pack("<HHBBB", size, size, 0x80, 0, 0), b"\x00\x00\x00\xff\xff\xff",
           b"\x21\xff\x0bNETSCAPE2.0\x03\x01\x00\x00\x00"]  # two-colour table, loop forever
    for k in range(frames):
        x, y = k % size, (k // size) % size
        out.append(b"\x21\xf9\x04\x04\x04\x00\x00\x00")  # graphic control: 40 ms, keep the picture
        out.append(b"\x2c" + struct.pack("<HHHHB", x, y, 1, 1, 0))
        out.append(b"\x02\x02\x4c\x01\x00")  # LZW min code 2: clear, pixel 1, end (3 bits each)
    out.append(b"\x3b")
    path.write_bytes(b"".join(out))
    return path


def _patch_iso_sizes(data: bytearray, width: int, height: int) -> int:
    """Overwrite every tkhd and visual stsd entry's size in an mp4 (boxes found by walking the moov tree)."""
    patched = 0

    def walk(start: int, end: int) -> None:
        nonlocal patched
        pos = start
        while pos + 8 <= end:
            size, kind = struct.unpack(">I4s", data[pos:pos + 8])
            if size < 8:
                return
            if kind in (b"moov", b"trak", b"mdia", b"minf", b"stbl"):
                walk(pos + 8, pos + size)
            elif kind == b"tkhd":
                off = pos + 8 + (88 if data[pos + 8] == 1 else 76)
                if struct.unpack(">I", data[off:off + 4])[0]:
                    data[off:off + 8] = struct.pack(">II", width << 16, height << 16)
                    patched += 1
            elif kind == b"stsd":
                entry = pos + 16
                if data[entry + 4:entry + 8] == b"avc1":
                    data[entry + 32:entry + 36] = struct.pack(">HH", width, height)
                    patched += 1
            pos += size

    walk(0, len(data))
    return patched


@pytest.fixture(scope="module")
def bombs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bombs")
    small = d / "small.mp4"
    subprocess.run(["ffmpeg", "-v", "error", "-y", "-f", "lavfi", "-i", "testsrc=s=64x64:r=10:d=1", "-c:v",
                    "libx264", "-pix_fmt", "yuv420p", str(small)], check=True, timeout=60)
    data = bytearray(small.read_bytes())
    assert _patch_iso_sizes(data, 16000, 16000) == 2
    (d / "claims16k.mp4").write_bytes(bytes(data))
    return {"bomb.png": _png_1bit(d / "bomb.png", 20000, 20000), "big.png": _png_1bit(d / "big.png", 10000, 10000),
            "frames.gif": _many_frame_gif(d / "frames.gif"), "claims16k.mp4": d / "claims16k.mp4",
            "small.mp4": small, "dir": d}


EXPECTED = {"bomb.png": "max_pixels", "big.png": "max_pixels", "frames.gif": "max_decoded_bytes",
            "claims16k.mp4": "max_pixels"}


def test_the_bombs_are_small_files(bombs):
    assert all(bombs[name].stat().st_size < 1_000_000 for name in EXPECTED)


def test_headers_are_checked_before_decoding(bombs):
    from specstream.errors import MediaLimitError
    from specstream.modalities.image import load_image
    from specstream.modalities.limits import MediaLimits, iso_bmff_video_sizes
    from specstream.modalities.video import probe_video

    for name in ("bomb.png", "big.png"):
        with pytest.raises(MediaLimitError) as err:
            load_image(bombs[name])
        assert err.value.code == "media_too_large" and err.value.limit == "max_pixels"
    assert "10000 x 10000 = 100000000 pixels is over the limit of 50000000 (max_pixels)" in str(
        pytest.raises(MediaLimitError, load_image, bombs["big.png"]).value)
    assert iso_bmff_video_sizes(bombs["claims16k.mp4"]) == [(16000, 16000), (16000, 16000)]
    assert iso_bmff_video_sizes(bombs["small.mp4"]) == [(64, 64), (64, 64)]
    with pytest.raises(MediaLimitError) as err:
        probe_video(bombs["claims16k.mp4"])
    assert "16000 x 16000 = 256000000 pixels" in err.value.message
    with pytest.raises(MediaLimitError) as err:
        probe_video(bombs["frames.gif"])
    assert err.value.limit == "max_decoded_bytes" and "400 x 400 x 2500 frames decodes to 1200000000 bytes" in \
        err.value.message
    assert probe_video(bombs["small.mp4"]).width == 64  # a real small video passes
    # decoded bytes of a still image: bytes per pixel of its mode (RGBA: 4)
    rgba = bombs["dir"] / "rgba.png"
    Image.fromarray(np.zeros((100, 100, 4), np.uint8), "RGBA").save(rgba)
    with pytest.raises(MediaLimitError) as err:
        load_image(rgba, MediaLimits(max_pixels=10**6, max_decoded_bytes=39_999))
    assert err.value.limit == "max_decoded_bytes" and "decodes to 40000 bytes" in err.value.message
    assert load_image(rgba, MediaLimits(max_pixels=10**6, max_decoded_bytes=40_000)).shape == (100, 100, 3)


@pytest.fixture(scope="module")
def client(bombs):
    from fastapi.testclient import TestClient

    from specstream.pipeline.server import ServerSettings, create_app

    return TestClient(create_app(ServerSettings()))  # no lifespan: the speech model is not needed here


def _data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


@pytest.mark.parametrize("name,part,mime", [("bomb.png", "image_url", "image/png"),
                                            ("big.png", "image_url", ""),
                                            ("frames.gif", "video_url", "image/gif"),
                                            ("claims16k.mp4", "video_url", "video/mp4")])
def test_chat_data_urls_are_400_with_the_named_limit(client, bombs, name, part, mime):
    body = {"model": "specstream-tiny-llava", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"}, {"type": part, part: {"url": _data_url(bombs[name], mime)}}]}]}
    res = client.post("/v1/chat/completions", json=body)
    assert res.status_code == 400, res.text
    err = res.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "media_too_large",
                                                        "messages.0.content.1")
    assert f"({EXPECTED[name]})" in err["message"]
    assert "DecompressionBomb" not in err["message"] or name == "bomb.png"


def test_caption_route_gives_error_records(client, bombs):
    for name in EXPECTED:
        res = client.post("/v1/captions", files={"file": (name, bombs[name].read_bytes())},
                          data={"max_new_tokens": "2"})
        assert res.status_code == 200, res.text
        records = res.json()["records"]
        assert [r["error"]["code"] for r in records] == ["media_too_large"], records
        assert records[0]["source"] == name and f"({EXPECTED[name]})" in records[0]["error"]["message"]
        assert str(bombs["dir"]) not in records[0]["error"]["message"]


def test_caption_cli_records_and_qa_error_lines(bombs, tmp_path):
    from specstream.cli import main

    out = tmp_path / "c.jsonl"
    code = main(["caption", *(str(bombs[n]) for n in EXPECTED), "--out", str(out), "--max-new-tokens", "2",
                 "--no-progress"])
    assert code == 1
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert {Path(r["source"]).name: r["error"]["code"] for r in recs} == {n: "media_too_large" for n in EXPECTED}
    # a flag lowers a limit: the small real video is now refused too
    out2 = tmp_path / "c2.jsonl"
    assert main(["caption", str(bombs["small.mp4"]), "--out", str(out2), "--max-image-pixels", "4000",
                 "--no-progress"]) == 1
    rec = json.loads(out2.read_text())
    assert rec["error"]["code"] == "media_too_large" and "64 x 64 = 4096 pixels" in rec["error"]["message"]

    from specstream.pipeline.qa_job import qa_main

    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"id": n, "video": str(bombs[n]), "questions": [{"id": "q",
                                                                                          "text": "What?"}]}) + "\n"
                                for n in ("frames.gif", "claims16k.mp4")))
    answers = tmp_path / "a.jsonl"
    assert qa_main([str(manifest), "--out", str(answers), "--no-transcript", "--no-progress"]) == 1
    lines = [json.loads(x) for x in answers.read_text().splitlines()]
    assert sorted((r["id"], r["error"]["code"]) for r in lines) == [("claims16k.mp4", "media_too_large"),
                                                                     ("frames.gif", "media_too_large")], lines
