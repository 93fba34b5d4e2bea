"""OpenAI's realtime transcription protocol on ``WS /v1/realtime?intent=transcription`` (wire-compatible).

The event schema is OpenAI's transcription session of the Realtime API (the ``beta.realtime`` types of the
``openai`` package: ``transcription_session.update``, ``input_audio_buffer.*``,
``conversation.item.input_audio_transcription.*``, ``error``); the tests validate every server event against those
pydantic types and drive the route with the official client's ``beta.realtime.connect``. Behind it is the live
subtitle recognizer (:class:`~specstream.stages.streaming.StreamingRecognizer`, one per conversation item) with the
``/v1/subtitles`` session's receiver: the same backpressure (the socket is left unread while the backlog is at
``StreamConfig.max_backlog_s``), idle and session limits, keepalive and authentication (``Authorization: Bearer``
or a subprotocol; never the query string).

Mapping (``docs/api.md``):

- an *item* is the audio between two commits: ``input_audio_buffer.commit`` (manual), or, with ``server_vad``
  turn detection, the end of a speech turn (``silence_duration_ms`` of silence after speech;
  ``speech_started`` / ``speech_stopped`` / ``committed`` are sent). Every sample received belongs to exactly one
  item (silence between turns included, which the recognizer's own VAD gate skips): nothing accepted is dropped
  except by ``input_audio_buffer.clear``, which the client asks for.
- the recognizer's finals of an item are its ``delta`` events, in order (they never change once sent); once the
  item is committed and the recognizer has decoded all of it, ``completed`` carries the whole transcript (the
  deltas concatenated) and ``usage`` in seconds of audio. Partials (which replace each other) are not sent.
- audio: ``pcm16`` (16-bit little-endian mono) at 24 kHz as OpenAI sends it, or at 16 kHz with the extension
  ``input_audio_sample_rate: 16000``; resampled to 16 kHz by libswresample (PyAV), streaming, nothing dropped.

Errors are OpenAI's ``error`` event ``{"type": "error", "event_id", "error": {"type", "code", "message", "param",
"event_id"}}`` and the session stays open: ``invalid_json``, ``invalid_event`` (not an object, no ``type``, a
binary frame), ``invalid_value`` (unknown event type, a bad field value), ``unknown_parameter``,
``unsupported_parameter``, ``invalid_audio`` (not base64, not whole 16-bit samples), ``session_not_configured``
(audio before ``transcription_session.update``), ``input_audio_buffer_append_too_large`` (over
``ServerSettings.realtime_max_append_bytes`` of decoded audio), ``input_audio_buffer_commit_empty`` (less than
100 ms since the last commit). A refused event changes nothing.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, WebSocket
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specstream.pipeline.subtitle_session import (
    CLOSE_POLICY,
    CLOSE_TRY_LATER,
    PcmDecoder,
    SubtitleSession,
    _Closed,
    run_session,
)

log = logging.getLogger("specstream.server")

SAMPLE_RATE = 16000  # the recognizer's rate
OPENAI_PCM16_RATE = 24000  # OpenAI's pcm16: 24 kHz mono 16-bit little-endian
MIN_COMMIT_S = 0.1  # OpenAI refuses to commit less than 100 ms of audio
VAD_FRAME = 512  # samples per turn-detection frame (Silero at 16 kHz: 32 ms)
WHISPER_ALIAS = "whisper-1"


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class RealtimeEventError(Exception):
    """A client event refused with OpenAI's ``error`` event (the session stays open)."""

    def __init__(self, code: str, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.code, self.message, self.param, self.kind = code, message, param, kind


# -- the client's session configuration (OpenAI's beta TranscriptionSessionUpdate.session) --------------------------
class _Transcription(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    language: str | None = None
    prompt: str | None = None


class _TurnDetection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: float = Field(0.5, ge=0.0, le=1.0)
    prefix_padding_ms: int = Field(300, ge=0, le=10000)
    silence_duration_ms: int = Field(500, ge=0, le=60000)
    create_response: bool | None = None  # conversation sessions only; accepted, meaningless here
    interrupt_response: bool | None = None
    eagerness: str | None = None


class _SessionUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_audio_format: str | None = None
    input_audio_sample_rate: Literal[16000, 24000] | None = None  # extension: OpenAI's pcm16 is 24 kHz only
    input_audio_transcription: _Transcription | None = None
    turn_detection: _TurnDetection | None = None
    input_audio_noise_reduction: dict | None = None
    include: list[str] | None = None
    modalities: list[str] | None = None
    client_secret: dict | None = None  # REST-only; ignored on the socket, as OpenAI does


@dataclass
class SessionConfig:
    """What a transcription session runs with (sent back in ``transcription_session.created/updated``)."""

    sample_rate: int = OPENAI_PCM16_RATE
    model: str = WHISPER_ALIAS
    language: str = "en"
    turn_detection: dict | None = field(default_factory=lambda: {"type": "server_vad", "threshold": 0.5,
                                                                 "prefix_padding_ms": 300,
                                                                 "silence_duration_ms": 500})


@dataclass
class _Item:
    """One conversation item: the audio between two commits and its recognizer."""

    id: str
    recognizer: Any  # StreamingRecognizer
    start: int  # absolute 16 kHz sample of the session where its audio begins
    samples: int = 0
    committed: bool = False
    cleared: bool = False
    parts: list[str] = field(default_factory=list)


class RealtimeTranscriptionSession(SubtitleSession):
    """One ``/v1/realtime?intent=transcription`` connection (OpenAI's event schema; see the module docstring).

    The receiver, backpressure, idle/session limits and sender are :class:`SubtitleSession`'s; this class turns
    client events into audio for the items' recognizers and their subtitles into OpenAI's events.
    """

    log_name = "realtime session"

    def __init__(self, ws, app_state, model_id: str):
        super().__init__(ws, app_state)
        self.model_id = model_id
        self.session_id = _id("sess")
        self.cfg = SessionConfig(model=WHISPER_ALIAS)
        self.configured = False
        self.items: deque[_Item] = deque()
        self.last_committed: str | None = None
        self.total = 0  # 16 kHz samples received in the session (after resampling)
        self.finals_sent = 0
        self._turn_vad = None  # the session's turn detector (server_vad), made on the first audio
        self._vad_start = 0  # session sample of its frame 0
        self._vad_seen = 0  # turn-detection frames examined
        self._in_speech = False
        self._silence = 0  # non-speech frames since the last speech frame (in a turn)
        self._speech_end = 0  # absolute sample where the turn's last speech frame ended

    # -- the base session's hooks -------------------------------------------------------------------------------
    def _open_stream(self):
        self.decoder = PcmDecoder(self.cfg.sample_rate, "pcm_s16le")
        return self._new_item().recognizer

    def _totals(self) -> tuple[float, int]:
        return self.total / SAMPLE_RATE, self.finals_sent

    def _backlog_s(self) -> float:
        return sum(it.recognizer.backlog_s for it in self.items if not it.cleared)

    def _due(self) -> bool:
        return self.busy or any(it.committed or it.recognizer.ready() for it in self.items if not it.cleared)

    async def run(self) -> None:
        self._event("transcription_session.created", session=self._session_object())
        await super().run()

    # -- client events ------------------------------------------------------------------------------------------
    def _on_text(self, text: str, first: bool) -> None:
        event_id = None
        try:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise RealtimeEventError("invalid_json", f"the event is not valid JSON: {exc.msg}") from None
            if not isinstance(data, dict) or not isinstance(data.get("type"), str):
                raise RealtimeEventError("invalid_event", "an event must be a JSON object with a string 'type'",
                                         "type")
            event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
            handler = self._handlers().get(data["type"])
            if handler is None:
                raise RealtimeEventError("invalid_value", f"unknown or unsupported event type {data['type'][:64]!r}"
                                         f" (a transcription session takes: {', '.join(self._handlers())})", "type")
            handler(data)
        except RealtimeEventError as exc:
            self._error(exc, event_id)

    def _on_audio(self, data: bytes) -> None:
        self._error(RealtimeEventError("invalid_event", "binary frames are not part of the protocol: send audio "
                                       "as base64 in input_audio_buffer.append events"), None)

    def _handlers(self) -> dict:
        return {"transcription_session.update": self._update, "input_audio_buffer.append": self._append,
                "input_audio_buffer.commit": self._commit, "input_audio_buffer.clear": self._clear}

    def _update(self, data: dict) -> None:
        extra = set(data) - {"type", "event_id", "session"}
        if extra:
            raise RealtimeEventError("unknown_parameter", f"unknown parameter {sorted(extra)[0]!r}",
                                     sorted(extra)[0])
        try:
            upd = _SessionUpdate.model_validate(data.get("session") or {})
        except ValidationError as exc:
            err = exc.errors()[0]
            param = "session." + ".".join(str(x) for x in err["loc"])
            code = "unknown_parameter" if err["type"] == "extra_forbidden" else "invalid_value"
            raise RealtimeEventError(code, f"{param}: {err['msg']}", param) from None
        fields = upd.model_fields_set
        cfg = replace(self.cfg)
        if upd.input_audio_format is not None and upd.input_audio_format != "pcm16":
            raise RealtimeEventError("unsupported_parameter", f"input_audio_format {upd.input_audio_format!r} is "
                                     "not supported (pcm16 only)", "session.input_audio_format")
        if upd.input_audio_sample_rate is not None:
            cfg.sample_rate = upd.input_audio_sample_rate
        if upd.input_audio_noise_reduction is not None:
            raise RealtimeEventError("unsupported_parameter", "input_audio_noise_reduction is not supported "
                                     "(give null)", "session.input_audio_noise_reduction")
        if upd.include:
            raise RealtimeEventError("unsupported_parameter", "include is not supported", "session.include")
        tr = upd.input_audio_transcription
        if tr is not None:
            if tr.model is not None:
                if tr.model not in (self.model_id, WHISPER_ALIAS):
                    raise RealtimeEventError("invalid_value", f"model {tr.model!r} is not served here (use "
                                             f"{self.model_id!r} or {WHISPER_ALIAS!r})",
                                             "session.input_audio_transcription.model")
                cfg.model = tr.model
            if tr.prompt:
                raise RealtimeEventError("unsupported_parameter", "a transcription prompt is not supported by "
                                         "this server's speech path", "session.input_audio_transcription.prompt")
            if tr.language is not None:
                sm = self.state.speech.model
                known = sm.tokens.languages if sm.multilingual else {"en": 0}
                if tr.language not in known:
                    raise RealtimeEventError("invalid_value", f"language {tr.language!r} is not one the model "
                                             "knows", "session.input_audio_transcription.language")
                cfg.language = tr.language
        if "turn_detection" in fields:
            td = upd.turn_detection
            if td is not None and td.type != "server_vad":
                raise RealtimeEventError("unsupported_parameter", f"turn_detection type {td.type!r} is not "
                                         "supported (server_vad or null)", "session.turn_detection.type")
            cfg.turn_detection = None if td is None else {
                "type": "server_vad", "threshold": td.threshold, "prefix_padding_ms": td.prefix_padding_ms,
                "silence_duration_ms": td.silence_duration_ms}
        rate_changed = cfg.sample_rate != self.cfg.sample_rate
        self.cfg, self.configured = cfg, True
        self.config = replace(self.config, language=cfg.language)
        if rate_changed:  # what the old decoder holds belongs to the open item
            self._flush_decoder()
            self.decoder = PcmDecoder(cfg.sample_rate, "pcm_s16le")
        open_item = self.items[-1]
        if not open_item.samples and not open_item.committed:  # the open item is still empty: new settings now
            open_item.recognizer.config = self.config
        if cfg.turn_detection is None:  # off: the detector restarts (aligned anew) if it is turned on again
            self._in_speech, self._turn_vad = False, None
        self._event("transcription_session.updated", session=self._session_object())

    def _append(self, data: dict) -> None:
        extra = set(data) - {"type", "event_id", "audio"}
        if extra:
            raise RealtimeEventError("unknown_parameter", f"unknown parameter {sorted(extra)[0]!r}",
                                     sorted(extra)[0])
        if not self.configured:
            raise RealtimeEventError("session_not_configured", "send transcription_session.update (input audio "
                                     "format, transcription model) before any audio")
        audio = data.get("audio")
        if not isinstance(audio, str):
            raise RealtimeEventError("invalid_value", "audio must be a base64 string", "audio")
        limit = self.settings.realtime_max_append_bytes
        if len(audio) > 4 * (-(-limit // 3)):
            raise RealtimeEventError("input_audio_buffer_append_too_large", f"an append holds at most {limit} "
                                     "bytes of audio (realtime_max_append_bytes); send smaller chunks", "audio")
        try:
            raw = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeEventError("invalid_audio", "audio is not valid base64", "audio") from None
        if len(raw) > limit:
            raise RealtimeEventError("input_audio_buffer_append_too_large", f"an append holds at most {limit} "
                                     "bytes of audio (realtime_max_append_bytes); send smaller chunks", "audio")
        try:
            x = self.decoder.decode(raw)
        except ValueError:
            raise RealtimeEventError("invalid_audio", f"{len(raw)} bytes are not a whole number of pcm16 samples "
                                     "(16-bit little-endian mono)", "audio") from None
        self._feed(x)

    def _commit(self, data: dict) -> None:
        self._flush_decoder()  # all audio received so far belongs to the item; the resampler starts afresh
        self.decoder = PcmDecoder(self.cfg.sample_rate, "pcm_s16le")
        item = self.items[-1]  # (the flushed tail may have ended a server_vad turn)
        if item.samples < MIN_COMMIT_S * SAMPLE_RATE:
            raise RealtimeEventError("input_audio_buffer_commit_empty", f"buffer too small: at least "
                                     f"{int(MIN_COMMIT_S * 1000)} ms of audio are needed, the buffer holds "
                                     f"{item.samples * 1000 / SAMPLE_RATE:.0f} ms")
        self._close_item()
        self._in_speech = False

    def _clear(self, data: dict) -> None:
        item = self.items[-1]
        item.cleared = True
        self._flush_decoder(into=None)
        self.decoder = PcmDecoder(self.cfg.sample_rate, "pcm_s16le")
        self.items.pop()
        self.items.append(_Item(item.id, self._recognizer(), self.total))  # the item id is kept: nothing committed
        self._in_speech = False
        self._event("input_audio_buffer.cleared")
        self.audio_event.set()

    # -- audio -> items -----------------------------------------------------------------------------------------
    def _recognizer(self):
        from specstream.stages.streaming import StreamingRecognizer

        return StreamingRecognizer(self.state.speech, self.config)

    def _new_item(self) -> _Item:
        item = _Item(_id("item"), self._recognizer(), self.total)
        self.items.append(item)
        return item

    def _flush_decoder(self, into: str | None = "open") -> None:
        tail = self.decoder.flush() if self.decoder is not None else np.zeros(0, np.float32)
        if into is not None and len(tail):
            self._feed(tail)

    def _feed(self, x: np.ndarray) -> None:
        """16 kHz samples ``[n]`` into the open item. With server_vad, the turn detector runs over them first:
        ``speech_started`` when a turn begins, and where ``silence_duration_ms`` of non-speech follows speech the
        samples up to there go to the open item, which is committed (``speech_stopped``, ``committed``), and the
        rest to the next one. Every sample goes to exactly one item."""
        if not len(x):
            return
        base, a = self.total, 0
        if self.cfg.turn_detection is not None:
            for kind, pos in self._turns(x, base):
                if kind == "start":
                    self._event("input_audio_buffer.speech_started", audio_start_ms=int(pos * 1000 // SAMPLE_RATE),
                                item_id=self.items[-1].id)
                    continue
                self._insert(x[a:pos - base])
                a, self.total = pos - base, pos
                self._event("input_audio_buffer.speech_stopped",
                            audio_end_ms=int(self._speech_end * 1000 // SAMPLE_RATE), item_id=self.items[-1].id)
                self._close_item()
        self._insert(x[a:])
        self.total = base + len(x)

    def _insert(self, x: np.ndarray) -> None:
        if len(x):
            item = self.items[-1]
            item.recognizer.insert_audio(x)
            item.samples += len(x)
            self.audio_event.set()

    def _turns(self, x: np.ndarray, base: int) -> list[tuple[str, int]]:
        """Turn detection (server_vad, Silero frames of 32 ms) over ``x`` ``[n]``, appended at session sample
        ``base``: ``("start", sample)`` where a turn begins (``prefix_padding_ms`` before its first speech frame,
        not before the open item) and ``("end", sample)`` where it ends, in order, ends in ``(base, base + n]``."""
        from specstream.stages.vad import StreamingVad, VadConfig

        td = self.cfg.turn_detection
        if self._turn_vad is None:  # frame i covers [start + 512 i, start + 512 (i + 1)) of the session
            self._turn_vad = StreamingVad(VadConfig(threshold=0.0))  # speech flags = the RMS floor only
            self._vad_start, self._vad_seen = base, 0
        vad = self._turn_vad
        vad.accept(x)
        need = max(1, -(-td["silence_duration_ms"] * SAMPLE_RATE // (1000 * VAD_FRAME)))
        pad = td["prefix_padding_ms"] * SAMPLE_RATE // 1000
        out: list[tuple[str, int]] = []
        floor = self.items[-1].start
        for i in range(self._vad_seen, vad.frames):
            speech = vad.speech[i] and vad.probs[i] >= td["threshold"]
            end = self._vad_start + (i + 1) * VAD_FRAME
            if not self._in_speech:
                if speech:
                    self._in_speech, self._silence, self._speech_end = True, 0, end
                    out.append(("start", max(floor, end - VAD_FRAME - pad)))
            elif speech:
                self._silence, self._speech_end = 0, end
            else:
                self._silence += 1
                if self._silence >= need:
                    self._in_speech = False
                    floor = max(end, base + 1)
                    out.append(("end", floor))
        self._vad_seen = vad.frames
        return out

    def _close_item(self) -> None:
        item = self.items[-1]
        item.committed = True
        self._event("input_audio_buffer.committed", previous_item_id=self.last_committed, item_id=item.id)
        self.last_committed = item.id
        self._new_item()
        self.audio_event.set()

    # -- the pass loop: items in order ----------------------------------------------------------------------------
    async def _worker(self) -> None:
        from specstream.errors import CapacityError

        try:
            while True:
                await self.audio_event.wait()
                self.audio_event.clear()
                while self.items:
                    item = self.items[0]
                    if item.cleared:
                        self.items.popleft()
                        continue
                    self.recognizer = rec = item.recognizer
                    while rec.ready() and not item.cleared:
                        self.busy = True
                        self._deltas(item, await self._process(rec))
                        self.progress.set()
                    if not item.committed or item.cleared:
                        break
                    self.busy = True
                    self._deltas(item, await self._process(rec, finish=True))
                    self._event("conversation.item.input_audio_transcription.completed", item_id=item.id,
                                content_index=0, transcript="".join(item.parts),
                                usage={"type": "duration", "seconds": round(item.samples / SAMPLE_RATE, 3)})
                    self.items.popleft()
                    self.progress.set()
                self.busy = False
        except CapacityError:
            raise _Closed(CLOSE_TRY_LATER, "engine overloaded") from None
        finally:
            self.busy = False
            self.progress.set()

    def _deltas(self, item: _Item, subs) -> None:
        for sub in subs:
            if sub.kind != "final" or not sub.text.strip() or item.cleared:
                continue
            self.state.metrics.finals.inc()
            self.finals_sent += 1
            self.state.metrics.latency.observe((sub.latency_ms or 0.0) / 1000.0)
            delta = (" " if item.parts else "") + sub.text.strip()
            item.parts.append(delta)
            self._event("conversation.item.input_audio_transcription.delta", item_id=item.id, content_index=0,
                        delta=delta)

    # -- server events ------------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> None:
        self._enqueue({"type": kind, "event_id": _id("event"), **fields})

    def _error(self, exc: RealtimeEventError, event_id: str | None) -> None:
        log.info("realtime session %s: %s (%s)", self.peer, exc.code, exc.message)
        self._event("error", error={"type": exc.kind, "code": exc.code, "message": exc.message, "param": exc.param,
                                    "event_id": event_id})

    def _session_object(self) -> dict:
        return {"id": self.session_id, "object": "realtime.transcription_session", "input_audio_format": "pcm16",
                "input_audio_sample_rate": self.cfg.sample_rate,
                "input_audio_transcription": {"model": self.cfg.model, "language": self.cfg.language,
                                              "prompt": ""},
                "turn_detection": self.cfg.turn_detection, "input_audio_noise_reduction": None, "include": None,
                "modalities": ["text"], "client_secret": None}


def realtime_router(state) -> APIRouter:
    """``WS /v1/realtime``: OpenAI's realtime transcription sessions (``intent=transcription``).

    ``state``: the server's ``AppState``. Limits are the subtitle route's (``max_sessions``, idle, session length,
    outbound queue, keepalive) plus ``realtime_max_append_bytes``; a key in the query string is not accepted
    (``ApiKeyMiddleware``)."""
    router = APIRouter()

    @router.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        if ws.query_params.get("intent") != "transcription":
            await ws.accept()
            await ws.send_text(json.dumps({"type": "error", "event_id": _id("event"), "error": {
                "type": "invalid_request_error", "code": "unsupported_intent", "param": "intent", "event_id": None,
                "message": "only transcription sessions are served: connect with ?intent=transcription"}}))
            await ws.close(CLOSE_POLICY, "unsupported intent")
            return
        await run_session(ws, state, lambda: RealtimeTranscriptionSession(ws, state, _speech_model_id(state)))

    return router


def _speech_model_id(state) -> str:
    """The served Whisper model's id, as ``GET /v1/models`` lists it (``HubConfig.name_of``)."""
    from specstream.stages.serving import HubConfig

    return HubConfig(speech_model=state.settings.speech_model).name_of("speech")
