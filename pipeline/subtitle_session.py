"""One live-subtitle WebSocket session (``/v1/subtitles``; ``/v1/realtime`` builds on it): PCM frames in,
partial and final subtitles out, with the close codes of ``docs/streaming.md``.

Shared by the server (:mod:`specstream.pipeline.server`, which routes to it) and the realtime protocol
(:mod:`specstream.pipeline.realtime`), which the server includes: kept apart so that neither imports the other back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Literal

import numpy as np
from fastapi import WebSocket
from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from specstream.pipeline.server import AppState

log = logging.getLogger("specstream.server")

# WebSocket close codes (RFC 6455 section 7.4.1; documented in docs/streaming.md)
CLOSE_NORMAL = 1000  # after {"type": "done"}
CLOSE_INVALID_DATA = 1007  # malformed start/stop message, odd-sized PCM frame, unsupported format
CLOSE_POLICY = 1008  # bad or missing API key, idle timeout, session too long, client not reading
CLOSE_TOO_BIG = 1009  # a frame over max_frame_bytes
CLOSE_INTERNAL = 1011  # the recognizer failed
CLOSE_TRY_LATER = 1013  # too many sessions, or the engine's realtime queue is full


class StartMessage(BaseModel):
    """The optional first text message of a subtitle session."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["start"]
    sample_rate: int = Field(16000, ge=8000, le=192000)
    format: Literal["pcm_s16le", "f32le"] = "pcm_s16le"
    language: str = "en"


class PcmDecoder:
    """Binary frames of one session -> 16 kHz mono float32 (libswresample via PyAV for other rates, streaming:
    the resampler keeps its state between frames)."""

    def __init__(self, sample_rate: int, fmt: str):
        self.rate = sample_rate
        self.fmt = fmt
        self.width = 2 if fmt == "pcm_s16le" else 4
        self._resampler = None
        if sample_rate != 16000:
            import av

            self._resampler = av.AudioResampler(format="flt", layout="mono", rate=16000)

    def decode(self, data: bytes) -> np.ndarray:
        """Raises ValueError: a frame whose size is not a whole number of samples, or f32le samples that are NaN
        or infinite (nothing of the frame is used)."""
        if len(data) % self.width:
            raise ValueError(f"frame of {len(data)} bytes is not a whole number of {self.fmt} samples")
        if self.fmt == "pcm_s16le":
            x = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
        else:
            x = np.frombuffer(data, dtype="<f4").astype(np.float32)
            bad = np.flatnonzero(~np.isfinite(x))
            if len(bad):
                raise ValueError(f"f32le frame holds {len(bad)} non-finite sample(s) (NaN or Inf), first at "
                                 f"sample {int(bad[0])}")
        if self._resampler is None or not len(x):
            return x
        return self._resample(x)

    def _resample(self, x: np.ndarray | None) -> np.ndarray:
        import av

        frame = None
        if x is not None:
            frame = av.AudioFrame.from_ndarray(x.reshape(1, -1), format="flt", layout="mono")
            frame.sample_rate = self.rate
        out = [f.to_ndarray().reshape(-1) for f in self._resampler.resample(frame)]
        return np.concatenate(out).astype(np.float32) if out else np.zeros(0, dtype=np.float32)

    def flush(self) -> np.ndarray:
        return self._resample(None) if self._resampler is not None else np.zeros(0, dtype=np.float32)


class _Closed(Exception):
    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


async def run_session(ws: WebSocket, state, make_session) -> None:
    """Admission shared by the WebSocket session routes (``/v1/subtitles``, ``/v1/realtime``): before the server is
    ready or at ``max_sessions``, close with 1013 (try again later, counted in the close metric); otherwise accept,
    run ``make_session()`` (a :class:`SubtitleSession`) and count it among the open sessions until it ends."""
    if not state.ready or state.sessions >= state.settings.max_sessions:
        await ws.accept()
        state.metrics.closed.labels(str(CLOSE_TRY_LATER)).inc()
        await ws.close(CLOSE_TRY_LATER, "not ready" if not state.ready else "too many sessions")
        return
    await ws.accept()
    state.sessions += 1
    try:
        await make_session().run()
    finally:
        state.sessions -= 1


class SubtitleSession:
    """One ``/v1/subtitles`` connection: a receiver (the caller's task), a pass loop and a sender task.

    - Backpressure: while the recognizer's backlog (audio received, not yet decoded) is at
      ``StreamConfig.max_backlog_s``, the receiver does not read the socket; uvicorn then stops reading the TCP
      connection and the client's sends block. No audio is dropped.
    - The idle timeout counts client silence only: while passes are due or running, the client is waiting for us.
    - Every close is logged with its code and reason (1011 with the exception's traceback).
    """

    log_name = "subtitle session"  # how the close line names the session

    def __init__(self, ws, app_state: "AppState"):
        self.ws = ws
        self.state = app_state
        self.settings = app_state.settings
        self.outbound: asyncio.Queue = asyncio.Queue(maxsize=self.settings.outbound_queue)
        self.recognizer = None
        self.config = None
        self.decoder: PcmDecoder | None = None
        self.audio_event = asyncio.Event()
        self.progress = asyncio.Event()  # set after every pass (the backlog shrank)
        self.busy = False  # a pass is running or due
        self.stopping = False
        self.closed: _Closed | None = None
        self.peer = "%s:%s" % tuple(ws.client) if getattr(ws, "client", None) else "?"

    async def run(self) -> None:
        from specstream.stages.streaming import StreamConfig

        s = self.settings
        self.config = StreamConfig(hop_s=s.min_hop_s, agree_span_s=s.agree_span_s,
                                   max_final_gap_s=s.max_final_gap_s, catch_up_s=s.catch_up_s)
        self.recognizer = self._open_stream()
        sender = asyncio.create_task(self._sender())
        worker = asyncio.create_task(self._worker())
        self._receiver_task = asyncio.create_task(self._receiver(worker))
        try:
            await self._receiver_task
        except _Closed as exc:
            self.closed = exc
        except asyncio.CancelledError:
            if self.closed is None:  # not cancelled by the sender: the server is shutting down
                raise
        finally:
            worker.cancel()
            if self.closed is None:
                # normal end: wait for the sender to drain (done message) unless it is stuck
                try:
                    await asyncio.wait_for(self.outbound.join(), s.send_timeout_s)
                except asyncio.TimeoutError:
                    self.closed = _Closed(CLOSE_POLICY, "client not reading (send timeout)")
            sender.cancel()
            await asyncio.gather(worker, sender, return_exceptions=True)
        code, reason = (self.closed.code, self.closed.reason) if self.closed else (CLOSE_NORMAL, "done")
        self.state.metrics.closed.labels(str(code)).inc()
        level = logging.INFO if code in (CLOSE_NORMAL, 1000, 1001, 1005, 1006) else (
            logging.ERROR if code == CLOSE_INTERNAL else logging.WARNING)
        log.log(level, "%s %s closed %d (%s) after %.1f s of audio, %d finals", self.log_name, self.peer, code,
                reason, *self._totals())
        try:
            await asyncio.wait_for(self.ws.close(code, reason), 2.0)
        except Exception:
            pass

    def _totals(self) -> tuple[float, int]:
        """(seconds of audio received, finals sent) for the close line."""
        return self.recognizer.audio_end_s, len(self.recognizer.finals)

    def _open_stream(self):
        """The recognizer the session starts with (a subclass may keep several)."""
        from specstream.stages.streaming import StreamingRecognizer

        return StreamingRecognizer(self.state.speech, self.config)

    def _backlog_s(self) -> float:
        """Seconds of received audio no pass has reached yet (at ``max_backlog_s`` the socket is not read)."""
        return self.recognizer.backlog_s

    def _due(self) -> bool:
        """The server owes the client work: a pass is running or due, or the stream is being finished."""
        return self.busy or self.stopping or self.recognizer.ready()

    async def _receiver(self, worker: asyncio.Task) -> None:
        s = self.settings
        t_end = time.monotonic() + s.max_session_s
        idle_since = time.monotonic()
        tick = max(0.05, min(1.0, s.idle_timeout_s / 4))
        first = True
        recv: asyncio.Future | None = None
        try:
            while True:
                now = time.monotonic()
                if now >= t_end:
                    raise _Closed(CLOSE_POLICY, "session too long")
                if recv is None and not self.stopping and self._backlog_s() >= self.config.max_backlog_s:
                    t0 = time.monotonic()  # backpressure: leave the socket unread until the backlog shrinks
                    self.progress.clear()
                    waiter = asyncio.ensure_future(self.progress.wait())
                    try:
                        await asyncio.wait({waiter, worker}, timeout=max(0.0, t_end - now),
                                           return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        waiter.cancel()
                    self.state.metrics.backpressure.inc(time.monotonic() - t0)
                    idle_since = time.monotonic()
                    if not worker.done():
                        continue
                if recv is None:
                    recv = asyncio.ensure_future(self.ws.receive())
                done, _ = await asyncio.wait({recv, worker}, timeout=min(tick, max(0.0, t_end - now)),
                                             return_when=asyncio.FIRST_COMPLETED)
                if worker in done:  # the pass loop ended: done was queued, or it failed
                    exc = worker.exception()
                    if isinstance(exc, _Closed):
                        raise exc
                    if exc is not None:
                        log.error("subtitle session %s: recognizer failed", self.peer, exc_info=exc)
                        raise _Closed(CLOSE_INTERNAL, f"recognizer failed: {type(exc).__name__}")
                    return
                if recv not in done:
                    if self._due():  # the client waits for our backlog: not idle
                        idle_since = time.monotonic()
                    elif time.monotonic() - idle_since >= s.idle_timeout_s:
                        raise _Closed(CLOSE_POLICY, "idle timeout")
                    continue
                msg, recv = recv.result(), None
                idle_since = time.monotonic()
                if msg["type"] == "websocket.disconnect":
                    code = msg.get("code") or 1006
                    raise _Closed(code, msg.get("reason") or "client went away")
                if self.stopping:
                    continue
                if msg.get("text") is not None:
                    self._on_text(msg["text"], first)
                elif msg.get("bytes") is not None:
                    self._on_audio(msg["bytes"])
                first = False
        finally:
            if recv is not None and not recv.done():
                recv.cancel()

    def _on_text(self, text: str, first: bool) -> None:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            raise _Closed(CLOSE_INVALID_DATA, "text messages must be JSON") from None
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "start":
            if not first:
                raise _Closed(CLOSE_INVALID_DATA, "start must be the first message")
            try:
                start = StartMessage.model_validate(data)
            except ValidationError as exc:
                raise _Closed(CLOSE_INVALID_DATA, f"bad start message: {exc.errors()[0]['msg']}"[:120]) from None
            self._set_language(start.language)
            self.decoder = PcmDecoder(start.sample_rate, start.format)
        elif kind == "stop":
            self.stopping = True
            if self.decoder is not None:
                tail = self.decoder.flush()
                if len(tail):
                    self.recognizer.insert_audio(tail)
            self.audio_event.set()
        else:
            raise _Closed(CLOSE_INVALID_DATA, "expected a message of type 'start' or 'stop'")

    def _set_language(self, language: str) -> None:
        """The start message's language: a code the model knows (English-only models: ``en``)."""
        from dataclasses import replace

        sm = self.state.speech.model
        known = sm.tokens.languages if sm.multilingual else {"en": 0}
        if language not in known:
            raise _Closed(CLOSE_INVALID_DATA, f"bad start message: language {language!r} is not one the model "
                                              f"knows ({'en only' if not sm.multilingual else 'e.g. en, de, fr'})")
        self.config = replace(self.config, language=language)
        self.recognizer.config = self.config

    def _on_audio(self, data: bytes) -> None:
        if len(data) > self.settings.max_frame_bytes:
            raise _Closed(CLOSE_TOO_BIG, f"frame over {self.settings.max_frame_bytes} bytes")
        if self.decoder is None:
            self.decoder = PcmDecoder(16000, "pcm_s16le")
        try:
            x = self.decoder.decode(data)
        except ValueError as exc:
            raise _Closed(CLOSE_INVALID_DATA, str(exc)[:120]) from None
        self.recognizer.insert_audio(x)
        self.audio_event.set()

    async def _worker(self) -> None:
        """The pass loop: every due pass in order (also after a stop); on stop, finish and send done."""
        from specstream.errors import CapacityError

        rec = self.recognizer
        try:
            while True:
                await self.audio_event.wait()
                self.audio_event.clear()
                while rec.ready():
                    self.busy = True
                    self._send(await self._process(rec))
                    self.progress.set()
                self.busy = False
                if self.stopping:
                    self.busy = True
                    self._send(await self._process(rec, finish=True))
                    self._enqueue({"type": "done"})
                    return
        except CapacityError:
            raise _Closed(CLOSE_TRY_LATER, "engine overloaded") from None
        finally:
            self.busy = False
            self.progress.set()

    async def _process(self, rec, finish: bool = False) -> list:
        """One due pass of ``rec`` (``finish``: its end of stream); the positions skipped to catch up go to the
        metrics."""
        before = rec.skipped_positions
        out = await (rec.finish() if finish else rec.process())
        if rec.skipped_positions > before:
            self.state.metrics.skipped.inc(rec.skipped_positions - before)
        return out

    def _send(self, subs) -> None:
        for sub in subs:
            if sub.kind == "final":
                self.state.metrics.finals.inc()
                self.state.metrics.latency.observe((sub.latency_ms or 0.0) / 1000.0)
            self._enqueue(sub.message())

    def _enqueue(self, msg: dict) -> None:
        try:
            self.outbound.put_nowait(msg)
        except asyncio.QueueFull:
            raise _Closed(CLOSE_POLICY, "client not reading (outbound queue full)") from None

    async def _sender(self) -> None:
        while True:
            msg = await self.outbound.get()
            try:
                await asyncio.wait_for(self.ws.send_text(json.dumps(msg)), self.settings.send_timeout_s)
            except asyncio.TimeoutError:
                self.closed = _Closed(CLOSE_POLICY, "client not reading (send timeout)")
                self.outbound.task_done()
                self._abort()
                return
            except Exception:
                self.outbound.task_done()
                self._abort()
                return
            self.outbound.task_done()

    def _abort(self) -> None:
        """End the session: the sender cannot deliver any more."""
        if self.closed is None:
            self.closed = _Closed(1006, "send failed")
        self._receiver_task.cancel()
