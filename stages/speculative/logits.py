"""Per-request logits processors, applied to every verified logits row along that row's own token path.

A processor sees, for each logits row, the token sequence that precedes the token the row predicts: the prompt,
the committed output, and — for a token-tree node — the draft tokens on the path from the root to that node.
So a history-dependent rule (suppress at the first generated position, no-repeat n-grams, timestamp rules)
gives each tree node exactly the scores plain decoding would give at that point, and speculative output stays
identical to non-speculative output (invariant 1). The executor applies them after the target forward and
before greedy argmax or sampling (:meth:`SpeculativeExecutor._commit`).

Same contract as Hugging Face's ``LogitsProcessor`` (``__call__(input_ids, scores) -> scores``), with ragged
per-row histories instead of one ``[batch, seq]`` tensor.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch


class LogitsProcessor(abc.ABC):
    """Rewrites next-token scores given each row's history. Instances are per request and immutable."""

    @abc.abstractmethod
    def __call__(self, sequences: Sequence[Sequence[int]], scores: torch.Tensor) -> torch.Tensor:
        """Return processed ``scores`` ``[N, V]`` (float32; removed tokens ``-inf``; in-place edits allowed).

        Args:
            sequences: ``N`` token histories; ``sequences[i]`` precedes the token row ``i`` predicts.
            scores: ``[N, V]`` raw target logits.
        """


class SuppressTokens(LogitsProcessor):
    """Never emit ``token_ids`` (HF ``SuppressTokensLogitsProcessor``; CTranslate2 ``suppress_tokens``)."""

    def __init__(self, token_ids: Sequence[int]):
        self.token_ids = tuple(sorted({int(t) for t in token_ids}))

    def __call__(self, sequences, scores):
        ids = [t for t in self.token_ids if t < scores.shape[-1]]
        if ids:
            scores[:, ids] = float("-inf")
        return scores


class SuppressTokensAtBegin(LogitsProcessor):
    """Do not emit ``token_ids`` as the first generated token, i.e. at history length ``begin_index``
    (HF ``SuppressTokensAtBeginLogitsProcessor``; Whisper's ``suppress_blank``: no blank or EOT first)."""

    def __init__(self, token_ids: Sequence[int], begin_index: int):
        self.token_ids = tuple(sorted({int(t) for t in token_ids}))
        self.begin_index = int(begin_index)

    def __call__(self, sequences, scores):
        rows = [i for i, seq in enumerate(sequences) if len(seq) == self.begin_index]
        ids = [t for t in self.token_ids if t < scores.shape[-1]]
        if rows and ids:
            scores[torch.tensor(rows)[:, None], torch.tensor(ids)[None, :]] = float("-inf")
        return scores


class NoRepeatNGram(LogitsProcessor):
    """Forbid any n-gram of generated tokens from appearing twice (HF ``NoRepeatNGramLogitsProcessor``),
    counting from ``begin_index`` (the prompt is excluded, as CTranslate2's Whisper does)."""

    def __init__(self, n: int, begin_index: int = 0):
        if n < 1:
            raise ValueError("n must be >= 1")
        self.n, self.begin_index = int(n), int(begin_index)

    def __call__(self, sequences, scores):
        for i, seq in enumerate(sequences):
            gen = list(seq[self.begin_index:])
            if len(gen) + 1 < self.n:
                continue
            prefix = tuple(gen[len(gen) - self.n + 1:]) if self.n > 1 else ()
            banned = {gen[j + self.n - 1] for j in range(len(gen) - self.n + 1)
                      if tuple(gen[j:j + self.n - 1]) == prefix}
            banned = [t for t in banned if t < scores.shape[-1]]
            if banned:
                scores[i, banned] = float("-inf")
        return scores


def apply_logits_processors(processors: Sequence[LogitsProcessor], sequences: Sequence[Sequence[int]],
                            scores: torch.Tensor) -> torch.Tensor:
    """Apply ``processors`` in order to ``scores`` ``[N, V]`` (a float32 copy is processed)."""
    if len(sequences) != scores.shape[0]:
        raise ValueError(f"{len(sequences)} histories for {scores.shape[0]} logits rows")
    out = scores.float().clone()
    for proc in processors:
        out = proc(sequences, out)
    return out
