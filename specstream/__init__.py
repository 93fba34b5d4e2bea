"""specstream: multimodal streaming inference with token-tree speculative decoding.

The public API (README.md, "Python"), in the manner of faster-whisper:

- ``specstream.caption(sources, ...) -> Iterator[Caption]``
- ``specstream.transcribe(audio, ...) -> (Iterator[Segment], TranscriptionInfo)``
- ``specstream.answer(video, questions, ...) -> Iterator[Answer]``
- ``specstream.Engine(target, drafts, ...).generate(prompts, ...) -> list[Generation]``
- ``specstream.SamplingParams`` and the typed errors (``SpecstreamError`` and its subclasses, each with a stable
  ``code``).

Importing the package has no side effects and imports nothing heavy: every name loads on first use (PEP 562).
"""

from __future__ import annotations

__version__ = "0.1.0"

_API = ("Answer", "Caption", "CaptionError", "Engine", "Generation", "answer", "caption", "transcribe")
_SPEECH = ("Segment", "TranscriptionInfo")
_ERRORS = (
    "SpecstreamError", "InvalidRequestError", "ContextLengthError", "EmptyQuestionError", "UnsupportedDtypeError",
    "InvalidSchemaError", "CheckpointNotFoundError", "UnsupportedArchitectureError", "TokenizerMismatchError",
    "ModelFetchError", "NumericalError", "CapacityError", "MediaError", "UnreadableSourceError",
    "UnsupportedMediaError", "NoVideoStreamError", "CorruptMediaError", "MediaLimitError", "DecodeTimeoutError",
    "MissingDependencyError",
)
_MODULES = {**{n: "specstream.api" for n in _API}, **{n: "specstream.stages.speech" for n in _SPEECH},
            **{n: "specstream.errors" for n in _ERRORS}, "SamplingParams": "specstream.types"}

__all__ = ["__version__", *_API, *_SPEECH, "SamplingParams", *_ERRORS]


def __getattr__(name: str):
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'specstream' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
