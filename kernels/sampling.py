"""Logits warpers applied exactly as Hugging Face's generation warpers do: temperature, then top-k, then top-p.

Torch reference implementation; the order and tie rules follow ``TemperatureLogitsWarper``,
``TopKLogitsWarper`` and ``TopPLogitsWarper`` (transformers ``generation/logits_process.py``).
"""

from __future__ import annotations

import torch

from specstream.types import SamplingParams

__all__ = ["target_probs", "warp_logits"]


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
