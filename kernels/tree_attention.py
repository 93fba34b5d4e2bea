"""Tree attention: every query row sees the committed prefix of its slot and its own ancestors in the token tree.

Torch reference implementation (SpecInfer §4.2, "tree-based parallel decoding"). The mask is built by the
caller (:func:`build_tree_mask`) so one kernel serves prefill chains, target verification and draft expansion.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def build_tree_mask(
    prefix_lengths: torch.Tensor,
    ancestor_masks: list[torch.Tensor],
    num_keys: int,
    num_queries: int,
) -> torch.Tensor:
    """Boolean attention mask for a ragged batch of trees appended after per-request prefixes.

    Args:
        prefix_lengths: ``[B]`` committed cache length ``L_b`` of each row's slot.
        ancestor_masks: ``B`` bool tensors ``[T_b, T_b]``; ``[i, j]`` is True when node ``j`` is ``i`` or an
            ancestor of ``i``. Node ``k`` of row ``b`` sits in cache column ``L_b + k``.
        num_keys: ``S``, the number of cache columns attended (>= max ``L_b + T_b``).
        num_queries: ``T``, the padded number of query rows (>= max ``T_b``).

    Returns:
        ``[B, T, S]`` bool. Padded rows (``i >= T_b``) see column 0 only, so their softmax is finite.
    """
    batch = len(ancestor_masks)
    mask = np.zeros((batch, num_queries, num_keys), dtype=bool)
    prefix = [int(x) for x in prefix_lengths]
    for b, anc in enumerate(ancestor_masks):
        length = prefix[b]
        t_b = anc.shape[0]
        mask[b, :t_b, :length] = True
        mask[b, :t_b, length : length + t_b] = anc.numpy() if isinstance(anc, torch.Tensor) else anc
        mask[b, t_b:, 0] = True
    return torch.from_numpy(mask)


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    return_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled dot-product attention with grouped-query heads and a boolean tree mask.

    Args:
        q: ``[B, Hq, T, D]`` queries.
        k, v: ``[B, Hkv, S, D]`` keys/values (``Hq`` a multiple of ``Hkv``).
        mask: ``[B, T, S]`` bool, True where a query may attend a key. Every row needs one True.
        scale: softmax scale (usually ``D ** -0.5``).
        return_probs: also return the attention probabilities ``[B, Hq, T, S]`` (float32), e.g. to export the
            target's attention on visual tokens.

    Returns:
        ``(out [B, Hq, T, D], probs or None)``.
    """
    if q.ndim != 4 or k.ndim != 4 or mask.ndim != 3:
        raise ValueError(f"bad shapes q={tuple(q.shape)} k={tuple(k.shape)} mask={tuple(mask.shape)}")
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if not return_probs:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
        return out, None
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(v.dtype), v)
    return out, probs
