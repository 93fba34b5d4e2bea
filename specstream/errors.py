"""Typed errors of specstream. Every error carries a stable machine-readable ``code``.

The codes are part of the output contract: the CLI's error records, HTTP error bodies and Kafka error results
all use them.
"""

from __future__ import annotations


class SpecstreamError(Exception):
    """Base class. ``code`` is a stable snake_case identifier; ``retryable`` tells clients whether to retry."""

    code = "internal_error"
    retryable = False

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


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
