"""Keyframes that are really scenes, on real media with frame-exact known transitions (`scene_media`): a hard cut
just after a camera swing keeps its keyframe (the stronger of two close boundaries wins), flashes of 3-4 frames
and dips to black or white inside one shot give none, a fade through white or black gives one on the new scene's
first stable frame, a crossfade gives one where the new shot is whole, black at both ends of a clip is no scene,
and no keyframe image is near-uniform. Then the minimum-length arbiter's exact rules, and streaming resumption
in the middle of excursions."""

from __future__ import annotations

import json

import numpy as np
import pytest

import scene_media
from specstream.modalities.video import iter_proxy_frames
from specstream.stages.keyframes import (
    HistogramDetector,
    HistogramDetectorParams,
    KeyframeSelector,
    SceneBoundary,
    SceneDetector,
    select_keyframes,
)
from specstream.stages.keyframes.selector import KeyframeRun

pytestmark = pytest.mark.timeout(120)

BLANK_STD = 4 / 255


@pytest.fixture(scope="session")
def scene_clips(tmp_path_factory):
    """The clips of `scene_media`, built once per test session."""
    return scene_media.build(tmp_path_factory.mktemp("scenes"))


def _luma_std(image: np.ndarray) -> float:
    return float((image.astype(np.float64) @ [0.299, 0.587, 0.114]).std()) / 255.0


@pytest.mark.parametrize("name", sorted(scene_media.CLIPS))
def test_keyframes_are_scenes(scene_clips, name):
    """Keyframe PTS against the known transition times. A hard cut's keyframe is its first frame, exactly. A
    transition's keyframe is the first frame it leaves whole (the end of the ffmpeg fade or crossfade), or up to
    2 frames later: never earlier, where the picture is still blended with white, black or the old shot; the
    settling rule looks 0.12 s (3 frames) ahead for the luma to stay within 0.02, and the new shots move, so it
    may accept a frame or two late. And no keyframe image is near-uniform (luma std < 4/255)."""
    exp = scene_media.CLIPS[name]
    run = select_keyframes(scene_clips[name])
    kfs = list(run)
    times = [k.timestamp_s for k in kfs]
    assert len(times) == len(exp.times), (name, times)
    for t, want in zip(times, exp.times):
        if want in exp.stable:
            assert want - 1e-6 <= t <= want + 2 / exp.fps + 1e-6, (name, times)
        else:
            assert t == want, (name, times)
    for k in kfs:
        assert k.image is not None and k.image.shape == (180, 320, 3)
        assert _luma_std(k.image) >= BLANK_STD, (name, k.timestamp_s, float(k.image.mean()))
    assert run.stats.dropped_as_blank == 0  # the detector itself never chose a blank frame


def test_cut_after_camera_swing_keeps_its_scene(scene_clips):
    """The swing 0.36-0.56 s before the cut is a candidate of its own (seen with a shorter minimum length); within
    0.5 s of the cut, the cut (abrupt, tier 2) beats it (gradual, tier 1), and the 5.3-s scene after the cut keeps
    its keyframe."""
    frames = list(iter_proxy_frames(scene_clips["handheld_cut.mp4"]))
    cut_frame = round(scene_media.HANDHELD_CUT_S * scene_media.FPS)

    def run(min_len: float) -> list[SceneBoundary]:
        det = HistogramDetector(HistogramDetectorParams(min_scene_len_s=min_len))
        out = [b for f in frames for b in det.process_frame(f.frame_index, f.timestamp_s, f.image)]
        return out + det.post_process()

    loose = run(0.1)
    assert [(b.kind, b.frame_index) for b in loose if b.kind != "fade"] == [("start", 0), ("cut", cut_frame)]
    swings = [b for b in loose if b.kind == "fade"]
    assert len(swings) == 1 and 9.44 <= swings[0].timestamp_s < scene_media.HANDHELD_CUT_S
    assert swings[0].score > loose[-1].score  # the swing changes the picture more; the cut is the abrupt one
    assert [(b.kind, b.frame_index) for b in run(0.5)] == [("start", 0), ("cut", cut_frame)]


def test_streaming_state_resumes_inside_flashes_and_fades(scene_clips):
    """Persist and restore the selector before every frame, through flashes, a fade through black and black at
    both ends of a clip: the same keyframes as one uninterrupted run, from a state under 4 KiB (Kafka's default
    offset.metadata.max.bytes) at 25 and at 29.97 fps."""
    for name in ("flash3.mp4", "fade_black.mp4", "edges.mp4"):
        frames = list(iter_proxy_frames(scene_clips[name]))
        whole = KeyframeSelector()
        expected = [k for f in frames for k in whole.push(f.frame_index, f.timestamp_s, f.image)] + whole.finish()
        sel, got, max_size = KeyframeSelector(), [], 0
        for f in frames:
            blob = json.dumps(sel.state_dict(), separators=(",", ":"))
            max_size = max(max_size, len(blob))
            sel = KeyframeSelector.from_state(json.loads(blob))
            got.extend(sel.push(f.frame_index, f.timestamp_s, f.image))
        got.extend(sel.finish())
        assert [(k.frame_index, k.timestamp_s, k.scene_score) for k in got] == [
            (k.frame_index, k.timestamp_s, k.scene_score) for k in expected], name
        assert max_size < 4096, (name, max_size)


def test_older_detector_state_is_refused_with_a_clear_error():
    state = HistogramDetector().state_dict()
    state["version"] = 1
    with pytest.raises(ValueError, match="version 1 .* cannot be resumed"):
        HistogramDetector.from_state(state)


class _Fixed(SceneDetector):
    """A detector that reports boundaries at given frame indices (any detector may be wrong about a frame)."""

    def __init__(self, indices):
        self.indices = set(indices)

    def process_frame(self, frame_index, timestamp_s, frame):
        return [SceneBoundary(frame_index, timestamp_s, 1.0, "cut")] if frame_index in self.indices else []

    def state_dict(self):
        return {"type": "fixed", "indices": sorted(self.indices)}

    @classmethod
    def from_state(cls, state):
        return cls(state["indices"])


def test_a_near_uniform_keyframe_image_is_never_yielded(scene_clips):
    """Whatever a detector reports, a full-resolution keyframe image that is near-uniform is dropped (counted),
    never yielded: frame 60 of flash3.mp4 is pure white."""
    run = KeyframeRun(str(scene_clips["flash3.mp4"]), detector_factory=lambda: _Fixed([0, 60, 90]),
                      max_keyframes_per_minute=None, decode_images=True, proxy_long_side=64, backend="auto",
                      stall_timeout_s=30.0, deduplicator=None)
    kfs = list(run)
    assert [k.frame_index for k in kfs] == [0, 90]
    assert run.stats.dropped_as_blank == 1 and run.stats.keyframes == 2


# -- the detector's rules on synthetic frames (exact, no decoding) ------------------------------------------------


def _scene(seed: int, n: int, base: tuple[int, int, int]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    tex = rng.integers(-40, 40, (36, 64, 3))
    return [np.clip(np.array(base) + tex + rng.integers(-3, 4, (36, 64, 3)), 0, 255).astype(np.uint8)
            for _ in range(n)]


def _run(frames, fps=25.0, params=None):
    det = HistogramDetector(params)
    out = []
    for i, f in enumerate(frames):
        out += det.process_frame(i, i / fps, f)
    return out + det.post_process()


def test_a_brightening_flash_of_160_ms_is_not_a_scene():
    """A camera flash that brightens the picture (not to white: its texture stays) for 4 frames at 25 fps."""
    a = _scene(1, 60, (120, 90, 70))
    flash = [np.clip(f.astype(int) + 90, 0, 255).astype(np.uint8) for f in a[30:34]]
    out = _run(a[:30] + flash + a[34:])
    assert [(b.frame_index, b.kind) for b in out] == [(0, "start")]


def test_flash_soon_after_a_cut_leaves_the_cut_its_keyframe():
    """After a cut up to a brighter shot that keeps brightening (auto exposure), a white flash: the luma run that
    leads into the flash begins at the cut, so the cut stays the keyframe (it is not taken for a fade-out)."""
    a = _scene(1, 30, (200, 60, 40))
    b = [np.clip(f.astype(int) + k, 0, 255).astype(np.uint8) for k, f in enumerate(_scene(2, 40, (90, 160, 230)))]
    white = np.full_like(a[0], 255)
    out = _run(a + b[:8] + [white, white] + b[10:])
    assert [(x.frame_index, x.kind) for x in out] == [(0, "start"), (30, "cut")]


def test_stream_ending_in_a_fade_out_to_black_adds_no_scene():
    a = _scene(2, 40, (200, 60, 40))
    fade = [np.round(a[-1] * w).astype(np.uint8) for w in np.linspace(1, 0, 15)[1:]]
    out = _run(a + fade + [np.zeros_like(a[0])] * 5)
    assert [(b.frame_index, b.kind) for b in out] == [(0, "start")]


# -- the minimum scene length: the stronger of two close candidates wins ----------------------------------------


def _b(i, t, score=0.3, kind="cut"):
    return SceneBoundary(i, t, score, kind)


def test_arbiter_keeps_the_stronger_of_two_close_candidates_whichever_comes_first():
    from specstream.stages.keyframes import MinSceneLengthArbiter

    arb = MinSceneLengthArbiter(0.5)
    arb.offer(_b(0, 0.0, 1.0, "start"), tier=0)
    arb.offer(_b(240, 9.6, 0.39, "fade"), tier=1)
    arb.offer(_b(250, 10.0, 0.33, "cut"), tier=2)  # 0.4 s after the fade: the cut wins on tier
    assert arb.release(10.49) == [_b(0, 0.0, 1.0, "start")]  # the cut may still meet a stronger one before 10.5
    assert arb.release(10.5) == [_b(250, 10.0, 0.33, "cut")]
    arb = MinSceneLengthArbiter(0.5)
    arb.offer(_b(10, 1.0, 0.6), tier=2)
    arb.offer(_b(15, 1.2, 0.4), tier=2)  # same tier: the higher score wins, here the earlier one
    arb.offer(_b(20, 1.4, 0.4), tier=2)  # compared with the one kept (0.4 s apart): weaker again
    arb.offer(_b(30, 1.8, 0.5), tier=2)  # 0.8 s after the kept one: no conflict
    assert arb.flush() == [_b(10, 1.0, 0.6), _b(30, 1.8, 0.5)]


def test_arbiter_start_yields_to_a_cut_ties_go_to_the_later_and_retraction():
    from specstream.stages.keyframes import MinSceneLengthArbiter

    arb = MinSceneLengthArbiter(0.5)
    arb.offer(_b(0, 0.0, 1.0, "start"), tier=0)
    arb.offer(_b(5, 0.2, 0.2), tier=2)  # a cut 0.2 s into the stream: the first scene starts there
    arb.offer(_b(30, 1.2, 0.4), tier=2)
    arb.offer(_b(35, 1.4, 0.4), tier=2)  # a tie: the later one starts the scene that is not cut short
    arb.offer(_b(60, 2.4, 0.4), tier=2)
    arb.retract_from(60)  # e.g. it lay inside a dip to black
    assert arb.flush() == [_b(5, 0.2, 0.2), _b(35, 1.4, 0.4)]
    state = json.loads(json.dumps(arb.state_dict()))
    again = MinSceneLengthArbiter.from_state(state)
    again.offer(_b(40, 1.6, 0.9), tier=2)  # too close to a boundary already reported: dropped
    assert again.flush() == []
