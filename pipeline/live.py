"""Live frame streams: encoded frames in, keyframe frame tasks out, while the stream plays.

A frame message carries one encoded image (JPEG/PNG bytes) with headers ``stream_id`` and ``pts`` (seconds);
the key is the stream id, so one partition keeps a stream's order. Per stream, a streaming
:class:`~specstream.stages.keyframes.KeyframeSelector` decides scene starts; each keyframe becomes a
:class:`~specstream.pipeline.caption_stages.FrameTask` (``request_id`` = stream id, ``seq`` counting the stream's
results, never ``last``) that the caption stage turns into a result.

Restart safety: after each frame the stream's state (selector state, next seq, next frame index, the offset
after the frame) is written to a :class:`StateStore` before the frame is released. A detector may report a
boundary up to ``max_lag_s`` after the frame, so frames of that window stay in a ring buffer and *held*
(uncommitted); after a restart they are redelivered and refill the ring without being pushed to the selector
again (their offsets are below the saved ``next_offset``). Results are therefore neither lost nor renumbered.
"""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specstream.pipeline.broker import TOPIC_FRAMES, TOPIC_LIVE_FRAMES, TOPIC_RESULTS, Broker, Message
from specstream.pipeline.messages import CaptionParams, ErrorInfo, PipelineResult
from specstream.pipeline.caption_stages import FrameTask
from specstream.stages.keyframes import KeyframeSelector

log = logging.getLogger("specstream.live")


def decode_image_bytes(data: bytes) -> np.ndarray:
    """JPEG/PNG/WebP bytes -> [H, W, 3] uint8 RGB. Raises ValueError on anything else or damaged data."""
    from PIL import Image

    if not data:
        raise ValueError("empty frame")
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format not in ("PNG", "JPEG", "WEBP"):
                raise ValueError(f"unsupported frame format {im.format}")
            return np.asarray(im.convert("RGB"), dtype=np.uint8)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"undecodable frame: {exc}") from None


def proxy(image: np.ndarray, long_side: int) -> np.ndarray:
    """A small copy (longer side ``long_side`` px, both sides even) for scene scoring."""
    from PIL import Image

    h, w = image.shape[:2]
    scale = long_side / max(h, w)
    size = (max(2, int(round(w * scale / 2)) * 2), max(2, int(round(h * scale / 2)) * 2))
    return np.asarray(Image.fromarray(image).resize(size, Image.BILINEAR))


@dataclass
class _Stream:
    selector: KeyframeSelector
    partition: int | None
    next_seq: int = 0
    next_frame_index: int = 0
    next_offset: int = -1
    ring: deque = field(default_factory=deque)  # (pts, encoded bytes, message, wall-clock time), PTS order

    def state(self) -> dict[str, Any]:
        return {"selector": self.selector.state_dict(), "next_seq": self.next_seq,
                "next_frame_index": self.next_frame_index, "next_offset": self.next_offset,
                "partition": self.partition}


class LiveKeyframeStage:
    """Stage for live streams: consumes ``topic`` (encoded frames), publishes frame tasks.

    Args:
        broker: the broker (the stream's results go through the frame-task topic to the caption stage).
        store: a state store with ``get(key)`` and async ``put(key, value)`` (None: memory only).
        params: caption parameters of every stream's keyframes.
        max_keyframes_per_minute: cap per stream (None: no cap).
        proxy_long_side: size of the frames scored for scene change, px.
        dead_letter: async ``(message, reason)`` for frames without a stream id.
        ring_idle_s: wall-clock seconds after which a quiet stream's held frames are released.
    """

    def __init__(self, broker: Broker, store=None, topic: str = TOPIC_LIVE_FRAMES,
                 params: CaptionParams | None = None, max_keyframes_per_minute: float | None = None,
                 proxy_long_side: int = 64, dead_letter=None, ring_idle_s: float = 30.0):
        self.broker = broker
        self.store = store
        self.topic = topic
        self.params = params or CaptionParams()
        self.max_keyframes_per_minute = max_keyframes_per_minute
        self.proxy_long_side = proxy_long_side
        self.dead_letter = dead_letter
        self.ring_idle_s = ring_idle_s
        self.streams: dict[str, _Stream] = {}
        self.frames = 0
        self.keyframes = 0

    def forget_partitions(self, partitions: set[int]) -> None:
        """Revoked partitions: drop the state of their streams (the next owner restores it from the store)."""
        for sid in [s for s, st in self.streams.items() if st.partition in partitions]:
            del self.streams[sid]

    async def run(self) -> None:
        async for msg in self.broker.subscribe(self.topic):
            try:
                await self._handle(msg)
            except Exception as exc:  # every failure ends as an error record of the frame's stream
                log.exception("live frame %s/%s failed", msg.partition, msg.offset)
                await self._failed(msg, exc)

    async def _failed(self, msg: Message, exc: Exception) -> None:
        """A frame whose handling raised: an error result of its stream (the next ``seq``; frames without a
        stream go to the DLQ), then released; left uncommitted (``Message.fail``) when even that fails."""
        from specstream.pipeline.caption_stages import error_info

        sid = msg.headers.get("stream_id") or msg.key
        try:
            st = self.streams.get(sid) if sid else None
            if st is None:
                if self.dead_letter is None:
                    raise RuntimeError("no stream and no dead-letter queue") from exc
                await self.dead_letter(msg, f"live frame failed: {type(exc).__name__}: {exc}")
                msg.done()
                return
            info = error_info(exc)
            await self._error(sid, st, msg, f"frame at offset {msg.offset}: {info.message}", code=info.code)
        except Exception:
            log.exception("live frame %s/%s: the error record could not be published (left uncommitted)",
                          msg.partition, msg.offset)
            msg.fail()

    def _stream(self, sid: str, partition: int | None) -> _Stream:
        st = self.streams.get(sid)
        if st is None:
            saved = self.store.get(f"live/{sid}") if self.store is not None else None
            selector = None
            if saved:
                try:
                    selector = KeyframeSelector.from_state(saved["selector"])
                except (ValueError, KeyError, TypeError) as exc:
                    # a state written by another release (its detector state version differs): the stream goes
                    # on with a fresh selector, keeping its numbering, so nothing is renumbered or lost
                    log.warning("live stream %s: saved selector state not usable (%s); starting a fresh one",
                                sid, exc)
                    selector = KeyframeSelector(max_keyframes_per_minute=self.max_keyframes_per_minute)
            if saved and selector is not None:
                st = _Stream(selector, partition, saved["next_seq"], saved["next_frame_index"], saved["next_offset"])
            else:
                st = _Stream(KeyframeSelector(max_keyframes_per_minute=self.max_keyframes_per_minute), partition)
            self.streams[sid] = st
        return st

    async def _handle(self, msg: Message) -> None:
        sid = msg.headers.get("stream_id") or msg.key
        if not sid:
            if self.dead_letter is not None:
                await self.dead_letter(msg, "frame without a stream_id header or key")
            msg.done()
            return
        st = self._stream(sid, msg.partition)
        try:
            pts = float(msg.headers["pts"])
        except (KeyError, ValueError):
            pts = None
        if msg.offset is not None and msg.offset < st.next_offset:  # redelivered: already in the state
            if pts is not None:
                st.ring.append((pts, msg.value, msg, time.monotonic()))
                msg.hold()
                self._release(st)
            else:
                msg.done()
            return
        try:
            if pts is None:
                raise ValueError(f"header pts missing or not a number: {msg.headers.get('pts')!r}")
            image = await asyncio.to_thread(decode_image_bytes, msg.value)
        except (KeyError, ValueError) as exc:
            await self._error(sid, st, msg, f"bad frame at offset {msg.offset}: {exc}")
            return
        index = st.next_frame_index
        st.next_frame_index += 1
        keyframes = st.selector.push(index, pts, proxy(image, self.proxy_long_side))
        st.ring.append((pts, msg.value, msg, time.monotonic()))
        self.frames += 1
        for kf in keyframes:
            # the keyframe's own frame (a boundary may be decided up to max_lag_s later), found by its PTS
            data = next((d for t, d, _, _ in reversed(st.ring) if t <= kf.timestamp_s), st.ring[0][1])
            if msg.revoked:
                break
            kimage = image if data is msg.value else await asyncio.to_thread(decode_image_bytes, data)
            await self.broker.publish(TOPIC_FRAMES, sid, FrameTask(
                sid, f"stream:{sid}", "stream", self.params, "realtime", kf.frame_index, float(kf.timestamp_s),
                float(kf.scene_score), kimage, last=False, seq=st.next_seq))
            st.next_seq += 1
            self.keyframes += 1
        await self._commit_state(sid, st, msg)

    async def _error(self, sid: str, st: _Stream, msg: Message, reason: str, code: str = "corrupt_media") -> None:
        await self.broker.publish(TOPIC_RESULTS, sid, PipelineResult(
            id=sid, status="error", error=ErrorInfo(code=code, message=reason), seq=st.next_seq, final=False))
        st.next_seq += 1
        await self._commit_state(sid, st, msg, keep=False)

    async def _commit_state(self, sid: str, st: _Stream, msg: Message, keep: bool = True) -> None:
        if msg.revoked:
            msg.done()
            return
        if msg.offset is not None:
            st.next_offset = msg.offset + 1
        if self.store is not None:
            await self.store.put(f"live/{sid}", st.state())
        if keep:
            msg.hold()
        else:
            msg.done()
        self._release(st)

    def _release(self, st: _Stream) -> None:
        """Release (commit) ring frames older than the detector's reach, and frames of quiet streams."""
        reach = st.selector.detector.max_lag_s + 0.5
        while len(st.ring) > 1 and st.ring[0][0] < st.ring[-1][0] - reach:
            st.ring.popleft()[2].done()
        now = time.monotonic()
        for other in self.streams.values():
            if other.ring and now - other.ring[-1][3] > self.ring_idle_s:
                while other.ring:
                    other.ring.popleft()[2].done()
