"""Keyframe selection (stage 2 of captioning): scene detection on proxy frames, keyframes = scene starts.

Public names: `select_keyframes`, `Keyframe`, `KeyframeSelector` (streaming), `SceneDetector` (interface),
`SceneBoundary`, `HistogramDetector`, `HistogramDetectorParams`, `MinSceneLengthArbiter` (the minimum scene length
rule a detector applies: the stronger of two close boundaries wins), `ClipDeduplicator` (optional, open_clip).
"""

from .arbiter import MinSceneLengthArbiter
from .base import SceneBoundary, SceneDetector
from .dedup import ClipDeduplicator, DeduplicatorUnavailable
from .histogram import HistogramDetector, HistogramDetectorParams
from .selector import (
    Keyframe,
    KeyframeRun,
    KeyframeRunStats,
    KeyframeSelectionCancelled,
    KeyframeSelector,
    select_keyframes,
)

__all__ = [
    "ClipDeduplicator",
    "DeduplicatorUnavailable",
    "HistogramDetector",
    "HistogramDetectorParams",
    "Keyframe",
    "KeyframeRun",
    "KeyframeRunStats",
    "KeyframeSelectionCancelled",
    "KeyframeSelector",
    "MinSceneLengthArbiter",
    "SceneBoundary",
    "SceneDetector",
    "select_keyframes",
]
