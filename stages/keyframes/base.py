"""The scene-detector interface (after PySceneDetect's: ``process_frame`` per frame, an optional ``post_process``).

A detector sees proxy frames one at a time, in PTS order, and reports *scene boundaries*: the first frame of each
scene (including the first scene, which starts at the first usable frame). It may decide late — a boundary can
refer to a frame seen up to ``max_lag_s`` seconds earlier — but it reports boundaries in ascending frame order.
Its whole state is a small JSON-serialisable dict, so a streaming worker can persist it between frames (e.g. in
Kafka offset metadata) and resume on another machine with identical results.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

BoundaryKind = Literal["start", "cut", "fade"]


@dataclass(frozen=True)
class SceneBoundary:
    """The first frame of a scene, as a detector reports it."""

    frame_index: int  # decoded-frame count in PTS order
    timestamp_s: float  # presentation time (seconds, from PTS)
    score: float  # detector's change score at the boundary, in [0, 1]; 1.0 for the start of the first scene
    kind: BoundaryKind  # "start": first scene; "cut": abrupt; "fade": gradual transition (fade, dissolve)


class SceneDetector(abc.ABC):
    """Scores scene change per proxy frame and reports `SceneBoundary` events.

    ``process_frame`` is called once per decoded frame in PTS order; ``post_process`` once at the end of the
    stream, to flush decisions that were waiting for later frames.
    """

    #: The latest frame a reported boundary can refer to lies at most this many seconds before the newest frame.
    max_lag_s: float = 0.0

    @abc.abstractmethod
    def process_frame(self, frame_index: int, timestamp_s: float, frame: np.ndarray) -> list[SceneBoundary]:
        """Take one proxy frame ``frame`` ([h, w, 3] uint8 RGB) presented at ``timestamp_s`` seconds; return the
        boundaries decided now (possibly about earlier frames), ascending. Raises ValueError on a bad frame."""

    def post_process(self) -> list[SceneBoundary]:
        """End of stream: return the boundaries still pending. The detector must not be fed afterwards."""
        return []

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The detector's parameters and state as a JSON-serialisable dict (see `from_state`)."""

    @classmethod
    @abc.abstractmethod
    def from_state(cls, state: dict[str, Any]) -> SceneDetector:
        """Rebuild a detector from `state_dict` output; it continues exactly where the original stopped."""
