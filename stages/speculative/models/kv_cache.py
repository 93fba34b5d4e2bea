"""Static, preallocated KV cache with one slot per request (gpt-fast / vLLM-style static cache).

Layout: ``k`` and ``v`` are ``[num_layers, num_slots, num_kv_heads, max_len + 1, head_dim]``. Column ``max_len``
is a scratch column: padded query rows of a ragged batch write there and nobody reads it. ``positions`` keeps,
per slot and cache column, the position id of the token stored there (used for sliding-window masks).

Invariant (KV commit): after each engine step, slot ``s`` holds exactly ``lengths[s]`` entries, contiguous from
column 0: the prompt and the committed tokens, nothing of rejected tree branches.
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

    @property
    def scratch(self) -> int:
        """Cache column that padded rows write to."""
        return self.max_len

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def reset(self, slot: int) -> None:
        """Forget a slot's contents (the slot is freed or reused)."""
        self.lengths[slot] = 0

    def write(self, layer: int, slots: torch.Tensor, write_index: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store new keys/values.

        Args:
            slots: ``[B]`` slot of each batch row.
            write_index: ``[B, T]`` cache column of each new token.
            k, v: ``[B, num_kv_heads, T, head_dim]``.
        """
        self.k[layer][slots[:, None], :, write_index] = k.transpose(1, 2)
        self.v[layer][slots[:, None], :, write_index] = v.transpose(1, 2)

    def covers_all_slots(self, slots: torch.Tensor) -> bool:
        """True when ``slots`` is ``0, 1, ..., num_slots - 1``: :meth:`read` can then slice instead of gather.
        Decided once per forward (it synchronises with the device)."""
        return slots.numel() == self.num_slots and bool(
            (slots == torch.arange(self.num_slots, device=slots.device)).all())

    def read(self, layer: int, slots: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of columns ``[0, length)`` for each slot: two ``[B, num_kv_heads, length, head_dim]``.

        ``slots`` None means every slot in order (a view, no copy; see :meth:`covers_all_slots`)."""
        if slots is None:
            return self.k[layer][:, :, :length], self.v[layer][:, :, :length]
        return self.k[layer][slots, :, :length], self.v[layer][slots, :, :length]

    def compact(self, slot: int, base: int, src_columns: list[int]) -> None:
        """KV commit: move columns ``src_columns`` (absolute, increasing) to ``base, base+1, ...`` of ``slot``.

        Sets the slot's length to ``base + len(src_columns)``. Entries after it are stale and never read.
        """
        n = len(src_columns)
        if n and src_columns != list(range(base, base + n)):
            src = torch.tensor(src_columns, dtype=torch.long, device=self.k.device)
            dst = slice(base, base + n)
            self.k[:, slot, :, dst] = self.k[:, slot, :, src]
            self.v[:, slot, :, dst] = self.v[:, slot, :, src]
            self.positions[slot, dst] = self.positions[slot, src]
        self.lengths[slot] = base + n
