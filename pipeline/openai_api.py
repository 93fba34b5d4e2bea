"""OpenAI-compatible routes of ``specstream serve``: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models`` and ``POST /v1/audio/transcriptions``, for clients written against OpenAI's API (the official
``openai`` Python package, vLLM's and SGLang's users). Every model call goes through
:class:`~specstream.stages.serving.ModelHub`; chat and completion requests run in the ``interactive`` class.

Shapes follow OpenAI's API reference (chat completion objects and ``chat.completion.chunk`` server-sent events
ending with ``data: [DONE]``; ``usage``; ``logprobs.content`` with ``top_logprobs``; transcription
``json|text|srt|vtt|verbose_json``). What differs, and every limit, is in ``docs/api.md``:

- images come as ``image_url`` parts with ``data:`` URLs, ``file://`` URLs under the server's allowed roots, or
  http(s) URLs of hosts in ``allowed_media_domains`` (empty by default: nothing is fetched;
  ``specstream.modalities.fetch`` has the policy); ``video_url`` parts (as vLLM takes them) become the
  video's keyframes, chosen as ``specstream qa`` chooses them;
- ``n`` (up to 16) choices share one prefill of the prompt (forks of the first choice), then decode as rows of
  the same engine steps, each with its own random stream (seed + i when a seed is given); greedy choices are
  identical; ``return_token_ids: true`` (vLLM's extension) adds
  ``token_ids`` to the choice;
- ``response_format`` (``json_object``, ``json_schema``) and forced tool calls (``tool_choice`` ``required`` or
  named) run through the engine's grammar constraint with speculation on (``response_format.py``,
  ``tool_calls.py``); ``logit_bias`` and ``min_p`` are target logits processors; penalties are refused with
  ``unsupported_parameter``;
- a client that drops a streamed (or any) request cancels it: it ends at its next engine step and frees its slot.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``; codes are specstream's
(``specstream/errors.py``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specstream.errors import (
    CapacityError,
    InvalidRequestError,
    InvalidSchemaError,
    MediaError,
    ModelNotLoadedError,
    SchemaCompileTimeoutError,
    SpecstreamError,
    UnreadableSourceError,
    UnsupportedMediaError,
    UnsupportedParameterError,
)

DISCONNECT_POLL_S = 0.25
_WATCHERS: set[asyncio.Task] = set()  # how often a running request checks that its client is still there
MAX_CHOICES = 16  # n at most
WHISPER_ALIAS = "whisper-1"  # OpenAI's transcription model name, accepted for the served Whisper model


# -- request bodies -------------------------------------------------------------------------------------------------
class _Url(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str
    detail: str | None = None


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "image_url", "video_url", "input_audio", "file"]
    text: str | None = None
    image_url: _Url | None = None
    video_url: _Url | None = None
    input_audio: dict | None = None
    file: dict | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[_Part] | None = None
    name: str | None = None
    tool_calls: list | None = None
    tool_call_id: str | None = None
    function_call: dict | None = None
    refusal: str | None = None


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


_REFUSED = ("functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort", "best_of",
            "echo", "suffix", "web_search_options")


class _Sampling(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)  # choices: one prompt, n decode rows
    stream: bool = False
    stream_options: _StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    return_token_ids: bool = False  # vLLM's extension: the generated token ids in the choice
    min_p: float | None = Field(None, ge=0.0, le=1.0)  # vLLM's extension: min-p filtering (logits.MinP)
    logit_bias: dict[str, float] | None = None  # token id (as a string key) -> bias in [-100, 100]
    response_format: Any = None  # chat: text | json_object | json_schema (response_format.py)
    tools: Any = None  # chat: function tools (tool_calls.py)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # accepted; at most one call is made per choice
    # refused unless absent / null / empty (see _refuse)
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    best_of: Any = None
    echo: Any = None
    suffix: Any = None
    web_search_options: Any = None


class ChatRequest(_Sampling):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)


# -- response bodies (documented in /openapi.json; the routes build them as dicts) -----------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _FunctionCall(BaseModel):
    name: str
    arguments: str  # the arguments' JSON text


class _ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: _FunctionCall


class _AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[_ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = Field(ge=0)
    message: _AssistantMessage
    logprobs: dict | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletion(BaseModel):
    """``chat.completion``: one choice per ``n``, ``index`` 0..n-1."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(BaseModel):
    index: int = Field(ge=0)
    text: str
    logprobs: dict | None
    finish_reason: Literal["stop", "length"] | None
    token_ids: list[int] | None = None


class Completion(BaseModel):
    """``text_completion``: one choice per ``n``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    kind: str
    context_length: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


_SSE_DOC = {"responses": {"200": {"content": {"text/event-stream": {"schema": {
    "type": "string", "description": "with stream: true, server-sent events of chunk objects, then data: [DONE]"}}}}}}


# -- errors ---------------------------------------------------------------------------------------------------------
def error_response(status: int, message: str, code: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error body with the status code's type."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
            429: "rate_limit_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def exception_response(exc: BaseException, param: str | None = None) -> JSONResponse:
    """The HTTP answer to an exception raised while serving a request (Starlette's ``HTTPException``, raised by its
    form parser past a limit, keeps its status)."""
    from starlette.exceptions import HTTPException

    if isinstance(exc, HTTPException) and exc.status_code < 500:
        return error_response(exc.status_code, str(exc.detail), "request_too_large" if exc.status_code == 413
                              else "invalid_request", param)
    if isinstance(exc, CapacityError):
        return error_response(429, exc.message, exc.code, headers={"Retry-After": "5"})
    if isinstance(exc, ModelNotLoadedError):
        return error_response(404, exc.message, exc.code, "model")
    if isinstance(exc, UnreadableSourceError) and "allowed roots" in exc.message:
        return error_response(403, exc.message, exc.code, param)
    if isinstance(exc, UnreadableSourceError) and "no such file" in exc.message:
        return error_response(404, exc.message, exc.code, param)
    if isinstance(exc, (InvalidRequestError, MediaError)):
        return error_response(400, exc.message, exc.code, getattr(exc, "param", None) or param)
    if isinstance(exc, SpecstreamError):
        return error_response(500, exc.message, exc.code)
    return error_response(500, f"{type(exc).__name__}: {exc}", SpecstreamError.code)


def validation_response(errors: list[dict]) -> JSONResponse:
    """OpenAI's 400 for a body that does not match the route's request model (pydantic's ``errors()``; FastAPI
    prefixes each location with ``body``): an unknown field is ``unsupported_parameter``, anything else
    ``invalid_request``; ``param`` is the first error's dotted location."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "value_error"}
    loc_parts = [str(x) for x in err.get("loc", ())]
    if loc_parts[:1] == ["body"]:
        loc_parts = loc_parts[1:]
    loc = ".".join(loc_parts)
    kind = err.get("type")
    if kind == "extra_forbidden":
        return error_response(400, f"Unrecognized request argument supplied: {loc}", "unsupported_parameter", loc)
    if kind == "json_invalid":
        return error_response(400, "the request body must be JSON", "invalid_request")
    if not loc and kind in ("model_attributes_type", "dict_type", "model_type"):
        return error_response(400, "the request body must be a JSON object", "invalid_request")
    if not loc and kind == "missing":
        return error_response(400, "the request needs a JSON body", "invalid_request")
    return error_response(400, f"{loc}: {err.get('msg', 'invalid value')}", "invalid_request", loc or None)


#: the routes whose request-model and body-parsing errors are answered in OpenAI's shape (the server's exception
#: handlers)
OPENAI_JSON_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "invalid request (OpenAI error body; ``code`` is specstream's)"},
    401: {"model": ErrorBody, "description": "missing or wrong API key"},
    403: {"model": ErrorBody, "description": "a file:// URL outside the allowed roots"},
    404: {"model": ErrorBody, "description": "model not served here, or no such file"},
    413: {"description": "request body over the limit"},
    429: {"model": ErrorBody, "description": "too many requests in flight; retry after ``Retry-After`` s"},
}


def _refuse(body: _Sampling) -> None:
    for name in _REFUSED:
        value = getattr(body, name, None)
        if value not in (None, [], {}, False) and not (name == "parallel_tool_calls" and value is True):
            err = UnsupportedParameterError(f"{name!r} is not supported by this server")
            err.param = name
            raise err
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value not in (None, 0, 0.0):
            err = UnsupportedParameterError(f"{name!r} other than 0 is not supported by this server")
            err.param = name
            raise err


def _stops(stop) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > 4 or any(not s for s in stops):
        err = InvalidRequestError("'stop' takes up to 4 non-empty strings")
        err.param = "stop"
        raise err
    return stops


# -- the state behind the routes ------------------------------------------------------------------------------------
class OpenAIState:
    """The routes' model hub (built on first use from the server settings) and in-flight count."""

    def __init__(self, app_state):
        self.app_state = app_state
        self.settings = app_state.settings
        self._hub = None
        self.in_flight = 0
        self.created = int(time.time())

    def hub(self):
        if self._hub is None:
            from specstream.pipeline.defaults import default_caption_models
            from specstream.stages.serving import HubConfig, ModelHub

            s = self.settings
            target, drafts, name = s.caption_target, (s.caption_draft,) if s.caption_draft else (), None
            if target is None:
                t, d = default_caption_models(quiet=True)
                target, drafts, name = str(t), (str(d),), "specstream-tiny-llava"
            # the server's device loop and its caption VLM runner: chat, captions and subtitles share one loop
            self._hub = ModelHub(HubConfig(vlm=target, vlm_drafts=drafts, vlm_name=name, text_model=s.text_model,
                                           text_drafts=(s.text_draft,) if s.text_draft else (),
                                           speech_model=s.speech_model, clip_model=s.clip_model,
                                           clip_pretrained=s.clip_pretrained),
                                 loop=self.app_state.loop, captioner=self.app_state.captioner,
                                 speech_loader=getattr(self.app_state, "speech_model", None))
        speech = self.app_state.speech
        if speech is not None and getattr(self.app_state, "ready", False):
            self._hub.use_speech_model(speech.model)  # the subtitle service's Whisper, shared
        return self._hub

    def admit(self) -> None:
        """Count a request in flight. Raises CapacityError past ``max_openai_requests``."""
        if self.in_flight >= self.settings.max_openai_requests:
            raise CapacityError(f"{self.in_flight} requests in flight (max_openai_requests); retry later")
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1


# -- media of chat messages -----------------------------------------------------------------------------------------
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


class _Media:
    """Opens the media of one request (data: and file:// URLs) into a private temporary folder; the decoded bytes
    of all its media count against ``max_upload_bytes`` together."""

    def __init__(self, settings):
        self.settings = settings
        self.budget = settings.max_upload_bytes
        self.tmpdir: str | None = None

    def close(self) -> None:
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def _store(self, data: bytes, mime: str, want: str) -> tuple[str, str]:
        """(path, display name) of ``data`` written into the request's folder; counts against the budget."""
        from specstream.pipeline.uploads import media_suffix, upload_display_name

        self.budget -= len(data)
        ext = {"image/png": ".png", "image/jpeg": ".jpg", "image/webp": ".webp", "image/gif": ".gif",
               "video/mp4": ".mp4", "video/webm": ".webm", "video/quicktime": ".mov"}.get(mime, "")
        shown = upload_display_name(f"{want}{ext}")
        if self.tmpdir is None:
            self.tmpdir = tempfile.mkdtemp(prefix="specstream-openai-")
        path = os.path.join(self.tmpdir, f"media{secrets.token_hex(4)}" + media_suffix(shown))
        with open(path, "wb") as fh:
            fh.write(data)
        return path, shown

    def open(self, url: str, want: str, param: str) -> tuple[str, str, Any]:
        """(path to read, display name, opened source or None) of a media URL expected to hold ``want``
        (``image`` or ``video``), after sniffing its content.

        Raises:
            UnsupportedParameterError (http(s) without ``allowed_media_domains``, other schemes),
            MediaUrlNotAllowedError, MediaFetchError (http(s) under the policy: ``specstream.modalities.fetch``),
            InvalidRequestError (bad data URL, too large),
            UnreadableSourceError (file URL outside the roots or missing), UnsupportedMediaError (wrong kind).
        """
        from specstream.modalities.source import open_source
        from specstream.stages.caption import media_kind

        low = url[:16].lower()
        opened = None
        if low.startswith("data:"):
            m = _DATA_URL.match(url)
            if m is None or not m.group("b64"):
                raise _param(InvalidRequestError("a data: URL must be base64 (data:<type>;base64,<data>)"), param)
            payload = url[m.end():]
            if len(payload) > 4 * (self.budget // 3 + 1):
                raise _param(InvalidRequestError(f"media over {self.settings.max_upload_bytes} bytes "
                                                 "(max_upload_bytes)"), param)
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise _param(InvalidRequestError("the data: URL is not valid base64"), param) from None
            if len(data) > self.budget:
                raise _param(InvalidRequestError(f"media over {self.settings.max_upload_bytes} bytes in this "
                                                 "request (max_upload_bytes)"), param)
            path, shown = self._store(data, (m.group("mime") or "").lower(), want)
        elif low.startswith(("http://", "https://")) and self.settings.allowed_media_domains:
            from specstream.modalities.fetch import FetchPolicy, fetch

            policy = FetchPolicy(tuple(self.settings.allowed_media_domains), self.settings.max_upload_bytes,
                                 self.settings.media_fetch_timeout_s)
            try:
                data, mime = fetch(url, policy, self.budget)
            except SpecstreamError as exc:
                raise _param(exc, param) from None
            path, shown = self._store(data, (mime or "").split(";")[0].strip().lower(), want)
        elif low.startswith("file://"):
            roots = self.settings.allowed_roots
            if not roots:
                raise _param(UnreadableSourceError("file:// URLs are disabled here (no allowed roots configured): "
                                                   "send the media as a data: URL"), param)
            opened = open_source(url[len("file://"):], roots, self.settings.max_upload_bytes)
            path, shown = opened.path, url
        elif low.startswith(("http://", "https://")):
            raise _param(UnsupportedParameterError(
                f"this server does not fetch {url.split(':', 1)[0]} URLs (no --allowed-media-domains): send the media "
                "as a data: URL, or a file:// URL under an allowed root"), param)
        else:
            raise _param(UnsupportedParameterError(f"unsupported media URL scheme in {url[:40]!r}: use data: or "
                                                   "file://"), param)
        try:
            kind = media_kind(path, shown)
        except BaseException:
            if opened is not None:
                opened.close()
            raise
        if kind != want:
            if opened is not None:
                opened.close()
            raise _param(UnsupportedMediaError(f"{param}: the content is {'an' if kind == 'image' else 'a'} "
                                               f"{kind}, not {'an' if want == 'image' else 'a'} {want}"), param)
        return path, shown, opened


def _param(exc: SpecstreamError, param: str) -> SpecstreamError:
    exc.param = param
    return exc


async def _turns(body: ChatRequest, hub, settings) -> tuple[tuple, _Media]:
    """The request's messages as hub turns (images decoded, videos reduced to their chosen keyframes)."""
    from specstream.modalities.image import load_image
    from specstream.stages.serving import Turn

    media = _Media(settings)
    turns = []
    try:
        for i, msg in enumerate(body.messages):
            if msg.role == "function" or msg.function_call:
                raise _param(UnsupportedParameterError("function messages (the deprecated 'functions' API) are not "
                                                       "supported: use tools"), f"messages.{i}")
            role = "system" if msg.role == "developer" else msg.role
            content = msg.content
            if msg.role == "tool":  # a tool's result, shown to the model as a user turn (the template has no tool role)
                text = content if isinstance(content, str) else " ".join(p.text or "" for p in content or ())
                turns.append(Turn("user", (f"Result of the function call {msg.tool_call_id or ''}: {text}",)))
                continue
            if msg.tool_calls:  # an earlier call, as the model wrote it (tool_calls.py's format)
                try:
                    calls = [json.dumps({"name": c["function"]["name"],
                                         "arguments": json.loads(c["function"]["arguments"] or "{}")},
                                        ensure_ascii=False) for c in msg.tool_calls]
                except (TypeError, KeyError, ValueError):
                    raise _param(InvalidRequestError("tool_calls must be OpenAI tool calls whose arguments are a "
                                                     "JSON object"), f"messages.{i}.tool_calls") from None
                turns.append(Turn("assistant", ("\n".join(calls),)))
                continue
            if content is None:
                raise _param(InvalidRequestError("a message needs content"), f"messages.{i}.content")
            if isinstance(content, str):
                turns.append(Turn(role, (content,)))
                continue
            texts = [p.text for p in content if p.type == "text" and p.text]
            parts: list[Any] = []
            for j, part in enumerate(content):
                where = f"messages.{i}.content.{j}"
                if part.type == "text":
                    if part.text is None:
                        raise _param(InvalidRequestError("a text part needs 'text'"), where)
                    parts.append(part.text)
                elif part.type == "image_url" and part.image_url is not None:
                    path, _, opened = await asyncio.to_thread(media.open, part.image_url.url, "image", where)
                    try:
                        parts.append(await asyncio.to_thread(load_image, path))
                    except MediaError as exc:  # a media limit, a damaged image: named by the part
                        raise _param(exc, getattr(exc, "param", None) or where) from None
                    finally:
                        if opened is not None:
                            opened.close()
                elif part.type == "video_url" and part.video_url is not None:
                    try:
                        parts.extend(await _video_frames(hub, media, part.video_url.url, " ".join(texts), where,
                                                         settings))
                    except MediaError as exc:
                        raise _param(exc, getattr(exc, "param", None) or where) from None
                else:
                    raise _param(UnsupportedParameterError(f"content parts of type {part.type!r} are not "
                                                           "supported (text, image_url, video_url)"), where)
            turns.append(Turn(role, tuple(parts)))
    except BaseException:
        media.close()
        raise
    return tuple(turns), media


async def _video_frames(hub, media: _Media, url: str, question: str, where: str, settings) -> list[np.ndarray]:
    """A video's keyframes chosen as ``specstream qa`` chooses them: spread over the scenes, or (with a CLIP model)
    the ones most similar to the message's text; at most ``chat_video_frames``, in time order."""
    from specstream.stages.qa import spread_indices, top_k_indices

    path, _, opened = await asyncio.to_thread(media.open, url, "video", where)
    try:
        keyframes = await hub.keyframes(path)
    finally:
        if opened is not None:
            opened.close()
    if not keyframes:
        raise _param(UnsupportedMediaError("the video has no frames"), where)
    k = min(settings.chat_video_frames, len(keyframes))
    if hub.has_clip and question.strip():
        sims = await hub.similarity([kf.image for kf in keyframes], question)
        chosen = top_k_indices(sims, k)
    else:
        chosen = spread_indices(len(keyframes), k)
    return [keyframes[i].image for i in chosen]


# -- responses ------------------------------------------------------------------------------------------------------
def _token_entry(hub_model, tid: int, lp: float, top: list[tuple[int, float]] | None) -> dict[str, Any]:
    text = hub_model.decode([tid])
    entry = {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    if top is not None:
        entry["top_logprobs"] = [{"token": hub_model.decode([t]), "logprob": v,
                                  "bytes": list(hub_model.decode([t]).encode("utf-8"))} for t, v in top]
    return entry


def _logprobs_content(hub_model, gen, tokens: list[int], offset: int = 0) -> list[dict[str, Any]]:
    eos = set(hub_model.eos)
    out = []
    for k, t in enumerate(tokens):
        if t in eos:
            continue
        lp = gen.logprobs[offset + k] if gen.logprobs is not None else 0.0
        top = gen.top_logprobs[offset + k] if gen.top_logprobs is not None else None
        out.append(_token_entry(hub_model, t, lp, top))
    return out


def _usage(gens: list) -> dict[str, int]:
    """OpenAI's usage of one request: the prompt once, the tokens of every choice."""
    done = sum(len(g.tokens) for g in gens)
    return {"prompt_tokens": gens[0].prompt_tokens, "completion_tokens": done,
            "total_tokens": gens[0].prompt_tokens + done}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _watch_client(request: Request, task: asyncio.Task) -> None:
    """Cancel ``task`` when the client disconnects (polled; the generator also notices on its next send)."""
    while not task.done():
        if await request.is_disconnected():
            task.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


# -- structured output and tools --------------------------------------------------------------------------------------
def _structure(body: _Sampling, chat: bool):
    """``(tool plan, JSON Schema or None, the field the schema came from)`` of a request.

    Raises:
        UnsupportedParameterError / InvalidSchemaError with ``param``: tools on ``/v1/completions``, a bad
        ``response_format``, bad ``tools`` / ``tool_choice``, or ``response_format`` together with tools the
        model may call (the output is either the format or a tool call; say which with ``tool_choice``)."""
    from specstream.pipeline.response_format import schema_from_response_format
    from specstream.pipeline.tool_calls import ToolPlan, tool_plan

    if not chat and (body.tools not in (None, []) or body.tool_choice is not None):
        raise _param(UnsupportedParameterError("tools are a chat completions feature"), "tools")
    plan = tool_plan(body.tools, body.tool_choice) if chat else ToolPlan("none")
    try:
        schema = schema_from_response_format(body.response_format)
    except (InvalidSchemaError, UnsupportedParameterError) as exc:
        raise _param(exc, "response_format") from None
    if schema is not None and plan.active:
        raise _param(UnsupportedParameterError("response_format with tools the model may call is not supported: "
                                               "give tool_choice 'none', or drop response_format"),
                     "response_format")
    if plan.constrained:
        return plan, plan.schema(), "tools"
    return plan, schema, "response_format"


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` (token id strings -> bias) as ``(id, bias)`` pairs.

    Raises:
        InvalidRequestError (param ``logit_bias``): a key that is not a token id, a bias outside [-100, 100]."""
    out = []
    for key, value in (bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise _param(InvalidRequestError(f"logit_bias keys are token ids, got {key!r}"), "logit_bias") from None
        if tid < 0 or not -100.0 <= float(value) <= 100.0:
            raise _param(InvalidRequestError("logit_bias maps token ids >= 0 to biases in [-100, 100]"),
                         "logit_bias")
        out.append((tid, float(value)))
    return tuple(out)


def _with_tools(turns: tuple, plan) -> tuple:
    """``turns`` with the tools shown in the system turn (a new first turn when there is none)."""
    from specstream.stages.serving import Turn

    if not plan.active:
        return turns
    text = plan.system_text()
    if turns and turns[0].role == "system":
        return (Turn("system", turns[0].parts + ("\n" + text,)),) + tuple(turns[1:])
    return (Turn("system", (text,)),) + tuple(turns)


def _chat_message(gen, plan) -> tuple[dict[str, Any], str]:
    """The assistant message of a finished choice and its finish reason (``tool_calls`` for a tool call)."""
    from specstream.pipeline.tool_calls import new_call_id, parse_tool_call

    call = parse_tool_call(plan, gen.text) if plan is not None and plan.active and gen.finish_reason == "stop" \
        else None
    if call is None:
        return {"role": "assistant", "content": gen.text}, gen.finish_reason
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": new_call_id(), "type": "function", "function": {"name": call[0], "arguments": call[1]}}]}, \
        "tool_calls"


# -- the routes -----------------------------------------------------------------------------------------------------
def openai_router(app_state) -> APIRouter:
    """The OpenAI-compatible routes over ``app_state`` (the server's ``AppState``)."""
    from specstream.pipeline.uploads import FORM_OVERHEAD_BYTES
    from specstream.stages.serving import QOS_INTERACTIVE, GenerationParams, Prompt

    state = OpenAIState(app_state)
    app_state.openai = state
    settings = app_state.settings
    router = APIRouter()
    json_limit = 4 * (settings.max_upload_bytes // 3 + 1) + FORM_OVERHEAD_BYTES  # base64 media + the rest

    async def complete(request: Request, body: _Sampling, prompt_of, chat: bool):
        """Shared by both completion routes: admission, generation (streamed or not), errors, cleanup."""
        plan, schema, schema_param = _structure(body, chat)
        hub = state.hub()
        kind = hub.kind_of(body.model)
        model = await hub.model(kind)
        prompt, media = await prompt_of(hub, plan)
        stream_usage = bool(body.stream_options and body.stream_options.include_usage)
        if chat:
            logprobs = bool(body.logprobs)
            top = body.top_logprobs or 0
            if top and not logprobs:
                raise _param(InvalidRequestError("top_logprobs needs logprobs: true"), "top_logprobs")
            max_new = body.max_completion_tokens or body.max_tokens
        else:
            logprobs = body.logprobs is not None
            top = body.logprobs or 0
            max_new = body.max_tokens or 16  # OpenAI's default for text completions
        temperature = 1.0 if body.temperature is None else body.temperature
        choices = body.n or 1
        # one random stream per choice: seed + i when the client gave a seed (reproducible), else fresh draws
        seeds = [body.seed + i if body.seed is not None else secrets.randbits(31) for i in range(choices)]
        stops = _stops(body.stop)
        bias = _logit_bias(body.logit_bias)
        params = [GenerationParams(max_new_tokens=max_new, temperature=temperature, top_p=body.top_p or 1.0,
                                   seed=seed, stop=stops, logprobs=logprobs, top_logprobs=top, logit_bias=bias,
                                   min_p=body.min_p or 0.0) for seed in seeds]
        if schema is not None:  # compiled (and cached) before admission: a bad schema is a 400 naming its field
            try:
                await hub.compile_schema(schema, model=body.model)
            except (InvalidSchemaError, SchemaCompileTimeoutError) as exc:
                raise _param(exc, schema_param) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        state.admit()
        admitted = False
        try:
            if not body.stream:
                task = asyncio.create_task(hub.generate_many(prompt, params, model=body.model, qos=QOS_INTERACTIVE,
                                                             schema=schema))
                watch = asyncio.create_task(_watch_client(request, task))
                try:
                    gens = await task
                finally:
                    watch.cancel()
                return JSONResponse(_final(rid, created, model, gens, chat, body.return_token_ids, plan))
            queue: asyncio.Queue = asyncio.Queue()
            started = asyncio.Event()
            task = asyncio.create_task(hub.generate_many(prompt, params, model=body.model, qos=QOS_INTERACTIVE,
                                                         on_delta=lambda i, d: queue.put_nowait((i, d)),
                                                         on_admitted=started.set, schema=schema))
            waiter = asyncio.create_task(started.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if task.done() and task.exception() is not None:
                raise task.exception()
            admitted = True
            # from here the generation owns the slot in flight and the media: released when it ends, however it
            # ends (finished, cancelled by a client that went away, or never streamed because the client vanished
            # before the response started)
            task.add_done_callback(lambda _: (state.release(), media.close()))
            watch = asyncio.create_task(_watch_client(request, task))
            _WATCHERS.add(watch)  # a strong reference until it ends (the loop keeps only weak ones)
            watch.add_done_callback(_WATCHERS.discard)
            return StreamingResponse(_events(task, queue, rid, created, model, chat, logprobs, stream_usage,
                                             body.return_token_ids, choices, plan),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        finally:
            if not admitted:
                state.release()
                media.close()

    async def handle(request: Request, body: _Sampling, prompt_of, chat: bool):
        try:
            _refuse(body)
            return await complete(request, body, prompt_of, chat)
        except Exception as exc:  # noqa: BLE001  every failure is an OpenAI error body
            return exception_response(exc)

    @router.post("/v1/chat/completions", summary="OpenAI chat completions (text, images, video; SSE stream)",
                 max_body_size=json_limit, responses=ERROR_RESPONSES,
                 response_model=ChatCompletion, openapi_extra=_SSE_DOC)
    async def chat_completions(request: Request, body: ChatRequest):
        async def prompt_of(hub, plan):
            turns, media = await _turns(body, hub, settings)
            return Prompt(turns=_with_tools(turns, plan)), media

        return await handle(request, body, prompt_of, True)

    @router.post("/v1/completions", summary="OpenAI text completions", max_body_size=json_limit,
                 responses=ERROR_RESPONSES, response_model=Completion, openapi_extra=_SSE_DOC)
    async def completions(request: Request, body: CompletionRequest):
        async def prompt_of(hub, _plan):
            p = body.prompt
            if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                return Prompt(ids=tuple(p)), _Media(settings)  # token ids, as they are
            if isinstance(p, list):
                if len(p) != 1 or not isinstance(p[0], str):
                    raise _param(UnsupportedParameterError("'prompt' must be one string or one list of token ids "
                                                           "(batches are not supported)"), "prompt")
                p = p[0]
            return Prompt(text=p), _Media(settings)

        return await handle(request, body, prompt_of, False)

    @router.get("/v1/models", summary="OpenAI model list: the models this server serves", response_model=ModelList)
    async def models():
        data = [{"id": m.id, "object": "model", "created": state.created, "owned_by": "specstream",
                 "kind": m.kind, "context_length": m.context_length} for m in state.hub().models()]
        return {"object": "list", "data": data}

    @router.post("/v1/audio/transcriptions", summary="OpenAI audio transcriptions (Whisper, speculative decoding)",
                 max_body_size=settings.max_upload_bytes + FORM_OVERHEAD_BYTES, responses=ERROR_RESPONSES,
                 openapi_extra=_TRANSCRIPTION_DOC)
    async def transcriptions(request: Request):
        try:
            return await _transcription(request, state)
        except Exception as exc:  # noqa: BLE001
            return exception_response(exc)

    return router


def _final(rid: str, created: int, model, gens: list, chat: bool, token_ids: bool, plan=None) -> dict[str, Any]:
    """The completion object of ``gens`` (one per choice, ``index`` in order); ``plan``: the request's tools
    (``tool_calls.ToolPlan``)."""
    hub_model = model
    choices = []
    for index, gen in enumerate(gens):
        if chat:
            message, reason = _chat_message(gen, plan)
            choice: dict[str, Any] = {"index": index, "message": message, "logprobs": None,
                                      "finish_reason": reason}
            if gen.logprobs is not None:
                choice["logprobs"] = {"content": _logprobs_content(hub_model, gen, gen.tokens)}
        else:
            choice = {"index": index, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason}
            if gen.logprobs is not None:
                choice["logprobs"] = _legacy_logprobs(hub_model, gen)
        if token_ids:
            choice["token_ids"] = list(gen.tokens)
        choices.append(choice)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": gens[0].model, "system_fingerprint": None, "choices": choices, "usage": _usage(gens)}


def _legacy_logprobs(hub_model, gen) -> dict[str, Any]:
    """``/v1/completions`` log-probabilities: tokens, token_logprobs, top_logprobs (dicts), text_offset."""
    eos = set(hub_model.eos)
    tokens, lps, tops, offsets, pos = [], [], [], [], 0
    for k, t in enumerate(gen.tokens):
        if t in eos:
            continue
        text = hub_model.decode([t])
        tokens.append(text)
        lps.append(gen.logprobs[k])
        if gen.top_logprobs is not None:
            tops.append({hub_model.decode([a]): v for a, v in gen.top_logprobs[k]})
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops if gen.top_logprobs is not None else None,
            "text_offset": offsets}


async def _events(task: asyncio.Task, queue: asyncio.Queue, rid: str, created: int, model, chat: bool,
                  logprobs: bool, usage: bool, token_ids: bool, choices: int = 1, plan=None):
    """The SSE stream of one request: a role chunk per choice, a chunk per engine step and choice that released
    text (or tokens with log-probabilities), each choice's final chunk with ``finish_reason``, the usage chunk when
    asked, ``[DONE]``. Every chunk carries its choice's ``index``; ``queue`` holds ``(index, delta)``. With tools
    (``plan`` active) each choice's text goes through a ``tool_calls.ToolCallStream``, which turns it into
    ``delta.tool_calls`` chunks (or content) as OpenAI streams tool calls; a step's logprobs ride on its last chunk
    (or the next one when the step sent none). When the client goes away (a send fails, or the watcher sees the
    disconnect) the generation is cancelled."""
    from specstream.pipeline.tool_calls import ToolCallStream

    obj = "chat.completion.chunk" if chat else "text_completion"
    mid = model.info.id
    tools = [ToolCallStream(plan) for _ in range(choices)] if chat and plan is not None and plan.active else None
    pending_lp: list[list[dict]] = [[] for _ in range(choices)]

    def chunk(choice: dict | None, extra: dict | None = None) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": mid, "system_fingerprint": None,
                "choices": [choice] if choice is not None else []}
        if extra:
            body.update(extra)
        return _sse(body)

    try:
        if chat:
            for index in range(choices):
                yield chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
        async for index, delta in _drain(queue, task):
            if not delta.text and not (logprobs and delta.tokens):
                continue
            if chat and tools is not None:
                if logprobs:
                    pending_lp[index] += [_token_entry(model, t, lp, None) for t, lp in
                                          zip(delta.tokens, delta.logprobs) if t not in model.eos]
                parts = tools[index].feed(delta.text)
                for k, part in enumerate(parts):
                    choice = {"index": index, "delta": part, "logprobs": None, "finish_reason": None}
                    if logprobs and k == len(parts) - 1:
                        choice["logprobs"] = {"content": pending_lp[index]}
                        pending_lp[index] = []
                    yield chunk(choice)
                continue
            if chat:
                choice = {"index": index, "delta": {"content": delta.text}, "logprobs": None,
                          "finish_reason": None}
                if logprobs:
                    choice["logprobs"] = {"content": [_token_entry(model, t, lp, None) for t, lp in
                                                      zip(delta.tokens, delta.logprobs) if t not in model.eos]}
            else:
                choice = {"index": index, "text": delta.text, "logprobs": None, "finish_reason": None}
            yield chunk(choice)
        try:
            gens = task.result()
        except Exception as exc:  # noqa: BLE001  after the first byte the status is sent: an error event
            err = json.loads(exception_response(exc).body)
            yield _sse(err)
            yield "data: [DONE]\n\n"
            return
        for index, gen in enumerate(gens):
            reason = gen.finish_reason
            if tools is not None:
                parts, reason = tools[index].finish(gen.finish_reason)
                for part in parts:
                    yield chunk({"index": index, "delta": part, "logprobs": None, "finish_reason": None})
            last = {"index": index, "logprobs": None, "finish_reason": reason}
            if tools is not None and logprobs and pending_lp[index]:
                last["logprobs"] = {"content": pending_lp[index]}
            last.update({"delta": {}} if chat else {"text": ""})
            if token_ids:
                last["token_ids"] = list(gen.tokens)
            yield chunk(last)
        if usage:
            yield chunk(None, {"usage": _usage(gens)})
        yield "data: [DONE]\n\n"
    finally:
        if not task.done():
            task.cancel()  # the client went away: the request ends at its next engine step


# -- transcriptions -------------------------------------------------------------------------------------------------
_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
#: the multipart form ``_transcription`` reads, for /openapi.json (the form is parsed by hand: streamed to disk)
_TRANSCRIPTION_DOC = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "model"], "properties": {
        "file": {"type": "string", "format": "binary"}, "model": {"type": "string"},
        "response_format": {"type": "string", "enum": list(_FORMATS)},
        "temperature": {"type": "number", "minimum": 0, "maximum": 0}, "language": {"type": "string"},
        "prompt": {"type": "string"},
        "timestamp_granularities[]": {"type": "array", "items": {"type": "string", "enum": ["segment", "word"]}}},
}}}}}


async def _transcription(request: Request, state: OpenAIState) -> Response:
    from specstream.pipeline.uploads import FORM_OVERHEAD_BYTES, media_suffix, upload_display_name
    from specstream.stages.serving import QOS_INTERACTIVE, has_audio_stream

    settings = state.settings
    form = await request.form(max_files=1, max_fields=16, max_part_size=FORM_OVERHEAD_BYTES // 2)
    tmpdir = None
    try:
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise _param(InvalidRequestError("give the audio as the multipart field 'file'"), "file")
        model = form.get("model")
        hub = state.hub()
        speech_id = next(m.id for m in hub.models() if m.kind == "speech")
        if not isinstance(model, str) or model not in (speech_id, WHISPER_ALIAS):
            raise _param(ModelNotLoadedError(f"model {model!r} is not a speech model served here (use {speech_id!r} "
                                             f"or {WHISPER_ALIAS!r})"), "model")
        fmt = form.get("response_format") or "json"
        if fmt not in _FORMATS:
            raise _param(InvalidRequestError(f"response_format must be one of {', '.join(_FORMATS)}"),
                         "response_format")
        temperature = form.get("temperature")
        if temperature not in (None, "", "0", "0.0"):
            raise _param(UnsupportedParameterError("only temperature 0 (greedy decoding) is supported"),
                         "temperature")
        grains = set(form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities"))
        if grains - {"segment", "word"}:
            raise _param(InvalidRequestError("timestamp_granularities take 'segment' and 'word'"),
                         "timestamp_granularities")
        if grains and fmt != "verbose_json":
            raise _param(InvalidRequestError("timestamp_granularities need response_format verbose_json"),
                         "timestamp_granularities")
        language = form.get("language") or None
        prompt = form.get("prompt") or None
        stream = _stream_flag(form.get("stream"), fmt)
        shown = upload_display_name(upload.filename)
        tmpdir = tempfile.mkdtemp(prefix="specstream-upload-")
        path = os.path.join(tmpdir, "upload" + media_suffix(shown))  # no part of the client's name
        size = 0
        with open(path, "wb") as fh:
            while chunk := await upload.read(1 << 20):
                size += len(chunk)
                if size > settings.max_upload_bytes:
                    return error_response(413, f"upload over {settings.max_upload_bytes} bytes", "request_too_large",
                                          "file")
                fh.write(chunk)
        await upload.close()
        if not size:
            raise _param(UnreadableSourceError(f"{shown}: empty upload"), "file")
        if not await asyncio.to_thread(has_audio_stream, path):  # by content: a container with an audio stream
            raise _param(UnsupportedMediaError(f"{shown}: no audio stream found in the file"), "file")
        state.admit()
        if stream:  # each segment's text is sent as its window is decoded; the task owns the upload and the slot
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            task = asyncio.create_task(hub.transcribe(
                path, language=language, prompt=prompt, qos=QOS_INTERACTIVE,
                on_segment=lambda seg: loop.call_soon_threadsafe(queue.put_nowait, seg)))
            owned = tmpdir
            task.add_done_callback(lambda _: (state.release(), shutil.rmtree(owned, ignore_errors=True)))
            tmpdir = None
            return StreamingResponse(_transcription_events(task, queue), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            tr = await hub.transcribe(path, language=language, prompt=prompt, word_timestamps="word" in grains,
                                      qos=QOS_INTERACTIVE)
        finally:
            state.release()
    finally:
        await form.close()
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return _transcription_response(tr, fmt, grains)


def _stream_flag(value, fmt: str) -> bool:
    """The form field ``stream`` (``true``/``false``); a stream carries text, so only ``json``/``text`` formats.

    Raises:
        InvalidRequestError (param ``stream``): another value, or a stream asked with a timed format."""
    if value in (None, "", "false", "False"):
        return False
    if value not in ("true", "True"):
        raise _param(InvalidRequestError("stream must be true or false"), "stream")
    if fmt not in ("json", "text"):
        raise _param(InvalidRequestError(f"stream=true gives text events; response_format {fmt!r} cannot be "
                                         "streamed"), "stream")
    return True


async def _drain(queue: asyncio.Queue, task: asyncio.Task):
    """Yield what the producing ``task`` puts on ``queue`` (from another thread, via the event loop) until the task
    has ended and the queue is empty: the one read loop of the streamed chat, completion and transcription
    routes."""
    done = asyncio.Event()
    task.add_done_callback(lambda _: done.set())
    while True:
        if not queue.empty():
            yield queue.get_nowait()
            continue
        getter = asyncio.create_task(queue.get())
        ender = asyncio.create_task(done.wait())
        await asyncio.wait({getter, ender}, return_when=asyncio.FIRST_COMPLETED)
        ender.cancel()
        if getter.done():
            yield getter.result()
        else:
            getter.cancel()
            if queue.empty():
                return


async def _transcription_events(task: asyncio.Task, queue: asyncio.Queue):
    """OpenAI's transcription stream: one ``transcript.text.delta`` per segment, sent as soon as the segment's
    window is decoded (``queue`` receives the hub's ``TranscriptSegment`` from the decoding thread; the deltas
    concatenate to the text), then ``transcript.text.done`` with the whole text. An error after the first byte
    (the status is sent) is an ``error`` event in OpenAI's body; a client that goes away cancels ``task``."""
    sent = 0
    try:
        async for seg in _drain(queue, task):
            text = seg.text.strip()
            if text:
                yield _sse({"type": "transcript.text.delta", "delta": (" " if sent else "") + text})
                sent += 1
        try:
            tr = task.result()
        except Exception as exc:  # noqa: BLE001  after the first byte the status is sent: an error event
            yield _sse(json.loads(exception_response(exc).body))
            return
        yield _sse({"type": "transcript.text.done", "text": tr.text})
    finally:
        if not task.done():
            task.cancel()


def _transcription_response(tr, fmt: str, grains: set[str]) -> Response:
    from specstream.stages.speech import format_timestamp

    segs = [s for s in tr.segments if s.text.strip()]
    if fmt == "json":
        return JSONResponse({"text": tr.text})
    if fmt == "text":
        return PlainTextResponse(tr.text + "\n")
    if fmt in ("srt", "vtt"):
        buf = io.StringIO()
        if fmt == "vtt":
            buf.write("WEBVTT\n\n")
        for n, s in enumerate(segs, 1):
            a = format_timestamp(s.start_s, "," if fmt == "srt" else ".")
            b = format_timestamp(s.end_s, "," if fmt == "srt" else ".")
            buf.write((f"{n}\n" if fmt == "srt" else "") + f"{a} --> {b}\n{s.text.strip()}\n\n")
        return PlainTextResponse(buf.getvalue(), media_type="text/vtt" if fmt == "vtt" else "application/x-subrip")
    body: dict[str, Any] = {"task": "transcribe", "language": tr.language, "duration": round(tr.duration_s, 3),
                            "text": tr.text}
    if "segment" in grains or not grains:
        body["segments"] = [{"id": i, "seek": 0, "start": round(s.start_s, 3), "end": round(s.end_s, 3),
                             "text": s.text.strip(), "tokens": [], "temperature": 0.0,
                             "avg_logprob": s.avg_logprob if s.avg_logprob is not None else 0.0,
                             "compression_ratio": 0.0,
                             "no_speech_prob": s.no_speech_prob if s.no_speech_prob is not None else 0.0}
                            for i, s in enumerate(segs)]
    if "word" in grains:
        body["words"] = [{"word": w.word, "start": round(w.start_s, 3), "end": round(w.end_s, 3)}
                         for s in segs for w in s.words]
    return JSONResponse(body)
