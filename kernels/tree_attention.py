"""Tree attention: every query row sees the committed prefix of its slot and its own ancestors in the token tree.

Torch reference implementation (SpecInfer §4.2, "tree-based parallel decoding"). The mask is built on the device
by :func:`tree_mask` from the ancestor matrix of the compiled trees, once per forward, and turned into one additive
bias (:func:`attention_bias`) that every layer shares: a boolean mask costs PyTorch's CPU attention a conversion
per call. Grouped-query heads go through ``scaled_dot_product_attention(enable_gqa=True)`` — keys and values are
never repeated per query head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def tree_mask(prefix: torch.Tensor, ancestors: torch.Tensor, num_nodes: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Boolean attention mask of a ragged batch of token trees appended after per-slot prefixes, on the device.

    Args:
        prefix: ``[B]`` committed cache length ``L_b`` of each row's slot; node ``k`` of row ``b`` sits in cache
            column ``L_b + k``.
        ancestors: ``[B, T, T]`` bool, ``[b, i, j]`` True when node ``j`` is ``i`` or an ancestor of ``i`` (a
            prefill row is a chain: lower-triangular).
        num_nodes: ``[B]`` nodes per row (``T_b <= T``); rows ``i >= T_b`` are padding.
        num_keys: ``S``, the cache columns attended (``>= max L_b + T_b``).

    Returns:
        ``[B, T, S]`` bool. Padded rows see column 0 only, so their softmax stays finite.
    """
    b, t, _ = ancestors.shape
    dev = ancestors.device
    cols = torch.arange(num_keys, device=dev)
    rel = cols[None, :] - prefix[:, None]  # [B, S]: tree node index of each column, < 0 inside the prefix
    in_tree = (rel >= 0) & (rel < num_nodes[:, None])
    gathered = torch.gather(ancestors, 2, rel.clamp(0, t - 1)[:, None, :].expand(b, t, num_keys))
    mask = (rel < 0)[:, None, :] | (gathered & in_tree[:, None, :])
    valid = torch.arange(t, device=dev)[None, :] < num_nodes[:, None]  # [B, T]
    mask &= valid[:, :, None]
    mask[:, :, 0] |= ~valid
    return mask


def build_tree_mask(prefix_lengths: torch.Tensor, ancestor_masks: list[torch.Tensor], num_keys: int,
                    num_queries: int) -> torch.Tensor:
    """:func:`tree_mask` for per-row ancestor masks of different sizes (tests and benchmarks).

    Args:
        prefix_lengths: ``[B]`` committed cache lengths.
        ancestor_masks: ``B`` bool tensors ``[T_b, T_b]``.
        num_keys: ``S``.
        num_queries: ``T >= max T_b``.

    Returns:
        ``[B, T, S]`` bool.
    """
    b = len(ancestor_masks)
    anc = torch.zeros((b, num_queries, num_queries), dtype=torch.bool)
    sizes = []
    for i, a in enumerate(ancestor_masks):
        a = torch.as_tensor(a, dtype=torch.bool)
        anc[i, : a.shape[0], : a.shape[0]] = a
        sizes.append(a.shape[0])
    return tree_mask(torch.as_tensor(prefix_lengths).long(), anc, torch.tensor(sizes), num_keys)


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive bias ``[B, 1, T, S]`` (0 where allowed, ``-inf`` elsewhere) from a bool mask ``[B, T, S]``."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return bias.masked_fill_(~mask, float("-inf"))[:, None]


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    return_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scaled dot-product attention with grouped-query heads and a tree mask.

    Args:
        q: ``[B, Hq, T, D]`` queries.
        k, v: ``[B, Hkv, S, D]`` keys/values (``Hq`` a multiple of ``Hkv``; never repeated per query head).
        mask: ``[B, T, S]`` bool (True where a query may attend a key; every row needs one True) or the additive
            bias ``[B, 1, T, S]`` of :func:`attention_bias`.
        scale: softmax scale (usually ``D ** -0.5``).
        return_probs: also return the attention probabilities ``[B, Hq, T, S]`` (float32), e.g. to export the
            target's attention on visual tokens.

    Returns:
        ``(out [B, Hq, T, D], probs or None)``.
    """
    if q.ndim != 4 or k.ndim != 4 or mask.ndim not in (3, 4):
        raise ValueError(f"bad shapes q={tuple(q.shape)} k={tuple(k.shape)} mask={tuple(mask.shape)}")
    bias = attention_bias(mask, q.dtype) if mask.dtype == torch.bool else mask
    groups = q.shape[1] // k.shape[1]
    if not return_probs:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=scale,
                                             enable_gqa=groups > 1)
        return out, None
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(b, hkv, groups, t, d)
    scores = torch.matmul(qg, k.float()[:, :, None].transpose(-1, -2)) * scale  # [B, Hkv, G, T, S]
    scores = scores + bias.float()[:, :, None]
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(v.dtype), v[:, :, None]).view(b, hq, t, d)
    return out, probs.view(b, hq, t, -1)
