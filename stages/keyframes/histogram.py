"""HistogramDetector: colour-histogram scene detection with an adaptive threshold, flash and blank-frame
handling, fades through black or white, crossfades, and a minimum scene length where the stronger boundary wins.
Streaming, with a JSON-serialisable state.

Per proxy frame it computes an HSV histogram, the mean luma and the luma's standard deviation (`features`).
Frames flow through these steps, each waiting only for the frames it needs:

1. **Flashes and blank frames** (lag ``max_flash_s``). A frame whose luma is at least ``flash_luma_delta`` above
   (or below) some frame within ``max_flash_s`` before it *and* some frame within ``max_flash_s`` after it is a
   flash (or a dropout): a camera flash or a strobe of up to ``max_flash_s``, however many frames that is. A
   frame whose luma standard deviation is below ``blank_std`` is *blank* (near-uniform: black, white, a flat
   colour). Flash and blank frames are never keyframes; they open an *excursion* (step 2). Looking at both
   sides of a spike is the idea discussed in PySceneDetect's bug report 35 (rav1e's scene-change detector compares
   the frame before a change with the frames after it); here on luma, and over seconds rather than frames.
2. **Excursions: flashes, dips and fades through black or white.** When an excursion opens, the frames of a
   fade-out leading into it (the current run of luma steps of at least ``ramp_luma_step`` towards the flash or
   blank luma) are taken into it, and the picture just before that run is the *reference*. After the last flash
   or blank frame, the first *stable* frame is the first one whose luma stays, for the next ``settle_s``, within
   ``settle_luma`` or within a third of the step into it (the end of a fade-in: a fade moves on by as much as its
   last step, a cut from black to a moving shot jumps once; at most ``max_settle_s`` after the last blank
   frame). If its histogram differs from the reference by at least ``cut_threshold``, the excursion was a
   transition: one boundary, on that stable frame. If not, it was a flash or a dip inside one shot: no boundary
   at all. This replaces a frame-count rule (PySceneDetect's ``ThresholdDetector`` puts a cut at every return
   from black, and a minimum fade-out length was added there for short dips, its report 278) by comparing the
   pictures on both sides, so a dip of any length inside one shot is no scene, and a fade through white or black
   (its report 143) gives one.
3. **Cuts** (lag ``adaptive_window`` usable frames): ``d1`` = histogram distance to the previous usable frame. A
   frame is a cut candidate when ``d1 >= cut_threshold`` and ``d1 >= adaptive_ratio *`` the mean ``d1`` of its
   ``adaptive_window`` neighbours on each side (PySceneDetect's AdaptiveDetector rule): a cut is a spike, while
   fast motion or a fade raise ``d1`` on many frames together.
4. **Crossfades and other gradual changes** (lag up to ``fade_window_s + max_fade_s``): ``dW`` = histogram
   distance to the frame ``fade_window_s`` earlier (history sampled every ``fade_sample_s``). A transition opens
   when ``dW >= fade_threshold`` and closes when ``dW < fade_release * fade_threshold`` (or after
   ``max_fade_s``). Its one candidate is the first frame of the *calm* run (frames with ``d1 < calm_d``, lasting
   at least ``settle_s``) in progress when it closes, if that frame already shows the picture after the
   transition: the first frame where the new shot is whole and still. Otherwise (the new shot moves) the ``dW``
   peak, or for a transition longer than the window the earliest history sample close to the picture after it.
5. **Minimum scene length** (`MinSceneLengthArbiter`, lag ``min_scene_len_s`` plus what the steps above may still
   place earlier): of two candidates closer than ``min_scene_len_s`` the stronger wins. Cuts and excursions
   (tier 2) beat gradual changes (tier 1), which camera motion can also cause, and those beat the start of the
   stream (tier 0); within a tier the higher score wins, a tie goes to the later candidate.

The first usable frame starts the first scene (kind ``"start"``, score 1.0), or the first stable frame after the
flash or blank frames the stream begins with. No boundary is ever placed on a flash or blank frame.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any

from .arbiter import MinSceneLengthArbiter
from .base import SceneBoundary, SceneDetector
from .features import decode_hist, encode_hist, frame_feature, hist_distance

_EPS = 1e-9
TIER_START, TIER_GRADUAL, TIER_CUT = 0, 1, 2
_STATE_VERSION = 2


@dataclass(frozen=True)
class HistogramDetectorParams:
    """Parameters of `HistogramDetector`. Distances are in [0, 1]; times in seconds; luma in [0, 1]."""

    cut_threshold: float = 0.15
    adaptive_ratio: float = 3.0
    adaptive_window: int = 2  # usable frames on each side
    min_scene_len_s: float = 0.5
    max_flash_s: float = 0.2  # luma spikes up to this long are flashes (5 frames at 25 fps, 6 at 29.97)
    flash_luma_delta: float = 0.2
    blank_std: float = 4 / 255  # luma standard deviation below which a frame is near-uniform (blank)
    ramp_luma_step: float = 0.003  # per-frame luma step that continues a fade-out run into an excursion
    settle_luma: float = 0.02  # a stable frame's luma stays this close over the next settle_s
    settle_s: float = 0.12
    max_settle_s: float = 1.0  # after the last blank/flash frame, the stable frame is searched this long at most
    calm_d: float = 0.025  # d1 below this: a calm frame (the end of a crossfade is the start of a calm run)
    fade_threshold: float = 0.35
    fade_release: float = 0.7
    fade_window_s: float = 1.0
    fade_sample_s: float = 0.2
    max_fade_s: float = 4.0
    max_ramp_s: float = 1.0  # a fade-out run older than this no longer holds candidates back

    def __post_init__(self):
        if self.adaptive_window < 1:
            raise ValueError("adaptive_window must be >= 1")
        if not (0 < self.fade_release <= 1):
            raise ValueError("fade_release must be in (0, 1]")
        if self.fade_window_s <= 0 or self.fade_sample_s <= 0 or self.max_fade_s <= 0:
            raise ValueError("fade_window_s, fade_sample_s and max_fade_s must be > 0")
        for name in ("min_scene_len_s", "max_flash_s", "settle_s", "max_settle_s", "max_ramp_s", "blank_std",
                     "ramp_luma_step", "settle_luma", "calm_d"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


def _rec(frame_index: int, timestamp_s: float, frame) -> dict[str, Any]:
    feat = frame_feature(frame)
    return {"i": int(frame_index), "t": float(timestamp_s), "h": encode_hist(feat.hist), "y": round(feat.luma, 5),
            "s": round(feat.luma_std, 5)}


def _dist(a: str, b: str) -> float:
    return hist_distance(decode_hist(a), decode_hist(b))


class HistogramDetector(SceneDetector):
    """Colour-histogram scene detector (see the module docstring). State: `state_dict` / `from_state`.

    ``max_lag_s``: a boundary is reported at most this many seconds (of presentation time) after the frame it
    refers to; the sum of the look-aheads above.
    """

    def __init__(self, params: HistogramDetectorParams | None = None):
        self.params = params or HistogramDetectorParams()
        p = self.params
        self.max_lag_s = (p.max_flash_s + p.fade_window_s + p.max_fade_s + p.min_scene_len_s + p.settle_s
                          + p.max_settle_s + 0.2)
        self._arb = MinSceneLengthArbiter(p.min_scene_len_s)
        self._s: dict[str, Any] = {
            "ctx": [],  # [t, luma] of the classified frames of the last max_flash_s (any kind)
            "qa": [],  # frames awaiting flash/blank classification
            "prev": None,  # the last usable frame {"i", "t", "y", "h"}: d1 and excursion references
            "run": None,  # {"dir", "i", "t", "h"}: the frame before the current monotonic luma run
            "ex": None,  # open excursion {"ref", "i0", "ramped", "last_bad_t", "prev_y", "settle"}
            "qc": [],  # usable frames: adaptive_window decided ones for context, then the undecided ones
            "qc_next": 0,  # index in qc of the next frame to decide
            "t3": None,  # timestamp of the last frame decided by the cut/fade steps
            "started": False,
            "samples": [],  # [t, hist, frame_index] history for dW, one per fade_sample_s, restarted at boundaries
            "fade": None,  # {"peak", "i", "t", "start_t"} while a gradual transition is open
            "calm": None,  # [frame_index, t, hist] of the first frame of the current calm run
            "finished": False,
        }

    # -- public interface -------------------------------------------------------------------------------------
    def process_frame(self, frame_index: int, timestamp_s: float, frame) -> list[SceneBoundary]:
        """See `SceneDetector.process_frame`. ``frame`` is a proxy frame [h, w, 3] uint8 RGB."""
        if self._s["finished"]:
            raise RuntimeError("process_frame() after post_process()")
        qa = self._s["qa"]
        qa.append(_rec(frame_index, timestamp_s, frame))
        while qa and qa[-1]["t"] >= qa[0]["t"] + self.params.max_flash_s - _EPS:
            self._classify(qa.pop(0))
        return self._arb.release(self._frontier())

    def post_process(self) -> list[SceneBoundary]:
        """See `SceneDetector.post_process`."""
        s = self._s
        while s["qa"]:
            self._classify(s["qa"].pop(0))
        if s["ex"] is not None:
            self._end_excursion()
        while s["qc_next"] < len(s["qc"]):
            self._decide(flushing=True)
        if s["fade"] is not None:  # only if the new picture was reached: a fade-out at the end starts no scene
            self._emit_fade(s["qc"][-1]["h"] if s["qc"] else None, s["t3"], final=True)
        s["finished"] = True
        return self._arb.flush()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: {"type", "version", "params", "state", "arbiter"}; about 2-3 kB at 25-30 fps
        (histograms of the frames still pending, 88 characters each)."""
        return {"type": "histogram", "version": _STATE_VERSION, "params": asdict(self.params),
                "state": copy.deepcopy(self._s), "arbiter": self._arb.state_dict()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> HistogramDetector:
        """Rebuild from `state_dict` output (also after a JSON round trip). Raises ValueError on a state of
        another detector or of another version of this one."""
        if state.get("type") != "histogram":
            raise ValueError(f"not a HistogramDetector state: type={state.get('type')!r}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"HistogramDetector state version {state.get('version')!r} is not "
                             f"{_STATE_VERSION}: it was saved by another release and cannot be resumed")
        det = cls(HistogramDetectorParams(**state["params"]))
        det._s = copy.deepcopy(state["state"])
        det._arb = MinSceneLengthArbiter.from_state(state["arbiter"])
        return det

    # -- step 1: flash and blank frames ------------------------------------------------------------------------
    def _classify(self, rec: dict[str, Any]) -> None:
        p = self.params
        s = self._s
        w = p.max_flash_s
        t, y = rec["t"], rec["y"]
        before = [b for bt, b in s["ctx"] if bt >= t - w - _EPS]
        after = [r["y"] for r in s["qa"] if r["t"] <= t + w + _EPS]
        d = p.flash_luma_delta
        bright = any(y - b >= d for b in before) and any(y - a >= d for a in after)
        dark = any(b - y >= d for b in before) and any(a - y >= d for a in after)
        s["ctx"] = [c for c in s["ctx"] if c[0] >= t - w - _EPS] + [[t, y]]
        if bright or dark or rec["s"] < p.blank_std:
            self._bad(rec)
        elif s["ex"] is not None:
            self._settle(rec)
        else:
            self._track_run(rec)
            self._to_cut_step(rec)

    # -- step 2: excursions ------------------------------------------------------------------------------------
    def _bad(self, rec: dict[str, Any]) -> None:
        """A flash or blank frame: open the excursion, or extend the open one."""
        s = self._s
        ex = s["ex"]
        if ex is not None:
            if ex["settle"]:  # it was settling: those frames were part of the transition
                ex["settle"] = []
                ex["ramped"] = True
            ex["last_bad_t"] = rec["t"]
            ex["prev_y"] = rec["y"]
            return
        prev, run = s["prev"], s["run"]
        if prev is None:  # the stream begins with flash or blank frames
            ref, i0, ramped = None, rec["i"], False
        else:
            towards = -1 if rec["y"] < prev["y"] else 1
            if run is not None and run["dir"] == towards:  # a fade-out leads into it
                ref, i0, ramped = run["h"], run["i"] + 1, True
            else:
                ref, i0, ramped = prev["h"], rec["i"], False
        # Frames from i0 on belong to the transition: the undecided ones leave the cut step, candidates on them
        # are withdrawn, and an open gradual transition is superseded.
        qc, k = s["qc"], s["qc_next"]
        s["qc"] = qc[:k] + [r for r in qc[k:] if r["i"] < i0]
        while s["qc_next"] < len(s["qc"]):
            self._decide(flushing=True)
        self._arb.retract_from(i0)
        s["fade"] = None
        s["calm"] = None
        s["run"] = None
        s["ex"] = {"ref": ref, "i0": i0, "ramped": ramped, "last_bad_t": rec["t"], "prev_y": rec["y"], "settle": []}

    def _settle(self, rec: dict[str, Any]) -> None:
        """A usable frame after flash/blank frames: find the first stable one, then decide the excursion."""
        p = self.params
        ex = self._s["ex"]
        st = ex["settle"]
        st.append(rec)
        while st:
            head = st[0]
            seen = st[-1]["t"] >= head["t"] + p.settle_s - _EPS
            forced = head["t"] - ex["last_bad_t"] >= p.max_settle_s - _EPS
            if not seen and not forced:
                return
            if forced or self._stable(head, st[1:], ex["prev_y"]):
                self._verdict()
                return
            ex["prev_y"] = st.pop(0)["y"]  # still fading in
            ex["ramped"] = True

    def _stable(self, head: dict[str, Any], later: list[dict[str, Any]], prev_y: float) -> bool:
        """``head`` is stable when the luma of the frames within ``settle_s`` after it stays within
        ``settle_luma`` of its own, or within a third of the step into it from the frame before (``prev_y``): a
        fade-in moves on by as much as its last step, a cut from black to a moving shot jumps once and then
        moves by much less."""
        p = self.params
        window = [abs(r["y"] - head["y"]) for r in later if r["t"] <= head["t"] + p.settle_s + _EPS]
        return max(window, default=0.0) <= max(p.settle_luma, abs(head["y"] - prev_y) / 3.0)

    def _end_excursion(self) -> None:
        """End of stream inside an excursion: decide it on the first frame whose remaining frames are stable."""
        ex = self._s["ex"]
        st = ex["settle"]
        if not st:  # ended on flash/blank frames: no scene there
            self._s["ex"] = None
            return
        prev_y = ex["prev_y"]
        for k, head in enumerate(st):
            if len(st) > k + 1 and self._stable(head, st[k + 1:], prev_y):
                ex["ramped"] = ex["ramped"] or k > 0
                del st[:k]
                self._verdict()
                return
            prev_y = head["y"]
        self._s["ex"] = None  # no stable picture before the end: no scene there

    def _verdict(self) -> None:
        """The excursion's first stable frame is ``settle[0]``: one boundary there if the picture changed."""
        p = self.params
        s = self._s
        ex = s["ex"]
        s["ex"] = None
        head, rest = ex["settle"][0], ex["settle"][1:]
        if ex["ref"] is None:
            self._start(head)
        else:
            dist = _dist(ex["ref"], head["h"])
            if dist >= p.cut_threshold:
                kind = "fade" if ex["ramped"] else "cut"
                self._arb.offer(SceneBoundary(head["i"], head["t"], round(dist, 6), kind), TIER_CUT)
        # the cut and fade steps restart at the stable frame, which is decided here
        head["d"] = 0.0
        s["prev"] = {k: head[k] for k in ("i", "t", "y", "h")}
        s["run"] = None
        s["qc"] = [head]
        s["qc_next"] = 1
        s["t3"] = head["t"]
        s["samples"] = [[head["t"], head["h"], head["i"]]]
        s["fade"] = None
        s["calm"] = None
        for r in rest:
            self._track_run(r)
            self._to_cut_step(r)

    def _track_run(self, rec: dict[str, Any]) -> None:
        """Follow the current run of luma steps in one direction (a possible fade-out)."""
        p = self.params
        s = self._s
        prev = s["prev"]
        if prev is None:
            return
        step = rec["y"] - prev["y"]
        direction = 1 if step >= p.ramp_luma_step else -1 if step <= -p.ramp_luma_step else 0
        run = s["run"]
        if direction == 0:
            s["run"] = None
        elif run is None or run["dir"] != direction:
            s["run"] = {"dir": direction, "i": prev["i"], "t": prev["t"], "h": prev["h"]}

    # -- steps 3 and 4: cuts and gradual changes ----------------------------------------------------------------
    def _to_cut_step(self, rec: dict[str, Any]) -> None:
        s = self._s
        prev = s["prev"]
        rec["d"] = 0.0 if prev is None else _dist(prev["h"], rec["h"])
        s["prev"] = {k: rec[k] for k in ("i", "t", "y", "h")}
        s["qc"].append(rec)
        while len(s["qc"]) - s["qc_next"] > self.params.adaptive_window:
            self._decide(flushing=False)

    def _start(self, rec: dict[str, Any]) -> None:
        s = self._s
        self._arb.offer(SceneBoundary(rec["i"], rec["t"], 1.0, "start"), TIER_START)
        s["started"] = True
        s["samples"] = [[rec["t"], rec["h"], rec["i"]]]

    def _decide(self, flushing: bool) -> None:
        p = self.params
        s = self._s
        qc = s["qc"]
        k = s["qc_next"]
        rec = qc[k]
        s["qc_next"] = k + 1
        t = rec["t"]
        s["t3"] = t
        if not s["started"]:  # first usable frame: the first scene starts here
            self._start(rec)
            self._trim_qc()
            return
        neighbours = [r["d"] for r in qc[max(0, k - p.adaptive_window): k] + qc[k + 1: k + 1 + p.adaptive_window]]
        mean_nb = sum(neighbours) / len(neighbours) if neighbours else 0.0
        d1 = rec["d"]
        if d1 >= p.cut_threshold and d1 >= p.adaptive_ratio * mean_nb:
            if s["fade"] is not None:
                self._emit_fade(qc[k - 1]["h"] if k > 0 else None, t, at_cut=True)
            self._arb.offer(SceneBoundary(rec["i"], t, round(d1, 6), "cut"), TIER_CUT)
            s["samples"] = [[t, rec["h"], rec["i"]]]  # restart the fade history in the new picture
            s["calm"] = None
            run = s["run"]
            if run is not None and run["i"] < rec["i"]:  # a fade-out can begin at the cut, not before it
                s["run"] = {"dir": run["dir"], "i": rec["i"], "t": t, "h": rec["h"]}
        else:
            self._fade_step(rec)
        self._trim_qc()

    def _fade_step(self, rec: dict[str, Any]) -> None:
        p = self.params
        s = self._s
        t = rec["t"]
        if rec["d"] >= p.calm_d:
            s["calm"] = None
        elif s["calm"] is None:
            s["calm"] = [rec["i"], t, rec["h"]]
        samples = s["samples"]
        while len(samples) >= 2 and samples[1][0] <= t - p.fade_window_s:
            samples.pop(0)
        dw = _dist(samples[0][1], rec["h"]) if samples else 0.0
        fade = s["fade"]
        if fade is None:
            if dw >= p.fade_threshold:
                s["fade"] = {"peak": dw, "i": rec["i"], "t": t, "start_t": t}
        else:
            if dw > fade["peak"]:
                fade.update(peak=dw, i=rec["i"], t=t)
            if dw < p.fade_release * p.fade_threshold or t - fade["start_t"] >= p.max_fade_s:
                self._emit_fade(rec["h"], t)
                s["samples"] = [[t, rec["h"], rec["i"]]]
        if not s["samples"] or t - s["samples"][-1][0] >= p.fade_sample_s:
            s["samples"].append([t, rec["h"], rec["i"]])

    def _emit_fade(self, current: str | None, now: float | None, at_cut: bool = False, final: bool = False) -> None:
        """Offer the open gradual transition's candidate: the start of the calm run in progress when it closed, if
        that frame shows the picture after it (``current``: the histogram of the last frame before ``now``);
        else the ``dW`` peak, or for a transition longer than the window the earliest history sample close to
        ``current`` after the peak. ``final`` (end of stream, the transition never closed): only the calm run."""
        p = self.params
        s = self._s
        fade = s["fade"]
        s["fade"] = None
        i, t = fade["i"], fade["t"]
        calm = s["calm"]
        close = p.fade_release * p.fade_threshold
        if (calm is not None and current is not None and now is not None and now - calm[1] >= p.settle_s - _EPS
                and calm[1] >= fade["start_t"] - p.fade_window_s - _EPS and _dist(calm[2], current) < close):
            i, t = calm[0], calm[1]
        elif final:
            return
        elif current is not None and not at_cut:
            for st, sh, si in s["samples"]:
                if st > t and _dist(sh, current) < close:
                    i, t = si, st
                    break
        self._arb.offer(SceneBoundary(i, t, round(fade["peak"], 6), "fade"), TIER_GRADUAL)

    def _trim_qc(self) -> None:
        s = self._s
        drop = s["qc_next"] - self.params.adaptive_window
        if drop > 0:
            del s["qc"][:drop]
            s["qc_next"] -= drop

    # -- step 5: the frontier for the minimum-length arbiter -----------------------------------------------------
    def _frontier(self) -> float:
        """The earliest timestamp a candidate not yet offered can refer to."""
        p = self.params
        s = self._s
        ex = s["ex"]
        if ex is not None:  # the excursion's boundary, if any, lies after its blank frames
            return ex["settle"][0]["t"] if ex["settle"] else ex["last_bad_t"]
        if s["t3"] is None:
            return float("-inf")
        now = s["t3"]
        calm = s["calm"]
        # a gradual transition closing later is placed no earlier than the calm run in progress, and at most one
        # window before it opens
        f = max(calm[1], now - p.fade_window_s) if calm is not None else now
        if s["fade"] is not None:
            f = min(f, s["fade"]["start_t"] - p.fade_window_s)
        run = s["run"]
        if run is not None:  # a fade-out in progress could still lead into an excursion, which withdraws it
            f = min(f, max(run["t"], s["prev"]["t"] - p.max_ramp_s))
        return f
