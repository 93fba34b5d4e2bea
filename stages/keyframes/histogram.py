"""HistogramDetector: colour-histogram scene detection with an adaptive threshold, flash suppression and fade
detection. Streaming, with a JSON-serialisable state.

Per proxy frame it computes an HSV histogram and the mean luma (`features`). Three stages, each waiting only for
the frames it needs:

1. **Flash/glitch frames** (lag ``max_flash_frames``): a frame whose luma is at least ``flash_luma_delta`` above
   (or below) some frame within ``max_flash_frames`` before it *and* some frame within ``max_flash_frames`` after
   it is a flash (or a dropout). Flash frames are skipped: the frames on both sides are compared with each other
   directly, so a flash inside a scene is no boundary, and a flash is never reported as a scene's first frame.
2. **Cuts** (lag ``adaptive_window`` usable frames): ``d1`` = histogram distance to the previous usable frame. A
   frame starts a new scene when ``d1 >= cut_threshold`` and ``d1 >= adaptive_ratio *`` the mean ``d1`` of its
   ``adaptive_window`` neighbours on each side (PySceneDetect's AdaptiveDetector rule): a cut is a spike, while
   fast motion or a fade raise ``d1`` on many frames together.
3. **Fades and dissolves** (lag up to ``fade_window_s + max_fade_s``): ``dW`` = histogram distance to the frame
   ``fade_window_s`` earlier (history sampled every ``fade_sample_s``, restarted at each boundary). When ``dW``
   rises above ``fade_threshold`` a transition begins; it ends when ``dW`` falls below ``fade_release *
   fade_threshold`` (or after ``max_fade_s``). The boundary, reported once, is the frame where ``dW`` peaked (the
   end of a transition up to ``fade_window_s`` long), or for a longer one the earliest history sample already
   close to the picture after it: where the new shot is whole, not a blend. One transition, one boundary.

A boundary closer than ``min_scene_len_s`` to the previous one is dropped. The first usable frame starts the first
scene (kind ``"start"``, score 1.0).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .base import SceneBoundary, SceneDetector
from .features import frame_feature, hist_distance


@dataclass(frozen=True)
class HistogramDetectorParams:
    """Parameters of `HistogramDetector`. Distances are in [0, 1]; times in seconds; luma in [0, 1]."""

    cut_threshold: float = 0.15
    adaptive_ratio: float = 3.0
    adaptive_window: int = 2  # usable frames on each side
    min_scene_len_s: float = 0.5
    max_flash_frames: int = 2
    flash_luma_delta: float = 0.2
    fade_threshold: float = 0.35
    fade_release: float = 0.7
    fade_window_s: float = 1.0
    fade_sample_s: float = 0.1
    max_fade_s: float = 4.0

    def __post_init__(self):
        if self.adaptive_window < 1 or self.max_flash_frames < 0:
            raise ValueError("adaptive_window must be >= 1 and max_flash_frames >= 0")
        if not (0 < self.fade_release <= 1):
            raise ValueError("fade_release must be in (0, 1]")
        if self.fade_window_s <= 0 or self.fade_sample_s <= 0 or self.max_fade_s <= 0:
            raise ValueError("fade_window_s, fade_sample_s and max_fade_s must be > 0")


def _rec(frame_index: int, timestamp_s: float, frame: np.ndarray) -> dict[str, Any]:
    feat = frame_feature(frame)
    return {"i": int(frame_index), "t": float(timestamp_s), "h": feat.hist.tolist(), "y": round(feat.luma, 5)}


def _dist(a: list[float], b: list[float]) -> float:
    return hist_distance(np.asarray(a), np.asarray(b))


class HistogramDetector(SceneDetector):
    """Colour-histogram scene detector (see the module docstring). State: `state_dict` / `from_state`."""

    def __init__(self, params: HistogramDetectorParams | None = None):
        self.params = params or HistogramDetectorParams()
        p = self.params
        self.max_lag_s = p.fade_window_s + p.max_fade_s
        self._s: dict[str, Any] = {
            "luma_ctx": [],  # lumas of the last max_flash_frames classified frames (any kind)
            "qa": [],  # frames awaiting flash classification
            "last_clean": None,  # histogram of the previous usable (non-flash) frame
            "qc": [],  # usable frames: adaptive_window decided ones for context, then the undecided ones
            "qc_next": 0,  # index in qc of the next frame to decide
            "last_boundary_t": None,
            "samples": [],  # [t, hist, frame_index] history for dW, one per fade_sample_s, restarted at boundaries
            "fade": None,  # {"peak", "i", "t", "start_t"} while a transition is open
            "finished": False,
        }

    # -- public interface -------------------------------------------------------------------------------------
    def process_frame(self, frame_index: int, timestamp_s: float, frame: np.ndarray) -> list[SceneBoundary]:
        """See `SceneDetector.process_frame`. ``frame`` is a proxy frame [h, w, 3] uint8 RGB."""
        if self._s["finished"]:
            raise RuntimeError("process_frame() after post_process()")
        out: list[SceneBoundary] = []
        self._s["qa"].append(_rec(frame_index, timestamp_s, frame))
        while len(self._s["qa"]) > self.params.max_flash_frames:
            self._classify(out)
        return out

    def post_process(self) -> list[SceneBoundary]:
        """See `SceneDetector.post_process`."""
        out: list[SceneBoundary] = []
        while self._s["qa"]:
            self._classify(out)
        while self._s["qc_next"] < len(self._s["qc"]):
            self._decide(out, flushing=True)
        fade = self._s["fade"]
        if fade is not None:
            self._emit_fade(out)
        self._s["finished"] = True
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable: {"type", "params", "state"}; a few kB (histograms of the frames still pending)."""
        return {"type": "histogram", "params": asdict(self.params), "state": copy.deepcopy(self._s)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> HistogramDetector:
        """Rebuild from `state_dict` output (also after a JSON round trip)."""
        if state.get("type") != "histogram":
            raise ValueError(f"not a HistogramDetector state: type={state.get('type')!r}")
        det = cls(HistogramDetectorParams(**state["params"]))
        det._s = copy.deepcopy(state["state"])
        return det

    # -- stage 1: flash classification ----------------------------------------------------------------------
    def _classify(self, out: list[SceneBoundary]) -> None:
        p = self.params
        s = self._s
        rec = s["qa"].pop(0)
        after = [r["y"] for r in s["qa"][: p.max_flash_frames]]
        before = s["luma_ctx"]
        y = rec["y"]
        d = p.flash_luma_delta
        bright = any(y - b >= d for b in before) and any(y - a >= d for a in after)
        dark = any(b - y >= d for b in before) and any(a - y >= d for a in after)
        s["luma_ctx"] = (before + [y])[-p.max_flash_frames :] if p.max_flash_frames else []
        if bright or dark:
            return  # a flash or dropout frame: skipped, never compared, never a boundary
        rec["d"] = 0.0 if s["last_clean"] is None else _dist(s["last_clean"], rec["h"])
        s["last_clean"] = rec["h"]
        s["qc"].append(rec)
        while len(s["qc"]) - s["qc_next"] > p.adaptive_window:
            self._decide(out, flushing=False)

    # -- stages 2 and 3: cuts and fades ----------------------------------------------------------------------
    def _decide(self, out: list[SceneBoundary], flushing: bool) -> None:
        p = self.params
        s = self._s
        qc = s["qc"]
        k = s["qc_next"]
        rec = qc[k]
        s["qc_next"] = k + 1
        t = rec["t"]
        if s["last_boundary_t"] is None:  # first usable frame: the first scene starts here
            out.append(SceneBoundary(rec["i"], t, 1.0, "start"))
            s["last_boundary_t"] = t
            s["samples"] = [[t, rec["h"], rec["i"]]]
            self._trim_qc()
            return
        neighbours = [r["d"] for r in qc[max(0, k - p.adaptive_window) : k] + qc[k + 1 : k + 1 + p.adaptive_window]]
        mean_nb = float(np.mean(neighbours)) if neighbours else 0.0
        d1 = rec["d"]
        if d1 >= p.cut_threshold and d1 >= p.adaptive_ratio * mean_nb:
            if s["fade"] is not None:
                self._emit_fade(out)
            if t - s["last_boundary_t"] >= p.min_scene_len_s:
                out.append(SceneBoundary(rec["i"], t, round(d1, 6), "cut"))
                s["last_boundary_t"] = t
            s["samples"] = [[t, rec["h"], rec["i"]]]  # restart the fade history in the new picture either way
            self._trim_qc()
            return
        self._fade_step(out, rec)
        self._trim_qc()

    def _fade_step(self, out: list[SceneBoundary], rec: dict[str, Any]) -> None:
        p = self.params
        s = self._s
        t = rec["t"]
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
                self._emit_fade(out, rec["h"])
                s["samples"] = [[t, rec["h"], rec["i"]]]
        if not s["samples"] or t - s["samples"][-1][0] >= p.fade_sample_s:
            s["samples"].append([t, rec["h"], rec["i"]])

    def _emit_fade(self, out: list[SceneBoundary], current: list[float] | None = None) -> None:
        """Report the open transition. Its first frame of the new shot: the ``dW`` peak, or later when the
        transition was longer than ``fade_window_s`` — then the earliest history sample already close to the
        ``current`` picture (the history spans the last ``fade_window_s``, which now lie after the transition)."""
        p = self.params
        s = self._s
        fade = s["fade"]
        s["fade"] = None
        i, t = fade["i"], fade["t"]
        if current is not None:
            for st, sh, si in s["samples"]:
                if st > t and _dist(sh, current) < p.fade_release * p.fade_threshold:
                    i, t = si, st
                    break
        if t - s["last_boundary_t"] >= p.min_scene_len_s:
            out.append(SceneBoundary(i, t, round(fade["peak"], 6), "fade"))
            s["last_boundary_t"] = t

    def _trim_qc(self) -> None:
        s = self._s
        drop = s["qc_next"] - self.params.adaptive_window
        if drop > 0:
            del s["qc"][:drop]
            s["qc_next"] -= drop
