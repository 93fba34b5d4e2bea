"""Keyframe selection: scene boundaries -> keyframes (the first frame of each scene), capped per minute.

`KeyframeSelector` is the streaming form (push proxy frames one at a time; JSON-serialisable state).
`select_keyframes` is the whole stage for one file: proxy decode -> detection -> full-resolution decode of only
the keyframes (frame-level dynamic loading).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .base import SceneBoundary, SceneDetector
from .features import is_near_uniform
from .histogram import HistogramDetector, HistogramDetectorParams

if TYPE_CHECKING:
    from .dedup import ClipDeduplicator

_DETECTORS: dict[str, type[SceneDetector]] = {"histogram": HistogramDetector}


@dataclass(frozen=True)
class Keyframe:
    """One keyframe: the first frame of a scene."""

    frame_index: int  # decoded-frame count in PTS order
    timestamp_s: float  # presentation time, seconds, from PTS
    scene_score: float  # detector's change score at the scene start, in [0, 1]; 1.0 for the first scene
    image: np.ndarray | None = None  # [H, W, 3] uint8 RGB at full resolution, or None when not decoded


class KeyframeSelector:
    """Streaming keyframe selection over proxy frames.

    ``push(frame_index, timestamp_s, proxy)`` returns the keyframes decided so far (images ``None``), ascending;
    ``finish()`` returns the rest. ``max_keyframes_per_minute`` (None: no cap) keeps at most that many keyframes
    in any 60-s window of presentation time: a scene start that would exceed it is dropped (its scene merges
    into the previous one); earlier scenes win, which is what a stream can decide without waiting.
    """

    def __init__(self, detector: SceneDetector | None = None, max_keyframes_per_minute: float | None = None):
        if max_keyframes_per_minute is not None and max_keyframes_per_minute <= 0:
            raise ValueError(f"max_keyframes_per_minute must be > 0, got {max_keyframes_per_minute}")
        self.detector = detector if detector is not None else HistogramDetector()
        self.max_keyframes_per_minute = max_keyframes_per_minute
        self._recent: list[float] = []  # timestamps of accepted keyframes within the last 60 s
        self.dropped_by_cap = 0

    def push(self, frame_index: int, timestamp_s: float, proxy: np.ndarray) -> list[Keyframe]:
        """Feed one proxy frame ([h, w, 3] uint8 RGB) in PTS order; returns newly decided keyframes."""
        return self._accept(self.detector.process_frame(frame_index, timestamp_s, proxy))

    def finish(self) -> list[Keyframe]:
        """End of stream: the keyframes still pending."""
        return self._accept(self.detector.post_process())

    def _accept(self, boundaries: list[SceneBoundary]) -> list[Keyframe]:
        out = []
        for b in boundaries:
            cap = self.max_keyframes_per_minute
            if cap is not None:
                self._recent = [t for t in self._recent if t > b.timestamp_s - 60.0]
                if len(self._recent) + 1 > cap:
                    self.dropped_by_cap += 1
                    continue
                self._recent.append(b.timestamp_s)
            out.append(Keyframe(b.frame_index, b.timestamp_s, b.score))
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (detector included); `from_state` resumes exactly."""
        return {
            "detector": self.detector.state_dict(),
            "max_keyframes_per_minute": self.max_keyframes_per_minute,
            "recent": list(self._recent),
            "dropped_by_cap": self.dropped_by_cap,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> KeyframeSelector:
        """Rebuild from `state_dict` output (also after a JSON round trip)."""
        det_state = state["detector"]
        det_cls = _DETECTORS.get(det_state.get("type"))
        if det_cls is None:
            raise ValueError(f"unknown detector type {det_state.get('type')!r}")
        sel = cls(det_cls.from_state(det_state), state["max_keyframes_per_minute"])
        sel._recent = list(state["recent"])
        sel.dropped_by_cap = int(state["dropped_by_cap"])
        return sel


@dataclass
class KeyframeRunStats:
    """What a `select_keyframes` run did (filled while iterating)."""

    frames_decoded: int = 0  # proxy frames decoded (the whole file, or up to an error)
    keyframes: int = 0
    dropped_by_cap: int = 0
    dropped_as_duplicates: int = 0
    dropped_as_blank: int = 0  # keyframes whose full-resolution image was near-uniform (never yielded)
    backend: str | None = None  # proxy-decoding backend that finished the pass ("decord" or "pyav")
    backend_notes: list[str] = field(default_factory=list)
    duration_s: float | None = None  # last proxy frame's timestamp
    seconds: float = 0.0  # wall-clock time of the run
    options: dict[str, Any] = field(default_factory=dict)  # options actually used


class KeyframeSelectionCancelled(Exception):
    """`select_keyframes` stopped because its ``cancel`` event was set (the decoding child is gone)."""


class KeyframeRun:
    """Iterable result of `select_keyframes`: iterate once for `Keyframe`s (images decoded); ``stats`` and
    ``info`` (the `VideoInfo`) are filled during iteration."""

    def __init__(self, path: str, *, detector_factory, max_keyframes_per_minute, decode_images, proxy_long_side,
                 backend, stall_timeout_s, deduplicator, cancel=None, blank_std=4 / 255):
        self.path = path
        self._cancel = cancel
        self._detector_factory = detector_factory
        self._cap = max_keyframes_per_minute
        self._decode_images = decode_images
        self._proxy_long_side = proxy_long_side
        self._backend = backend
        self._stall = stall_timeout_s
        self._dedup = deduplicator
        self._blank_std = blank_std
        self.info = None
        self.stats = KeyframeRunStats(options={
            "max_keyframes_per_minute": max_keyframes_per_minute, "decode_images": decode_images,
            "proxy_long_side": proxy_long_side, "backend": backend, "stall_timeout_s": stall_timeout_s,
            "deduplicate": deduplicator is not None,
        })
        self._started = False

    def __iter__(self) -> Iterator[Keyframe]:
        if self._started:
            raise RuntimeError("a KeyframeRun can be iterated once")
        self._started = True
        return self._run()

    def _run(self) -> Iterator[Keyframe]:
        from specstream.errors import MediaError
        from specstream.modalities.video import VideoDecodeSession, decode_frames

        t0 = time.perf_counter()
        selector = KeyframeSelector(self._detector_factory(), self._cap)
        keyframes: list[Keyframe] = []
        error: MediaError | None = None
        session = VideoDecodeSession(self.path, proxy_long_side=self._proxy_long_side, backend=self._backend,
                                     stall_timeout_s=self._stall)
        try:
            last_t = None
            try:
                for f in session.proxy_frames():
                    if self._cancel is not None and self._cancel.is_set():
                        raise KeyframeSelectionCancelled(f"keyframe selection of {self.path} cancelled")
                    keyframes.extend(selector.push(f.frame_index, f.timestamp_s, f.image))
                    last_t = f.timestamp_s
                keyframes.extend(selector.finish())
            except MediaError as exc:
                error = exc  # keep the keyframes of the good part; the error is raised after them
                keyframes.extend(selector.finish())
            self.info = session.info
            self.stats.frames_decoded = session.frames_decoded
            self.stats.backend = session.backend_used
            self.stats.backend_notes = list(session.backend_notes)
            self.stats.duration_s = last_t
            self.stats.dropped_by_cap = selector.dropped_by_cap
            images: Iterator = iter([None] * len(keyframes))
            if self._decode_images and keyframes:
                stamps = [k.timestamp_s for k in keyframes]
                if error is None:
                    # one at a time: the decoding child waits until each frame is taken (backpressure)
                    images = session.iter_full(stamps)
                else:  # the session's child is gone: a fresh one decodes the good part
                    try:
                        images = iter(decode_frames(self.path, stamps, stall_timeout_s=self._stall))
                    except MediaError:
                        keyframes, images = [], iter(())  # not even the good part decodes again: only the error
            last = None  # embedding of the last kept keyframe (near-duplicate filter)
            for k, img in zip(keyframes, images):
                if self._cancel is not None and self._cancel.is_set():
                    raise KeyframeSelectionCancelled(f"keyframe selection of {self.path} cancelled")
                if img is not None and is_near_uniform(img, self._blank_std):
                    # the detector never picks a blank proxy; a full frame can still be flat where its proxy
                    # was not (e.g. a decoder that disagrees): a blank image is never sent on as a scene
                    self.stats.dropped_as_blank += 1
                    continue
                if self._dedup is not None and img is not None:
                    emb = self._dedup.embed([img])[0]
                    if last is not None and float(emb @ last) >= self._dedup.threshold:
                        self.stats.dropped_as_duplicates += 1
                        continue
                    last = emb
                self.stats.keyframes += 1
                yield Keyframe(k.frame_index, k.timestamp_s, k.scene_score, img)
        finally:
            session.close()
        self.stats.seconds = time.perf_counter() - t0
        if error is not None:
            raise error


def select_keyframes(
    path: str | os.PathLike,
    *,
    max_keyframes_per_minute: float | None = None,
    detector: str = "histogram",
    detector_params: HistogramDetectorParams | None = None,
    decode_images: bool = True,
    proxy_long_side: int = 64,
    backend: str = "auto",
    stall_timeout_s: float = 30.0,
    deduplicator: ClipDeduplicator | None = None,
    cancel: threading.Event | None = None,
) -> KeyframeRun:
    """Select the keyframes of the video at ``path``: the first frame of each scene.

    Guarantees (with the default "histogram" detector; see docs/keyframes.md for what they rest on): every scene
    at least ``min_scene_len_s`` long (0.5 s) whose start the detector finds gets a keyframe, unless a stronger
    boundary lies less than that before it; flashes up to ``max_flash_s`` (0.2 s) and dips to black or white
    inside one shot give none; a fade through black or white gives one, on the first stable frame of the new
    scene; no keyframe image is near-uniform (luma standard deviation below ``blank_std``, 4/255).

    Proxy frames (longer side ``proxy_long_side`` px) are decoded in a child process (``backend``: "auto",
    "decord" or "pyav"; see `specstream.modalities.video`) and scored by ``detector`` (only "histogram" so far;
    ``detector_params``: a `HistogramDetectorParams`). ``max_keyframes_per_minute`` caps keyframes in any 60-s
    window (None: no cap). With ``decode_images`` only the keyframes are decoded again at full resolution
    (``Keyframe.image`` [H, W, 3] uint8 RGB). ``deduplicator`` (e.g. `ClipDeduplicator`) drops near-duplicates.

    Returns a `KeyframeRun`: iterate it for `Keyframe`s in ascending time; its ``stats`` record the run.
    Raises (while iterating) the `specstream.errors.MediaError` subclasses: ``unreadable_source``,
    ``unsupported_media``, ``no_video_stream``, ``corrupt_media`` (after yielding the keyframes of the part that
    decoded), ``decode_timeout``; `KeyframeSelectionCancelled` within one proxy frame once ``cancel`` (an event
    another thread may set, e.g. on Ctrl-C) is set.
    """
    if detector not in _DETECTORS:
        raise ValueError(f"unknown detector {detector!r}; known: {sorted(_DETECTORS)}")
    det_cls = _DETECTORS[detector]

    def factory() -> SceneDetector:
        return det_cls(detector_params) if detector_params is not None else det_cls()

    params = detector_params or HistogramDetectorParams()
    return KeyframeRun(
        os.fspath(path), detector_factory=factory, max_keyframes_per_minute=max_keyframes_per_minute,
        decode_images=decode_images, proxy_long_side=proxy_long_side, backend=backend,
        stall_timeout_s=stall_timeout_s, deduplicator=deduplicator, cancel=cancel, blank_std=params.blank_std,
    )
