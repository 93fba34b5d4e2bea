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


class History(Sequence):
    """A token history without a copy: ``prompt + output + path`` (``path``: the draft tokens root -> node) read
    in place, cut to ``[start, stop)``.

    The executor hands one per logits row to the processors instead of ``context + path`` lists, so the host
    work per step does not grow with the context: building one is O(1), ``len``/``[i]``/``[-1]`` are O(1), a
    slice with step 1 is another view (O(1)); only iterating or ``list()`` walks the tokens, and a processor
    reads what its rule needs (Whisper's rules: the generated part from ``begin_index``). Measured on the tiny
    models (tests/test_engine_hostwork.py): the host allocations of a step with a processor are the same at
    context 64 and 2048, where ``context + path`` per node copied 16 KiB of pointers per node at 2048.

    The lists are read, never changed; a view is valid for the step it was made in (the owner appends to
    ``output`` only between steps).
    """

    __slots__ = ("_parts", "_start", "_stop")

    def __init__(self, *parts: Sequence[int], start: int = 0, stop: int | None = None):
        self._parts = parts
        total = sum(len(p) for p in parts)
        self._start = start
        self._stop = total if stop is None else min(stop, total)

    def __len__(self) -> int:
        return max(0, self._stop - self._start)

    def _at(self, k: int) -> int:
        for p in self._parts:
            if k < len(p):
                return p[k]
            k -= len(p)
        raise IndexError("history index out of range")

    def __getitem__(self, index):
        n = len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return History(*self._parts, start=self._start + start, stop=self._start + max(start, stop))
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("history index out of range")
        return self._at(self._start + index)

    def __iter__(self):
        k = 0
        for p in self._parts:
            lo, hi = max(self._start - k, 0), min(self._stop - k, len(p))
            for i in range(lo, hi):
                yield p[i]
            k += len(p)

    def segments(self) -> list[tuple[Sequence[int], int, int]]:
        """The view as ``(part, lo, hi)`` pieces in order (``part[lo:hi]``, none empty), no copy: a reader that
        scans the tokens can walk the parts themselves, or remember what it found in a part that several views
        share (every node of one request's tree shares its prompt and output lists)."""
        out, k = [], 0
        for p in self._parts:
            lo, hi = max(self._start - k, 0), min(self._stop - k, len(p))
            if lo < hi:
                out.append((p, lo, hi))
            k += len(p)
        return out

    def __reversed__(self):
        for i in range(len(self) - 1, -1, -1):
            yield self[i]

    def __eq__(self, other) -> bool:
        if isinstance(other, (History, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"History(len={len(self)})"


class LogitsProcessor(abc.ABC):
    """Rewrites next-token scores given each row's history. Instances are per request and immutable."""

    @abc.abstractmethod
    def __call__(self, sequences: Sequence[Sequence[int]], scores: torch.Tensor) -> torch.Tensor:
        """Return processed ``scores`` ``[N, V]`` (float32; removed tokens ``-inf``; in-place edits allowed).

        Args:
            sequences: ``N`` token histories; ``sequences[i]`` precedes the token row ``i`` predicts.
            scores: ``[N, V]`` raw target logits.
        """

    @classmethod
    def apply_rows(cls, processors: Sequence["LogitsProcessor"], sequences: Sequence[Sequence[int]],
                   scores: torch.Tensor) -> torch.Tensor:
        """Apply ``processors[i]`` (all instances of this class, e.g. one per request) to row ``i`` of ``scores``
        ``[N, V]``: the rows of several requests' token trees at once.

        The default calls each distinct processor once on its rows; subclasses whose rule is a function of
        per-row parameters override it with one batched tensor operation for all rows."""
        if len(processors) != scores.shape[0]:
            raise ValueError(f"{len(processors)} processors for {scores.shape[0]} logits rows")
        groups: dict[int, tuple[LogitsProcessor, list[int]]] = {}
        for i, p in enumerate(processors):
            groups.setdefault(id(p), (p, []))[1].append(i)
        if len(groups) == 1:
            return processors[0](sequences, scores)
        for proc, rows in groups.values():
            idx = torch.tensor(rows, device=scores.device)
            scores[idx] = proc([sequences[i] for i in rows], scores[idx])
        return scores


class SuppressTokens(LogitsProcessor):
    """Never emit ``token_ids`` (HF ``SuppressTokensLogitsProcessor``; CTranslate2 ``suppress_tokens``)."""

    def __init__(self, token_ids: Sequence[int]):
        self.token_ids = tuple(sorted({int(t) for t in token_ids}))

    def __call__(self, sequences, scores):
        ids = [t for t in self.token_ids if t < scores.shape[-1]]
        if ids:
            scores[:, ids] = float("-inf")
        return scores

    @classmethod
    def apply_rows(cls, processors, sequences, scores):
        if len({p.token_ids for p in processors}) == 1:  # the same tokens for every row: one write
            return processors[0](sequences, scores)
        return super().apply_rows(processors, sequences, scores)


class SuppressTokensAtBegin(LogitsProcessor):
    """Do not emit ``token_ids`` as the first generated token, i.e. at history length ``begin_index``
    (HF ``SuppressTokensAtBeginLogitsProcessor``; Whisper's ``suppress_blank``: no blank or EOT first)."""

    def __init__(self, token_ids: Sequence[int], begin_index: int):
        self.token_ids = tuple(sorted({int(t) for t in token_ids}))
        self.begin_index = int(begin_index)

    def __call__(self, sequences, scores):
        return self.apply_rows([self] * len(sequences), sequences, scores)

    @classmethod
    def apply_rows(cls, processors, sequences, scores):
        if len({p.token_ids for p in processors}) != 1:
            return super().apply_rows(processors, sequences, scores)
        rows = [i for i, (p, seq) in enumerate(zip(processors, sequences)) if len(seq) == p.begin_index]
        ids = [t for t in processors[0].token_ids if t < scores.shape[-1]]
        if rows and ids:
            dev = scores.device
            scores[torch.tensor(rows, device=dev)[:, None], torch.tensor(ids, device=dev)[None, :]] = float("-inf")
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


class LogitBias(LogitsProcessor):
    """Add ``bias[token]`` to that token's score at every position (OpenAI's ``logit_bias``: values in
    [-100, 100]; -100 bans the token, 100 all but forces it). A function of the row alone, so it changes the
    target's distribution the same way with or without speculation (invariants 1 and 2 hold for the biased
    target).

    Args:
        bias: ``(token id, bias)`` pairs; ids at or past the vocabulary are ignored.
    """

    def __init__(self, bias: Sequence[tuple[int, float]]):
        self.bias = tuple(sorted((int(t), float(v)) for t, v in bias))

    def __call__(self, sequences, scores):
        return self.apply_rows([self] * scores.shape[0], sequences, scores)

    @classmethod
    def apply_rows(cls, processors, sequences, scores):
        """One ``[N, V]`` addition for all rows: the per-row biases are built as a dense ``[P, V]`` table of the
        distinct processors and gathered by row."""
        distinct: dict[tuple, int] = {}
        row_of = [distinct.setdefault(p.bias, len(distinct)) for p in processors]
        v = scores.shape[-1]
        table = torch.zeros((len(distinct), v), dtype=scores.dtype)
        for k, bias in enumerate(distinct):
            ids = [t for t, _ in bias if 0 <= t < v]
            if ids:
                table[k, ids] = torch.tensor([b for t, b in bias if 0 <= t < v], dtype=scores.dtype)
        table = table.to(scores.device)
        if len(distinct) == 1:
            scores += table
        else:
            scores += table[torch.tensor(row_of, device=scores.device)]
        return scores


class MinP(LogitsProcessor):
    """Min-p sampling (Nguyen et al., "Turning Up the Heat: Min-p Sampling for Creative and Coherent LLM Outputs",
    2024; vLLM's and llama.cpp's ``min_p``): remove every token whose probability at the request's temperature is
    below ``min_p`` times the most likely token's. Computed on the scores without a softmax:
    ``p_i < min_p * p_max`` at temperature ``T`` is ``s_i < s_max + T * log(min_p)``. With ``T = 0`` (greedy) the
    argmax is kept and the filter changes nothing that greedy decoding commits (logprobs are then over the kept
    tokens). One ``[N, V]`` comparison for all rows; no host sync.

    Args:
        min_p: in [0, 1]; 0 disables.
        temperature: the request's sampling temperature (0: greedy).
    """

    def __init__(self, min_p: float, temperature: float):
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        self.min_p = float(min_p)
        self.temperature = float(temperature)

    def __call__(self, sequences, scores):
        return self.apply_rows([self] * scores.shape[0], sequences, scores)

    @classmethod
    def apply_rows(cls, processors, sequences, scores):
        import math

        # [N, 1] log-threshold per row (a greedy row keeps the filter at its own temperature 1: see docstring)
        margin = [(p.temperature if p.temperature > 0 else 1.0) * (math.log(p.min_p) if p.min_p > 0 else -math.inf)
                  for p in processors]
        m = torch.tensor(margin, dtype=scores.dtype, device=scores.device)[:, None]
        top = scores.max(-1, keepdim=True).values
        return scores.masked_fill(scores < top + m, float("-inf"))


def apply_logits_processors(processors: Sequence[LogitsProcessor], sequences: Sequence[Sequence[int]],
                            scores: torch.Tensor) -> torch.Tensor:
    """Apply ``processors`` in order to ``scores`` ``[N, V]`` (a float32 copy is processed)."""
    if len(sequences) != scores.shape[0]:
        raise ValueError(f"{len(sequences)} histories for {scores.shape[0]} logits rows")
    out = scores.float().clone()
    for proc in processors:
        out = proc(sequences, out)
    return out


def apply_logits_processors_rows(per_row: Sequence[Sequence[LogitsProcessor]], sequences: Sequence[Sequence[int]],
                                 scores: torch.Tensor) -> torch.Tensor:
    """Apply each row's own processors, in their order, to ``scores`` ``[N, V]`` (a float32 copy is processed).

    The rows of a whole step (every tree node of every request) go through at once: rows whose processors have
    the same classes in the same order form one group, and each processor position of a group is one
    :meth:`LogitsProcessor.apply_rows` call over all its rows, so the cost does not grow with the number of
    requests or nodes in Python tensor writes (Whisper's rules are a few masks of the whole ``[N, V]`` block).

    Args:
        per_row: ``N`` processor tuples; ``per_row[i]`` applies to row ``i`` (empty: the row is left as is).
        sequences: ``N`` histories; ``sequences[i]`` precedes the token row ``i`` predicts.

    Raises:
        ValueError: the three lengths disagree.
    """
    if not len(per_row) == len(sequences) == scores.shape[0]:
        raise ValueError(f"{len(per_row)} processor lists and {len(sequences)} histories for {scores.shape[0]} "
                         f"logits rows")
    out = scores.float().clone()
    groups: dict[tuple[type, ...], list[int]] = {}
    for i, procs in enumerate(per_row):
        if procs:
            groups.setdefault(tuple(type(p) for p in procs), []).append(i)
    for classes, rows in groups.items():
        whole = len(rows) == out.shape[0]
        idx = None if whole else torch.tensor(rows, device=out.device)
        sub = out if whole else out[idx]
        seqs = sequences if whole else [sequences[i] for i in rows]
        for k, cls in enumerate(classes):
            sub = cls.apply_rows([per_row[i][k] for i in rows], seqs, sub)
        if whole:
            out = sub  # a processor may return a new tensor rather than edit in place
        else:
            out[idx] = sub
    return out
