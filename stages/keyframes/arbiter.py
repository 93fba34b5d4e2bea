"""Minimum scene length for a streaming detector: of two candidate boundaries closer than ``min_scene_len_s``, the
stronger one wins.

A detector offers every candidate boundary it finds (`offer`) instead of reporting it at once. Candidates wait
until no candidate that could conflict with them can still come (`release` with the detector's *frontier*: the
earliest presentation time a future candidate can refer to). Two candidates closer than ``min_scene_len_s`` are
resolved by strength: the higher ``tier`` wins (the detector ranks its kinds of evidence, e.g. an abrupt cut over
a gradual change that camera motion can also cause, and the start of the stream lowest), then the higher score,
and a tie goes to the later candidate, which starts the later and therefore not-yet-shortened scene. The loser's
scene merges into its neighbour.

Why wait instead of dropping whatever comes second (what a plain "no boundary within N seconds of the last one"
rule does, e.g. PySceneDetect's ``min_scene_len``): a weak candidate just before a real cut — a camera swing
0.3 s before the join of two shots — would otherwise suppress the cut, and the whole next scene would get no
keyframe. PySceneDetect's ``FlashFilter`` in its merge mode also holds candidates back before deciding; this
arbiter holds only one decision window and keeps the strongest candidate of it.

State is a JSON-serialisable dict (`state_dict` / `from_state`), a few short lists.
"""

from __future__ import annotations

from typing import Any

from .base import SceneBoundary

_EPS = 1e-9


class MinSceneLengthArbiter:
    """Holds candidate boundaries until they are final; see the module docstring.

    Args:
        min_scene_len_s: two emitted boundaries are at least this far apart (seconds of presentation time).
    """

    def __init__(self, min_scene_len_s: float):
        if min_scene_len_s < 0:
            raise ValueError(f"min_scene_len_s must be >= 0, got {min_scene_len_s}")
        self.min_scene_len_s = float(min_scene_len_s)
        self.pending: list[list[Any]] = []  # [frame_index, timestamp_s, score, kind, tier], ascending time
        self.last_emitted_t: float | None = None

    def offer(self, boundary: SceneBoundary, tier: int) -> None:
        """Add a candidate; ``tier`` ranks its kind of evidence (higher is stronger)."""
        t = boundary.timestamp_s
        if self.last_emitted_t is not None and t < self.last_emitted_t + self.min_scene_len_s - _EPS:
            return  # too close to a boundary already reported (the frontier should prevent this)
        cand = [boundary.frame_index, t, boundary.score, boundary.kind, int(tier)]
        k = 0
        while k < len(self.pending) and self.pending[k][1] <= t:
            k += 1
        self.pending.insert(k, cand)
        self._resolve()

    def retract_from(self, frame_index: int) -> None:
        """Withdraw the pending candidates at or after ``frame_index`` (they lie inside a transition)."""
        self.pending = [c for c in self.pending if c[0] < frame_index]

    def release(self, frontier_s: float) -> list[SceneBoundary]:
        """Candidates that no future candidate can conflict with: the future ones refer to frames at or after
        ``frontier_s`` seconds. Returns them as final boundaries, ascending."""
        out = []
        while self.pending and self.pending[0][1] + self.min_scene_len_s <= frontier_s + _EPS:
            out.append(self._emit(self.pending.pop(0)))
        return out

    def flush(self) -> list[SceneBoundary]:
        """End of stream: every pending candidate is final."""
        out = [self._emit(c) for c in self.pending]
        self.pending = []
        return out

    def _emit(self, c: list[Any]) -> SceneBoundary:
        self.last_emitted_t = c[1]
        return SceneBoundary(int(c[0]), float(c[1]), float(c[2]), c[3])

    def _resolve(self) -> None:
        """Drop the weaker of any two neighbours closer than the minimum length until none are."""
        while True:
            for k in range(len(self.pending) - 1):
                a, b = self.pending[k], self.pending[k + 1]
                if b[1] - a[1] < self.min_scene_len_s - _EPS:
                    del self.pending[k if (a[4], a[2]) <= (b[4], b[2]) else k + 1]
                    break
            else:
                return

    def state_dict(self) -> dict[str, Any]:
        return {"min_scene_len_s": self.min_scene_len_s, "pending": [list(c) for c in self.pending],
                "last_emitted_t": self.last_emitted_t}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> MinSceneLengthArbiter:
        arb = cls(state["min_scene_len_s"])
        arb.pending = [list(c) for c in state["pending"]]
        arb.last_emitted_t = state["last_emitted_t"]
        return arb
