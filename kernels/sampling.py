"""Logits warpers applied exactly as Hugging Face's generation warpers do: temperature, then top-k, then top-p.

Torch reference implementation; the order and tie rules follow ``TemperatureLogitsWarper``,
``TopKLogitsWarper`` and ``TopPLogitsWarper`` (transformers ``generation/logits_process.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specstream.errors import InvalidRequestError


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


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to ``logits`` ``[N, V]``; removed entries become ``-inf``."""
    scores = logits.float()
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - params.top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def target_probs(logits: torch.Tensor, params: SamplingParams, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Sampling distribution ``[N, V]`` after the warpers, in ``dtype`` (float64 by default; the engine's
    verification uses float32 on the device)."""
    return torch.softmax(warp_logits(logits, params).to(dtype), dim=-1)
