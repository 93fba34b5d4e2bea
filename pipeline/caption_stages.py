"""The caption graph's two consumers: keyframes (stage 1-2) and caption = vision encode + speculative decode (3-4).

Both stages talk only through a :class:`~specstream.pipeline.broker.Broker`: the keyframe stage consumes
``specstream.requests`` and publishes :class:`FrameTask` s; the caption stage consumes them and publishes
:class:`~specstream.pipeline.messages.PipelineResult` s on ``specstream.results``. The compute is the stages':
keyframe selection (``specstream.stages.keyframes``) and the VLM runner (:class:`~specstream.stages.caption.Captioner`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from specstream.errors import (
    InvalidRequestError,
    SpecstreamError,
    UnreadableSourceError,
    UnsupportedMediaError,
    UnsupportedTaskError,
    error_dict,
)
from specstream.modalities.source import open_source
from specstream.pipeline.broker import TOPIC_FRAMES, TOPIC_REQUESTS, TOPIC_RESULTS, Broker, Message, consume
from specstream.pipeline.messages import CaptionParams, ErrorInfo, PipelineRequest, PipelineResult
from specstream.stages.caption import (
    Captioner,
    MAX_SOURCE_BYTES,
    CaptionStats,
    Frame,
    MapStems,
    RecordedError,
    caption_frame,
    media_kind,
)

log = logging.getLogger("specstream.caption")

SERVED_TASKS = ("caption",)  # tasks the caption graph answers; others get an ``unsupported_task`` error result


@dataclass
class FrameTask:
    """A keyframe (or an image) to caption, or an input's error, on the frames topic.

    ``seq`` numbers the frame tasks of one request from 0 (it becomes the result's ``seq``); ``last`` marks the
    final message of a request; an ``error`` message carries no image.
    """

    request_id: str
    source: str
    kind: str
    params: CaptionParams
    qos: str = "interactive"
    frame_index: int = 0
    timestamp_s: float = 0.0
    scene_score: float = 1.0
    image: np.ndarray | None = None  # [H, W, 3] uint8 RGB
    error: ErrorInfo | None = None
    last: bool = False
    seq: int = 0


def error_info(exc: BaseException) -> ErrorInfo:
    """The error record of an exception raised while handling one input: a typed error keeps its code;
    anything else becomes ``internal_error`` naming the exception's type."""
    return ErrorInfo(**error_dict(exc))


def resolve_source(req: PipelineRequest, allowed_roots: list[Path] | None = None,
                   max_bytes: int = MAX_SOURCE_BYTES) -> tuple[str, str, str | None]:
    """(path on disk, display name, temp file to delete or None) of a request's source.

    Raises:
        UnreadableSourceError: outside the allowed roots, missing, too large, bad base64.
    """
    src = req.source
    if src.data_b64 is not None:
        try:
            data = base64.b64decode(src.data_b64, validate=True)
        except Exception:
            raise UnreadableSourceError("data_b64 is not valid base64") from None
        if len(data) > max_bytes:
            raise UnreadableSourceError(f"inline data of {len(data)} bytes exceeds the limit of {max_bytes}")
        suffix = Path(src.filename or "").suffix or ".bin"
        fd, tmp = tempfile.mkstemp(suffix=suffix, prefix="specstream-")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        return tmp, src.filename or f"inline:{req.id}", tmp
    uri = src.uri
    path = uri[len("file://"):] if uri.startswith("file://") else uri
    if "://" in path:
        raise UnreadableSourceError(f"unsupported source URI scheme: {uri!r} (use file:// or inline data)")
    real = Path(path).expanduser().resolve()
    if allowed_roots is not None and not any(real.is_relative_to(r.resolve()) for r in allowed_roots):
        raise UnreadableSourceError(f"{uri}: outside the allowed roots")
    if not real.exists():
        raise UnreadableSourceError(f"{uri}: no such file")
    if real.is_file() and real.stat().st_size > max_bytes:
        raise UnreadableSourceError(f"{uri}: {real.stat().st_size} bytes exceeds the limit of {max_bytes}")
    return str(real), uri if src.uri.startswith("file://") else path, None


def _next_keyframe(it) -> tuple[Any, Exception | None]:
    """The next keyframe of a `KeyframeRun` iterator (blocking): ``(keyframe, None)``, ``(None, None)`` at the
    end, or ``(None, error)`` for a typed media error (raised after the keyframes of the part that decoded)."""
    try:
        return next(it, None), None
    except SpecstreamError as exc:
        return None, exc


@dataclass
class _Published:
    """What the keyframe stage has published for one request: the next ``seq``, and whether ``last`` went out."""

    source: str
    params: CaptionParams = field(default_factory=CaptionParams)
    seq: int = 0
    ended: bool = False


class KeyframeStage:
    """Stage 1-2: media in, keyframes (full resolution) out. Videos are decoded in killable child processes.

    Args:
        broker: the stage graph's broker.
        allowed_roots: directories ``file://`` sources must lie under (None: any path; the CLI's own inputs).
        concurrency: inputs decoded at once.
        max_source_bytes: size limit of a source (file or inline data), bytes.

    Each request message is acknowledged (``Message.done``) once all its frame tasks are published. Whatever
    fails while a request is handled (a typed media error, a bug, a refused publish) ends as the request's final
    frame task carrying the error, numbered after the frames already published; only when even that cannot be
    published is the message left uncommitted (``Message.fail``). A cancelled stage (shutdown past the drain
    timeout) acknowledges nothing: the request is redelivered.
    """

    def __init__(self, broker: Broker, allowed_roots: list[Path] | None = None, concurrency: int = 2,
                 max_source_bytes: int = MAX_SOURCE_BYTES):
        self.broker = broker
        self.allowed_roots = allowed_roots
        self.max_source_bytes = max_source_bytes
        self.sem = asyncio.Semaphore(concurrency)
        self.frames_decoded = 0
        self.keyframes = 0

    async def run(self) -> None:
        await consume(self.broker, TOPIC_REQUESTS, self.sem, self._handle_message)

    async def _handle_message(self, msg: Message) -> None:
        req: PipelineRequest = msg.value
        out = _Published(req.source.uri or req.source.filename or f"inline:{req.id}")
        try:
            if not msg.revoked:
                await self._handle(req, out)
        except Exception as exc:  # every failure ends as the request's error record
            if not isinstance(exc, SpecstreamError):
                log.exception("request %s failed", req.id)
            if not out.ended and not await self._emit_error(req, out, exc):
                msg.fail()
                return
        msg.done()

    async def _publish(self, req: PipelineRequest, out: _Published, task: FrameTask) -> None:
        task.seq = out.seq
        await self.broker.publish(TOPIC_FRAMES, req.id, task)
        out.seq += 1
        out.ended = task.last

    async def _emit_error(self, req: PipelineRequest, out: _Published, exc: BaseException) -> bool:
        """Publish ``exc`` as the request's final frame task; False when that publish failed too."""
        from specstream.modalities.source import name_fd_paths

        info = error_info(exc)
        info = ErrorInfo(code=info.code, message=name_fd_paths(info.message, out.source))  # its name, not its fd
        task = FrameTask(req.id, out.source, "unknown", out.params, req.qos, error=info, last=True)
        try:
            await self._publish(req, out, task)
            return True
        except Exception:
            log.exception("request %s: the error record could not be published (left uncommitted)", req.id)
            return False

    async def _handle(self, req: PipelineRequest, out: _Published) -> None:
        if req.task not in SERVED_TASKS:
            raise UnsupportedTaskError(f"task {req.task!r} is not served by this worker "
                                       f"(served: {', '.join(SERVED_TASKS)})")
        try:
            out.params = CaptionParams(**req.params)
        except Exception as exc:
            raise InvalidRequestError(f"bad params: {exc}") from None
        tmp = opened = None
        try:
            path, out.source, tmp = resolve_source(req, self.allowed_roots, self.max_source_bytes)
            # the one open of the source (checked against the roots again, symlinks swapped in since refused):
            # everything below reads this descriptor, never the path
            opened = open_source(path, None if tmp else self.allowed_roots, self.max_source_bytes)
            path = opened.path
            kind = await asyncio.to_thread(media_kind, path, req.source.filename or out.source)
            if kind == "image":
                from specstream.modalities.image import load_image

                image = await asyncio.to_thread(load_image, path)
                self.frames_decoded += 1
                self.keyframes += 1
                await self._publish(req, out, FrameTask(req.id, out.source, "image", out.params, req.qos, 0, 0.0,
                                                        1.0, image, last=True))
                return
            error = await self._publish_keyframes(req, out, path)
            if error is not None:
                raise error
            if not out.seq:
                raise UnsupportedMediaError(f"{out.source}: no frames")
        finally:
            if opened is not None:
                opened.close()
            if tmp:
                os.unlink(tmp)

    async def _publish_keyframes(self, req: PipelineRequest, out: _Published, path: str) -> Exception | None:
        """Select ``path``'s keyframes and publish each as it is decoded (full resolution, one at a time: the
        frames topic's bound and the caption stage's window hold the rest back, so a long video never sits in
        memory). A frame is published once the next one (or the end) is known, to mark the last. Returns the
        media error that ended the video (after the frames decoded before it) or None."""
        from specstream.stages.keyframes import select_keyframes

        params = out.params
        cancel = threading.Event()
        run = select_keyframes(path, max_keyframes_per_minute=params.max_keyframes_per_minute, cancel=cancel)
        it = iter(run)
        busy = threading.Lock()  # held while a worker thread advances the run

        def step():
            with busy:
                return _next_keyframe(it)

        def close():
            with busy:  # after a running step returned: it stops within one frame once ``cancel`` is set
                it.close()  # ends the run's decoding child (a no-op after the last keyframe)

        pending, error = None, None
        try:
            while True:
                kf, error = await asyncio.to_thread(step)
                if pending is not None:
                    await self._publish(req, out, FrameTask(
                        req.id, out.source, "video", params, req.qos, pending.frame_index,
                        float(pending.timestamp_s), float(pending.scene_score), pending.image,
                        last=kf is None and error is None))
                if kf is None:
                    break
                pending = kf
                self.keyframes += 1
        finally:
            # also on cancellation (Ctrl-C, shutdown): a thread cannot be cancelled, so stop its decode loop and
            # close the run in a thread (the default executor, which asyncio.run waits for)
            cancel.set()
            await asyncio.shield(asyncio.to_thread(close))
            self.frames_decoded += run.stats.frames_decoded
        return error


class CaptionStage:
    """Stage 3-4: frames in, captions out (one :class:`PipelineResult` per frame; ``final`` on the last).

    Frames of one request are decoded in order, each drafted from the previous caption (temporal drafter);
    frames of different requests share the engine's continuous batch. A frame task is acknowledged
    (``Message.done``) once its result is published. Whatever fails while a frame is handled (image
    preprocessing, a prompt longer than the context, the engine, the chain store, publishing the result) ends as
    that frame's error result (same ``seq`` and ``final``); only when even that cannot be published is the
    message left uncommitted (``Message.fail``). A cancelled stage (shutdown past the drain timeout) abandons the
    engine's requests and acknowledges nothing: the frames are redelivered.

    Args:
        chain_store: where previous captions outlive the process (``get(request_id, seq)`` -> tokens or None,
            ``put(request_id, seq, tokens)``, both async), so a frame redelivered without its predecessor in
            memory drafts from the same hypothesis and repeats an identical result. None: memory only.
        max_in_flight: frames taken from the topic and not finished yet, at most (each holds its full-resolution
            image); the stage stops consuming until one finishes (backpressure on the frames topic).
    """

    def __init__(self, broker: Broker, captioner: Captioner, attention_maps: Path | None = None,
                 chain_store=None, max_in_flight: int = 8):
        self.broker = broker
        self.captioner = captioner
        self.loop = captioner.loop
        self.attention_maps = attention_maps
        self.chain_store = chain_store
        self.stats = CaptionStats()
        self.max_in_flight = max(1, int(max_in_flight))
        self._chains: dict[str, tuple[asyncio.Task, int]] = {}  # request id -> (task of the newest frame, its seq)
        self._map_stem = MapStems()  # source -> its attention maps' file-name stem (unique per source)

    async def run(self) -> None:
        self.loop.start()  # the device loop's thread (idempotent: the loop may serve other stages too)
        tasks = set()
        window = asyncio.Semaphore(self.max_in_flight)
        frames = self.broker.subscribe(TOPIC_FRAMES).__aiter__()
        finished = False
        try:
            while True:
                # a frame's predecessors were taken before it, so the oldest frames in flight can always finish
                await window.acquire()
                try:
                    msg = await frames.__anext__()
                except StopAsyncIteration:
                    break
                frame: FrameTask = msg.value
                prev = self._chains.get(frame.request_id)
                prev_task = prev[0] if prev is not None and prev[1] == frame.seq - 1 else None
                task = asyncio.create_task(self._handle_message(msg, frame, prev_task))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                task.add_done_callback(lambda _: window.release())
                self._chains[frame.request_id] = (task, frame.seq)
                if frame.last:
                    self._chains.pop(frame.request_id, None)
            await asyncio.gather(*tasks)
            finished = True
        finally:
            if not finished:  # cancelled (shutdown past the drain timeout): the loop cancels their requests
                for task in tasks:
                    task.cancel()

    async def _hypothesis(self, frame: FrameTask, prev: asyncio.Task | None) -> list[int] | None:
        """The previous caption of the frame's video (drafting only: a failure here costs speed, not the frame)."""
        try:
            if prev is not None:
                await asyncio.wait([prev])
                return None if prev.cancelled() or prev.exception() is not None else prev.result()
            if frame.seq > 0 and self.chain_store is not None:
                return await self.chain_store.get(frame.request_id, frame.seq - 1)
        except Exception:
            log.exception("frame %s/%s: previous caption unavailable; decoding without it", frame.request_id,
                          frame.seq)
        return None

    async def _handle_message(self, msg: Message, frame: FrameTask, prev: asyncio.Task | None) -> list[int] | None:
        hypothesis = await self._hypothesis(frame, prev)
        if msg.revoked:
            msg.done()
            return None
        try:
            tokens = await self._handle(frame, hypothesis, frame.seq)
        except Exception as exc:  # every failure ends as the frame's error record
            if not isinstance(exc, SpecstreamError):
                log.exception("frame %s/%s failed", frame.request_id, frame.seq)
            if not await self._publish_error(frame, error_info(exc)):
                msg.fail()
                return hypothesis
            msg.done()
            return hypothesis
        if tokens is not None and self.chain_store is not None and not frame.last:
            try:  # before done(), so a redelivered successor drafts from it; lost, it only costs speed
                await self.chain_store.put(frame.request_id, frame.seq, tokens)
            except Exception:
                log.exception("frame %s/%s: previous caption not stored", frame.request_id, frame.seq)
        msg.done()
        return tokens

    async def _publish_error(self, frame: FrameTask, error: ErrorInfo) -> bool:
        """Publish the frame's error result; False when that publish failed too."""
        self.stats.errors += 1
        try:
            await self.broker.publish(TOPIC_RESULTS, frame.request_id, PipelineResult(
                id=frame.request_id, status="error", error=error, seq=frame.seq, final=frame.last))
            return True
        except Exception:
            log.exception("frame %s/%s: the error record could not be published (left uncommitted)",
                          frame.request_id, frame.seq)
            return False

    async def _handle(self, frame: FrameTask, hypothesis: list[int] | None, seq: int) -> list[int] | None:
        """Caption one frame (``caption_frame``) and publish its result (raises on any failure; the caller
        publishes the error). Returns the tokens the next frame of the video drafts from."""
        if frame.error is not None:  # an input's error from the keyframe stage: passed on as it is
            raise RecordedError(frame.error.code, frame.error.message)
        fc = await caption_frame(self.captioner, Frame(frame.source, frame.kind, frame.image, frame.frame_index,
                                                       frame.timestamp_s, frame.scene_score),
                                 frame.params.prompt, frame.params.max_new_tokens, frame.qos, hypothesis,
                                 frame.params.schema, self.attention_maps, self._map_stem)
        self.stats.decode_s += fc.decode_s
        await self.broker.publish(TOPIC_RESULTS, frame.request_id, PipelineResult(
            id=frame.request_id, status="ok", output=fc.record, seq=seq, final=frame.last))
        self.stats.captions += 1
        self.stats.tokens += len(fc.tokens)
        self.stats.target_steps += fc.target_steps
        return fc.draft


__all__ = ["CaptionStage", "FrameTask", "KeyframeStage", "RecordedError", "error_info", "resolve_source"]
