"""Static, preallocated KV cache with one slot per request (gpt-fast / vLLM-style static cache).

Layout: ``k`` and ``v`` are ``[num_layers, num_slots, num_kv_heads, max_len + 1, head_dim]``. Column ``max_len``
is a scratch column: padded query rows of a ragged batch write there and nobody reads it. ``positions`` keeps,
per slot and cache column, the position id of the token stored there (used for sliding-window masks).

Invariant (KV commit): after each engine step, slot ``s`` holds exactly ``lengths[s]`` entries, contiguous from
column 0: the prompt and the committed tokens, nothing of rejected tree branches. Columns past the length are
stale and masked, and must stay finite, because a masked column's NaN would still poison attention
(0 x NaN = NaN): the executor zeroes the columns of rejected nodes whose logits were not finite
(:meth:`zero_columns`) and a failed request's whole slot (:meth:`clear`). A drafter's cache, whose output never
decides what is committed, replaces non-finite keys/values on write instead (``sanitize``).
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-slot key/value storage of one decoder.

    Args:
        num_layers, num_slots, num_kv_heads, max_len, head_dim: sizes (``max_len`` in tokens per slot).
        dtype, device: storage dtype and device.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, num_slots, num_kv_heads, max_len + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.zeros((num_slots, max_len + 1), dtype=torch.long, device=device)
        self.lengths = [0] * num_slots
        self.max_len = max_len
        self.num_slots = num_slots
        #: replace non-finite keys/values by finite ones on write (drafters' caches)
        self.sanitize = False
        #: slot -> the tokens whose keys/values the slot's first columns still hold after :meth:`reset`
        #: (:meth:`keep`, read by :meth:`reusable`)
        self.kept: dict[int, list[int]] = {}

    @property
    def scratch(self) -> int:
        """Cache column that padded rows write to."""
        return self.max_len

    @property
    def device(self) -> torch.device:
        return self.k.device

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def reset(self, slot: int) -> None:
        """Forget a slot's contents (the slot is freed or reused)."""
        self.lengths[slot] = 0

    def keep(self, slot: int, tokens: list[int] | None) -> None:
        """Record that the slot's first ``len(tokens)`` columns hold the keys/values of ``tokens`` at positions
        ``0, 1, ...`` (a freed slot keeps them: :meth:`reset` only sets the length), for its next occupant
        (:meth:`reusable`); None forgets the record."""
        if tokens:
            self.kept[slot] = tokens
        else:
            self.kept.pop(slot, None)

    def reusable(self, slot: int, tokens: list[int], limit: int, consume: bool = True) -> int:
        """How many leading ``tokens`` the slot holds by its record (:meth:`keep`): their common prefix with it,
        at most ``limit``; 0 without one. Prompt reuse per slot, as llama.cpp's server caches a slot's prompt.
        ``consume`` drops the record (the caller writes after that prefix)."""
        kept = self.kept.pop(slot, None) if consume else self.kept.get(slot)
        if not kept:
            return 0
        limit = min(limit, len(kept), len(tokens))
        n = 0
        while n < limit and kept[n] == tokens[n]:
            n += 1
        return n

    def clear(self, slot: int) -> None:
        """Zero a slot's keys and values (its request failed: nothing of it may reach the next request)."""
        self.k[:, slot].zero_()
        self.v[:, slot].zero_()
        self.lengths[slot] = 0
        self.kept.pop(slot, None)

    def zero_columns(self, slot: int, start: int, end: int) -> None:
        """Zero columns ``[start, end)`` of a slot (stale entries of rejected nodes whose logits were not finite)."""
        if end > start:
            self.k[:, slot, :, start:end].zero_()
            self.v[:, slot, :, start:end].zero_()

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make slot ``dst`` hold the first ``length`` columns of slot ``src`` (keys, values and positions of every
        layer; one device copy each) and set its length: a fork of a prefilled prompt (``n`` choices share one
        prefill). Columns of ``dst`` past ``length`` keep what they held (stale, masked, finite).

        Raises:
            ValueError: ``src == dst``, or ``length`` outside ``[0, max_len]``.
        """
        if src == dst or not 0 <= length <= self.max_len:
            raise ValueError(f"cannot copy {length} columns of slot {src} into slot {dst}")
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        self.positions[dst, :length] = self.positions[src, :length]
        self.lengths[dst] = length
        self.kept.pop(dst, None)

    def write(self, layer: int, slots: torch.Tensor, write_index: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store new keys/values (made finite first when :attr:`sanitize` is set).

        Args:
            slots: ``[B]`` slot of each batch row.
            write_index: ``[B, T]`` cache column of each new token.
            k, v: ``[B, num_kv_heads, T, head_dim]``.
        """
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.sanitize:
            k, v = torch.nan_to_num(k), torch.nan_to_num(v)
        self.k[layer][slots[:, None], :, write_index] = k
        self.v[layer][slots[:, None], :, write_index] = v

    @staticmethod
    def contiguous_range(slots: list[int]) -> int | None:
        """The first slot when ``slots`` is an increasing contiguous range (reads can then slice, not copy)."""
        first = slots[0]
        return first if slots == list(range(first, first + len(slots))) else None

    def read(self, layer: int, slots: torch.Tensor | slice | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of columns ``[0, length)`` for each row: two ``[B, num_kv_heads, length, head_dim]``.

        ``slots``: a ``slice`` of slots (a view, no copy), a ``[B]`` index tensor (a gather), or None for every
        slot in order."""
        if slots is None:
            slots = slice(None)
        return self.k[layer][slots, :, :length], self.v[layer][slots, :, :length]

    def compact(self, slot: int, base: int, src_columns: list[int]) -> None:
        """KV commit of one slot: move ``src_columns`` (absolute, increasing) to ``base, base+1, ...``."""
        self.compact_batch([slot], [base], [src_columns])

    def compact_batch(self, slots: list[int], bases: list[int], src_columns: list[list[int]]) -> None:
        """KV commit of many slots in one gather + scatter over every layer.

        Slot ``slots[i]`` keeps ``src_columns[i]`` (absolute columns, increasing), moved to ``bases[i], ...``;
        its length becomes ``bases[i] + len(src_columns[i])`` once the copies are done: a copy that raises leaves
        the lengths as they were, so no length ever covers columns that still hold tree nodes (a freed slot's
        length says which prompt prefix its next request may reuse).
        """
        src, dst, rows = [], [], []
        for slot, base, cols in zip(slots, bases, src_columns):
            n = len(cols)
            if n and cols != list(range(base, base + n)):
                rows.append(slot)
                src.append(list(cols))
                dst.append(list(range(base, base + n)))
        if rows:
            self._move(rows, src, dst)
        for slot, base, cols in zip(slots, bases, src_columns):
            self.lengths[slot] = base + len(cols)

    def _move(self, rows: list[int], src: list[list[int]], dst: list[list[int]]) -> None:
        """Copy columns ``src[i]`` to ``dst[i]`` of slot ``rows[i]`` (keys, values, positions), in one gather and
        scatter per tensor."""
        width = max(len(s) for s in src)
        scratch = self.scratch
        for s, d in zip(src, dst):  # pad with scratch -> scratch copies
            s.extend([scratch] * (width - len(s)))
            d.extend([scratch] * (width - len(d)))
        dev = self.k.device
        r = torch.tensor(rows, device=dev)[:, None]
        si, di = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        # advanced indices on dims 1 and 3 -> [n_rows, width, layers, heads, head_dim]
        self.k[:, r, :, di] = self.k[:, r, :, si]
        self.v[:, r, :, di] = self.v[:, r, :, si]
        self.positions[r, di] = self.positions[r, si]
