"""Tree attention: every query row sees the committed prefix of its slot and its own ancestors in the token tree.

Torch reference implementation (SpecInfer §4.2, "tree-based parallel decoding"). The mask is built on the device
by :func:`tree_mask` from the ancestor matrix of the compiled trees, once per forward, and turned into one additive
bias (:func:`attention_bias`) that every layer shares: a boolean mask costs PyTorch's CPU attention a conversion
per call. Grouped-query heads go through ``scaled_dot_product_attention(enable_gqa=True)`` — keys and values are
never repeated per query head.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# -- row-invariant ("canonical") attention -----------------------------------------------------------------------
#: keys per canonical block (positions ``[j * 64, (j + 1) * 64)`` of a row's own sequence form block ``j``)
CANONICAL_BLOCK = 64
#: query rows of every block product are padded to a multiple of this (MKL's float32 GEMM gives a row other bits
#: at 1-3 rows than at 8 or more, and at 5-7 rows with 2 threads; any multiple of 8 gives the same bits)
ROW_TILE = 8


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class CanonicalPlan:
    """Per-forward layout of :func:`canonical_attention`, shared by every layer (built by :func:`canonical_plan`).

    Attributes:
        block: ``Kb``, keys per block.
        groups: ``G``, query heads per key/value head.
        num_blocks: ``nb``, blocks over the cache columns read (``nb * Kb >= S``).
        shared_bias: ``[B, 1, Mp, nb * Kb]`` float32 additive bias of the blocks read in place from the cache, rows
            ``(g, t)`` flattened and padded to ``Mp`` (a multiple of :data:`ROW_TILE`).
        tree_rows: ``[Bt]`` batch rows whose tree nodes are not in position order in the cache (None: none).
        tree_width: ``Tt`` query rows of those rows that hold nodes.
        tail_blocks: ``nt`` blocks of each tree row's tail.
        tail_index: ``[Bt, 1, Tt * nt * Kb, 1]`` cache column of each position of each tree row's tail.
        tail_bias: ``[Bt, 1, Tt, nt, 1, Kb]`` float32 additive bias of the tail.
        tail_first: ``[Bt]`` position block of each tree row's first tail block (``L // Kb``).
    """

    block: int
    groups: int
    num_blocks: int
    shared_bias: torch.Tensor
    tree_rows: torch.Tensor | None = None
    tree_width: int = 0
    tail_blocks: int = 0
    tail_index: torch.Tensor | None = None
    tail_bias: torch.Tensor | None = None
    tail_first: torch.Tensor | None = None


def canonical_plan(mask: torch.Tensor, write_index: torch.Tensor, position_ids: torch.Tensor, groups: int,
                   tree_rows: list[int] | None = None, tree_width: int = 0,
                   block: int = CANONICAL_BLOCK) -> CanonicalPlan:
    """The block layout of :func:`canonical_attention` for one forward, on the device, without a host sync.

    A query row at position ``p`` attends positions ``0..p`` of its own sequence. They are cut into blocks at fixed
    positions (``[j * Kb, (j + 1) * Kb)``), whatever the call. Committed positions sit in cache column = position,
    so a row whose whole sequence is in place (prefill chunks, chains, single-row decoding) reads every block
    straight from the cache. A token-tree row is not: its ancestors sit at the columns of their tree nodes,
    interleaved with siblings. For those rows (``tree_rows``) the blocks from the one holding the committed length
    ``L`` on (the *tail*) are gathered per row into position order, so a row's tail block holds the same keys at
    the same offsets as when the same tokens are decoded one at a time.

    Args:
        mask: ``[B, T, S]`` bool over cache columns (:func:`tree_mask`, or a sliding-window refinement of it).
        write_index: ``[B, T]`` cache column of each row; column 0's (the root's, or a chunk's first) is the
            committed length ``L_b`` of a tree row.
        position_ids: ``[B, T]`` position of each row (``L_b`` + depth for tree nodes).
        groups: query heads per key/value head.
        tree_rows: host list of the batch rows holding token trees (the executor's decode rows); None or empty
            when every row's keys are in place.
        tree_width: query rows of those rows that hold nodes (``<= T``).
        block: ``Kb``.

    Returns:
        The plan.
    """
    b, t, s = mask.shape
    dev = mask.device
    nb = -(-s // block)
    m = groups * t
    mp = _ceil_to(m, ROW_TILE)
    cols = torch.arange(nb * block, device=dev)
    allowed = torch.zeros((b, t, nb * block), dtype=torch.bool, device=dev)
    allowed[:, :, :s] = mask
    plan_rows = None
    if tree_rows:
        plan_rows = torch.tensor(tree_rows, dtype=torch.long, device=dev)
        root = write_index.index_select(0, plan_rows)[:, 0]  # [Bt] committed length L of each tree row
        base = root.div(block, rounding_mode="floor") * block  # [Bt] first position of its tail
        allowed[plan_rows] &= (cols[None, None, :] < base[:, None, None])  # the tail is gathered, not read here
    rows = allowed[:, None].expand(b, groups, t, nb * block).reshape(b, m, nb * block)
    rows = torch.cat([rows, rows.new_zeros((b, mp - m, nb * block))], 1) if mp > m else rows
    shared = torch.zeros(rows.shape, dtype=torch.float32, device=dev).masked_fill_(~rows, float("-inf"))
    shared = shared[:, None]
    plan = CanonicalPlan(block, groups, nb, shared)
    if plan_rows is None:
        return plan
    bt, tw = len(tree_rows), tree_width
    nt = -(-(block - 1 + tw) // block)
    w = nt * block
    ar_b = torch.arange(block, device=dev)
    ar_t = torch.arange(tw, device=dev)
    # candidates: the tail block's committed columns (position = column), then the call's nodes (position from
    # position_ids); each visible one lands at offset position - base of the row's tail
    cand_col = torch.cat([base[:, None] + ar_b[None], root[:, None] + ar_t[None]], 1)  # [Bt, Kb + Tt]
    cand_off = torch.cat([ar_b[None].expand(bt, block), position_ids.index_select(0, plan_rows)[:, :tw]
                          - base[:, None]], 1)
    in_prefix = torch.cat([base[:, None] + ar_b[None] < root[:, None],
                           torch.ones((bt, tw), dtype=torch.bool, device=dev)], 1)
    ok_col = in_prefix & (cand_col < s) & (cand_off >= 0) & (cand_off < w)
    seen = torch.gather(mask.index_select(0, plan_rows)[:, :tw], 2,
                        cand_col.clamp(0, s - 1)[:, None, :].expand(bt, tw, block + tw))
    vis = seen & ok_col[:, None, :]  # [Bt, Tt, Kb + Tt]
    off = torch.where(vis, cand_off[:, None, :].expand(bt, tw, block + tw), torch.full_like(seen, w, dtype=torch.long))
    index = torch.zeros((bt, tw, w + 1), dtype=torch.long, device=dev)
    index.scatter_(2, off, torch.where(vis, cand_col[:, None, :], 0).expand(bt, tw, block + tw))
    ok = torch.zeros((bt, tw, w + 1), dtype=torch.bool, device=dev).scatter_(2, off, vis)
    index, ok = index[:, :, :w], ok[:, :, :w]
    index = torch.where(ok, index, 0)
    tail_bias = torch.zeros(ok.shape, dtype=torch.float32, device=dev).masked_fill_(~ok, float("-inf"))
    plan.tree_rows, plan.tree_width, plan.tail_blocks = plan_rows, tw, nt
    plan.tail_index = index.reshape(bt, 1, tw * w, 1)
    plan.tail_bias = tail_bias.view(bt, 1, tw, nt, 1, block)
    plan.tail_first = base.div(block, rounding_mode="floor")
    return plan


def _block_softmax(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: its max ``[..., 1]`` (-inf for a block with no visible key) and ``exp(scores - max) @ values``
    ``[..., D + 1]`` (the values' last column is ones: it yields the softmax denominator from the same GEMM)."""
    top = scores.amax(-1, keepdim=True)
    e = torch.exp(scores - top.masked_fill(top == float("-inf"), 0.0))
    return top, torch.matmul(e, values)


def _fold_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 by folding halves (``x[:n/2] + x[n/2:]``) over the next power of two, zeros appended: the
    leading elements meet in the same additions whatever the length when the elements beyond them are 0 (a fold
    of a zero-padded half adds exactly 0 to each element of the other)."""
    n = x.shape[0]
    width = 1 << max(0, (n - 1).bit_length())
    if width > n:
        x = torch.cat([x, x.new_zeros((width - n, *x.shape[1:]))])
    while x.shape[0] > 1:
        h = x.shape[0] // 2
        x = x[:h] + x[h:]
    return x[0]


def canonical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CanonicalPlan,
                        scale: float) -> torch.Tensor:
    """Attention whose result for a query row is bit-identical however the row is batched.

    A row's output does not depend on the other rows of the call, on how many key columns the call reads, or on
    whether its token sits in a token tree or is decoded alone. That is what makes greedy speculative decoding
    equal plain decoding token for token when activations are bfloat16 (int8/int4/bf16 weights): PyTorch's
    ``scaled_dot_product_attention`` gives a row other last bits by row count and key length, and bf16 rounding
    of later layers turns those into other near-tied tokens. The idea is the fixed split size of batch-invariant
    kernels (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025): the keys of a row's own
    sequence are cut into blocks at fixed positions (:func:`canonical_plan`); each block's scores and
    ``exp(scores - max) @ V`` are float32 GEMMs of one fixed shape (``Kb`` keys, query rows padded to a multiple of
    :data:`ROW_TILE`), its denominator from the same GEMM (a ones column), and the blocks are combined by a
    pairwise sum over block positions (:func:`_fold_sum`), where a block without visible keys adds exactly zero.
    ``tests/test_tree_attention.py`` checks the invariance bit for bit over batch sizes, tree shapes, key lengths
    and thread counts.

    Args:
        q: ``[B, Hq, T, D]`` queries (any float dtype; computed in float32).
        k, v: ``[B, Hkv, S, D]`` the cache columns ``[0, S)`` of each row's slot.
        plan: the forward's :class:`CanonicalPlan` (``groups == Hq // Hkv``).
        scale: softmax scale.

    Returns:
        ``[B, Hq, T, D]`` float32. Padded query rows come out as zeros.
    """
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g, kb, nb = plan.groups, plan.block, plan.num_blocks
    if hq != g * hkv:
        raise ValueError(f"{hq} query heads do not make {g} groups of {hkv} key/value heads")
    sp = nb * kb
    dev = q.device
    nt = plan.tail_blocks
    nblk = nb + nt
    nbp = 1 << max(0, (nblk - 1).bit_length())
    keys = torch.zeros((b, hkv, sp, d), dtype=torch.float32, device=dev)
    keys[:, :, :s] = k
    # values block-major, [nb, B, Hkv, Kb, D + 1], the last column ones (the softmax denominator)
    values = torch.zeros((nb, b, hkv, kb, d + 1), dtype=torch.float32, device=dev)
    values[..., d] = 1.0
    by_row = values.permute(1, 2, 0, 3, 4)  # [B, Hkv, nb, Kb, D + 1] view
    full = s // kb
    by_row[:, :, :full, :, :d] = v[:, :, : full * kb].reshape(b, hkv, full, kb, d)
    if s > full * kb:
        by_row[:, :, full, : s - full * kb, :d] = v[:, :, full * kb:]
    m = g * t
    mp = _ceil_to(m, ROW_TILE)
    qf = q.float().reshape(b, hkv, m, d)
    if mp > m:
        qf = torch.cat([qf, qf.new_zeros((b, hkv, mp - m, d))], 2)
    raw = torch.matmul(qf, keys.transpose(-1, -2))  # [B, Hkv, Mp, Sp]: every key column's score
    scored = (raw * scale + plan.shared_bias).view(b, hkv, mp, nb, kb)
    block_top = scored.amax(-1, keepdim=True)  # [B, Hkv, Mp, nb, 1]
    e = torch.empty((nb, b, hkv, mp, kb), dtype=torch.float32, device=dev)
    torch.exp(scored - block_top.masked_fill(block_top == float("-inf"), 0.0), out=e.permute(1, 2, 3, 0, 4))
    # blocks in position order (block j = positions [j Kb, (j + 1) Kb)), then empty ones up to a power of two
    num = torch.empty((nbp, b, hkv, mp, d + 1), dtype=torch.float32, device=dev)
    torch.matmul(e, values, out=num[:nb])  # one fixed-shape GEMM per block
    num[nb:] = 0.0
    top = torch.full((nbp, b, hkv, mp, 1), float("-inf"), device=dev)
    top[:nb] = block_top.permute(3, 0, 1, 2, 4)
    if plan.tree_rows is not None:
        rows, tw = plan.tree_rows, plan.tree_width
        bt, w = rows.shape[0], nt * kb
        index = plan.tail_index.view(bt, 1, 1, tw, w)  # cache column of each tail position of each tree row
        # the tail's scores are the same GEMM's elements, picked per row into position order
        rs = raw if bt == b else raw.index_select(0, rows)
        rs = rs[:, :, :m].reshape(bt, hkv, g, t, sp)[:, :, :, :tw]
        st = torch.gather(rs, 4, index.expand(bt, hkv, g, tw, w)).view(bt, hkv, g, tw, nt, kb)
        st = st.permute(0, 1, 3, 4, 2, 5) * scale + plan.tail_bias  # [Bt, Hkv, Tt, nt, G, Kb]
        gp = _ceil_to(g, ROW_TILE)
        if gp > g:
            st = torch.cat([st, st.new_zeros((bt, hkv, tw, nt, gp - g, kb))], 4)
        # the tail's values gathered per row into position order (whole rows of the block-major buffer)
        col = index.view(bt, 1, tw * w)
        flat = (((col // kb) * b + rows[:, None, None]) * hkv + torch.arange(hkv, device=dev)[None, :, None]) * kb
        flat = flat + col % kb
        tv = values.view(-1, d + 1).index_select(0, flat.reshape(-1)).view(bt, hkv, tw, nt, kb, d + 1)
        tt, ta = _block_softmax(st, tv)  # [Bt, Hkv, Tt, nt, Gp, *]
        # into the tree rows' blocks L // Kb + j, query rows g * T + t: index dims first, then Hkv and the last
        slot = (plan.tail_first[:, None] + torch.arange(nt, device=dev)[None])[:, :, None, None]
        mrow = (torch.arange(g, device=dev)[:, None] * t + torch.arange(tw, device=dev)[None])[None, None]
        at = (slot, rows[:, None, None, None], slice(None), mrow)
        top[at] = tt[:, :, :, :, :g].permute(0, 3, 4, 2, 1, 5)
        num[at] = ta[:, :, :, :, :g].permute(0, 3, 4, 2, 1, 5)
    best = top.amax(0)
    weight = torch.exp(top - best.masked_fill(best == float("-inf"), 0.0))  # 0 for blocks without visible keys
    total = _fold_sum(weight * num)[:, :, :m]  # [B, Hkv, M, D + 1]
    out = total[..., :d] / total[..., d:].clamp_min(1e-30)
    return out.reshape(b, hq, t, d)
