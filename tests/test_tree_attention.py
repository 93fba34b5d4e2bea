"""Row invariance of the canonical attention (kernels/tree_attention.py) and of the C++ row-invariant attention
(kernels/row_attention.py, ``impl="cpp"``): a query row gets the same bits whether its token is decoded alone or
verified inside a token tree, beside other rows and slots, over more key columns.

This is what greedy exactness at bfloat16 activations (int8/int4 weights) rests on; PyTorch's CPU
``scaled_dot_product_attention`` does not have it (the last test shows it on the same inputs)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from specstream.kernels import row_attention as cpp
from specstream.kernels.tree_attention import (
    CANONICAL_BLOCK,
    attention_bias,
    canonical_attention,
    canonical_plan,
    tree_mask,
)

D, HKV = 32, 2

#: the implementations under test: PyTorch ops everywhere, the C++ kernel where it builds (AVX-512)
IMPLS = ["torch", pytest.param("cpp", marks=pytest.mark.skipif(cpp.unavailable_reason() is not None,
                                                               reason=f"{cpp.unavailable_reason()}"))]


def _attend(impl, q, k, v, mask, cols, pos, tree_rows, t, key_pos=None):
    """``[B, Hq, T, D]`` float32 from either implementation (the C++ one orders keys by ``key_pos``: [B, S], by
    default each column's own index with the call's rows at ``cols`` holding ``pos``)."""
    if impl == "cpp":
        if key_pos is None:
            key_pos = torch.arange(k.shape[2]).repeat(k.shape[0], 1)
            key_pos.scatter_(1, cols, pos)
        return cpp.row_attention(q, k, v, mask, key_pos, D**-0.5).transpose(1, 2)
    plan = canonical_plan(mask, cols, pos, q.shape[1] // k.shape[1], tree_rows, t)
    return canonical_attention(q, k, v, plan, D**-0.5)


def _random_tree(rng: random.Random, size: int) -> list[int]:
    """Parents (topological: a parent precedes its children; -1 for the root)."""
    return [-1] + [rng.randrange(i) for i in range(1, size)]


def _depths(parents):
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def _ancestors(parents, j):
    out = [j]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]  # root first: depth order


class _Case:
    """B slots, each with a committed prefix of random keys/values and a random token tree after it."""

    def __init__(self, seed: int, groups: int, batch: int, max_nodes: int, max_prefix: int, impl: str = "torch"):
        self.impl = impl
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        self.groups = groups
        self.prefix = [rng.randrange(0, max_prefix) for _ in range(batch)]
        self.parents = [_random_tree(rng, rng.randrange(1, max_nodes + 1)) for _ in range(batch)]
        self.t = max(len(p) for p in self.parents)
        self.s = max(p + len(t) for p, t in zip(self.prefix, self.parents)) + rng.randrange(0, 90)
        self.k = torch.randn(batch, HKV, self.s, D, generator=g).bfloat16()
        self.v = torch.randn(batch, HKV, self.s, D, generator=g).bfloat16()
        self.q = torch.randn(batch, HKV * groups, self.t, D, generator=g).bfloat16()

    def tree_call(self, tree_rows=True):
        b = len(self.prefix)
        anc = torch.zeros(b, self.t, self.t, dtype=torch.bool)
        pos = torch.zeros(b, self.t, dtype=torch.long)
        cols = torch.zeros(b, self.t, dtype=torch.long)
        for i, (p, par) in enumerate(zip(self.prefix, self.parents)):
            for j in range(len(par)):
                anc[i, j, _ancestors(par, j)] = True
            pos[i, : len(par)] = p + torch.tensor(_depths(par))
            cols[i, : len(par)] = p + torch.arange(len(par))
        sizes = torch.tensor([len(par) for par in self.parents])
        mask = tree_mask(torch.tensor(self.prefix), anc, sizes, self.s)
        return _attend(self.impl, self.q, self.k, self.v, mask, cols, pos, list(range(b)) if tree_rows else None,
                       self.t), mask

    def alone(self, i: int, j: int, extra_keys: int = 0):
        """Node ``j`` of slot ``i`` decoded on its own: its ancestors' keys in position order after the prefix,
        one query row, the fewest key columns (plus ``extra_keys`` unwritten ones)."""
        p, par = self.prefix[i], self.parents[i]
        path = [p + a for a in _ancestors(par, j)]
        seq = list(range(p)) + path
        k, v = self.k[i:i + 1, :, seq], self.v[i:i + 1, :, seq]
        n = len(seq)
        if extra_keys:
            k = torch.cat([k, torch.randn(1, HKV, extra_keys, D).bfloat16()], 2)
            v = torch.cat([v, torch.randn(1, HKV, extra_keys, D).bfloat16()], 2)
        mask = torch.zeros(1, 1, n + extra_keys, dtype=torch.bool)
        mask[..., :n] = True
        at = torch.tensor([[n - 1]])
        return _attend(self.impl, self.q[i:i + 1, :, j:j + 1], k, v, mask, at, at, [0], 1)[0, :, 0]


CASES = [(seed, groups, batch, nodes, prefix) for seed, (groups, batch, nodes, prefix) in enumerate([
    (1, 1, 1, 5), (6, 1, 8, 40), (7, 3, 21, 200), (2, 4, 12, 130), (6, 2, 30, 64), (1, 2, 64, 10),
    (3, 5, 9, 300)])]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed,groups,batch,nodes,prefix", CASES)
def test_a_tree_row_equals_its_token_decoded_alone_bit_for_bit(seed, groups, batch, nodes, prefix, threads, impl):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        case = _Case(seed, groups, batch, nodes, prefix, impl)
        out, mask = case.tree_call()
        ref = F.scaled_dot_product_attention(case.q.float(), case.k.float(), case.v.float(),
                                             attn_mask=attention_bias(mask, torch.float32), scale=D**-0.5,
                                             enable_gqa=groups > 1)
        for i, par in enumerate(case.parents):
            # a correct attention (against PyTorch's, within float32 rounding) ...
            torch.testing.assert_close(out[i, :, : len(par)], ref[i, :, : len(par)], rtol=1e-5, atol=1e-5)
            for j in range(len(par)):
                # ... whose rows carry the same bits as decoding alone, with few or many key columns
                assert torch.equal(out[i, :, j], case.alone(i, j)), (i, j)
                if j == len(par) - 1:
                    assert torch.equal(out[i, :, j], case.alone(i, j, extra_keys=77)), (i, j)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("impl", IMPLS)
def test_chain_rows_in_place_equal_the_gathered_tail(impl):
    """A prefill chunk (rows in place, no tree rows) gives each row the bits of the gathered-tail path."""
    case = _Case(11, 6, 2, 1, 150, impl)
    case.parents = [list(range(-1, 36)), list(range(-1, 20))]  # chains
    case.t = 37
    case.q = torch.randn(2, HKV * 6, case.t, D).bfloat16()
    case.s = max(p + len(t) for p, t in zip(case.prefix, case.parents)) + 5
    case.k = torch.randn(2, HKV, case.s, D).bfloat16()
    case.v = torch.randn(2, HKV, case.s, D).bfloat16()
    in_place, _ = case.tree_call(tree_rows=False)
    gathered, _ = case.tree_call(tree_rows=True)
    for i, par in enumerate(case.parents):
        assert torch.equal(in_place[i, :, : len(par)], gathered[i, :, : len(par)])
        for j in (0, len(par) // 2, len(par) - 1):
            assert torch.equal(in_place[i, :, j], case.alone(i, j))


def test_pytorch_sdpa_is_not_row_invariant_on_the_same_inputs():
    """Why the canonical path exists: SDPA gives some tree row other bits than the same token decoded alone."""
    case = _Case(2, 6, 3, 21, 200)
    _, mask = case.tree_call()
    bias = attention_bias(mask, torch.float32)
    tree = F.scaled_dot_product_attention(case.q.float(), case.k.float(), case.v.float(), attn_mask=bias,
                                          scale=D**-0.5, enable_gqa=True)
    differs = 0
    for i, par in enumerate(case.parents):
        p = case.prefix[i]
        for j in range(len(par)):
            seq = list(range(p)) + [p + a for a in _ancestors(par, j)]
            alone = F.scaled_dot_product_attention(case.q[i:i + 1, :, j:j + 1].float(),
                                                   case.k[i:i + 1, :, seq].float(), case.v[i:i + 1, :, seq].float(),
                                                   scale=D**-0.5, enable_gqa=True)
            differs += int(not torch.equal(tree[i, :, j], alone[0, :, 0]))
    assert differs > 0
    assert CANONICAL_BLOCK == 64
