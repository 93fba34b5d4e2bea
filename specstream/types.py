"""Plain data shared by every layer: no tensors, no imports of ours but :mod:`specstream.errors`.

``Word`` is a transcribed word (the speech path, ModelHub, the OpenAI routes). ``SamplingParams`` is read by
the scheduler's step messages (``schedulers/plan.py``), by the engine and by the sampling kernels
(``kernels/sampling.py``); it lives here so that the scheduler, which never holds a tensor, does not import a
kernel module, and kernels import nothing of the layers above (docs/architecture.md, "Layers").
"""

from __future__ import annotations

from dataclasses import dataclass

from specstream.errors import InvalidRequestError

__all__ = ["SamplingParams", "Word"]


@dataclass(frozen=True)
class SamplingParams:
    """How a request chooses tokens.

    Attributes:
        mode: ``"greedy"`` (argmax of the raw logits) or ``"sample"``.
        temperature: > 0, divides the logits (sample mode).
        top_k: keep the k most likely tokens (0 = off); ties with the k-th logit are kept, as in HF.
        top_p: nucleus mass in (0, 1] (1 = off).
        seed: seed of the request's own random stream (batch invariance: no shared generator).
    """

    mode: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.mode not in ("greedy", "sample"):
            raise InvalidRequestError(f"mode must be 'greedy' or 'sample', got {self.mode!r}")
        if not self.temperature > 0:
            raise InvalidRequestError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.mode == "greedy"


@dataclass(frozen=True)
class Word:
    """A transcribed word: its times (seconds from the start of the audio) and the mean probability of its
    tokens. The one word type: the speech path makes it (``stages/whisper_timing.py``), ``ModelHub.transcribe``'s
    segments carry it as made, the OpenAI routes read it."""

    start_s: float
    end_s: float
    word: str
    probability: float
