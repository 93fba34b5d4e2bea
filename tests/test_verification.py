"""Batched verification on the device with chosen distributions and uniforms: outcomes worked out by hand."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specstream.kernels.sampling import target_probs, warp_logits
from specstream.types import SamplingParams
from specstream.kernels.verification import path_from_last, verify_greedy_batch, verify_stochastic_batch
from specstream.stages.speculative.tree import Proposal, ProposalKind, TokenTree, ancestor_matrix, compile_trees


def det(tree, parent, tok):
    return tree.add(parent, tok, Proposal(ProposalKind.DETERMINISTIC, "t"))


def samp(tree, parent, tok, q):
    return tree.add(parent, tok, Proposal(ProposalKind.SAMPLED, "d", q))


def run(probs, trees, uniforms):
    """The device kernel on a batch: ``probs`` ``[B, T, V]``, ``uniforms`` per tree (one per draw, then the
    bonus's). Returns per tree (accepted tokens, bonus)."""
    ct = compile_trees(trees, "cpu", vocab_size=probs.shape[-1])
    width = max(len(u) for u in uniforms)
    u = torch.tensor([list(x) + [0.0] * (width - len(x)) for x in uniforms], dtype=torch.float64)
    out = verify_stochastic_batch(probs[:, : ct.width], ct, u)
    anc = ancestor_matrix(ct.parents, ct.max_depth)
    path = path_from_last(out.last, anc, ct.depths, ct.max_depth).tolist()
    res = []
    for tree, p, bonus in zip(trees, path, out.bonus.tolist()):
        nodes = [n for n in p if n >= 0]
        res.append((tuple(tree.tokens[n] for n in nodes[1:]), bonus))
    return res


def run_one(probs, tree, uniforms):
    return run(probs[None], [tree], [uniforms])[0]


def test_greedy_accepts_longest_matching_path_plus_bonus():
    tree = TokenTree(1)
    a = det(tree, 0, 5)      # node 1
    det(tree, 0, 6)          # node 2
    b = det(tree, a, 7)      # node 3
    det(tree, b, 8)          # node 4
    ct = compile_trees([tree, tree], "cpu")
    anc = ancestor_matrix(ct.parents, ct.max_depth)
    # target argmax per node: root->5, node1->7, node2->x, node3->9 (draft said 8): accept 5,7 then bonus 9
    argmax = torch.tensor([[5, 7, 0, 9, 3], [4, 7, 0, 9, 3]])
    out = verify_greedy_batch(argmax, ct, anc)
    assert out.last.tolist() == [3, 0] and out.bonus.tolist() == [9, 4]
    assert path_from_last(out.last, anc, ct.depths, ct.max_depth).tolist() == [[0, 1, 3, -1], [0, -1, -1, -1]]


P = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)


def test_point_mass_accepts_with_target_probability():
    tree = TokenTree(0)
    det(tree, 0, 1)
    assert run_one(P, tree, [0.29, 0.95]) == ((1,), 2)  # bonus from node 1's p = [.1,.1,.8] with u=.95


def test_point_mass_rejection_zeroes_the_token_and_renormalises():
    tree = TokenTree(0)
    det(tree, 0, 1)
    # reject (0.31 >= 0.3); residual [5/7, 0, 2/7]: u=0.70 -> token 0, u=0.72 -> token 2 (never token 1)
    assert run_one(P, tree, [0.31, 0.70]) == ((), 0)
    assert run_one(P, tree, [0.31, 0.72]) == ((), 2)


def test_sampled_child_uses_min_one_p_over_q_and_residual():
    q = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)
    tree = TokenTree(0)
    samp(tree, 0, 1, q)
    # accept prob = min(1, 0.3 / 0.6) = 0.5
    assert run_one(P, tree, [0.49, 0.0])[0] == (1,)
    # reject: residual = norm(max(p - q, 0)) = norm([0.3, 0, 0]) = token 0 whatever the uniform
    assert run_one(P, tree, [0.51, 0.999]) == ((), 0)


def test_duplicate_draws_are_tested_in_draw_order():
    # draws [a=0, b=1, a=0] from q: the second a is tested after b, against the residual left by a and b
    p = torch.tensor([[0.3, 0.3, 0.4], [1.0, 0, 0], [1.0, 0, 0]], dtype=torch.float64)
    q = torch.tensor([0.6, 0.2, 0.2], dtype=torch.float64)
    tree = TokenTree(0)
    for tok in (0, 1, 0):
        samp(tree, 0, tok, q)
    # test 1: a, ratio .3/.6 = .5, u=.9 rejects; r = norm((.3-.6)+, (.3-.2)+, (.4-.2)+) = [0, 1/3, 2/3]
    # test 2: b, ratio (1/3)/.2 >= 1: u=.99 accepts
    assert run_one(p, tree, [0.9, 0.99, 0.0, 0.5])[0] == (1,)
    # b rejected is impossible (ratio 1): use a tree [a, a] instead: test 2 on a: r(a) = 0 -> rejected
    tree2 = TokenTree(0)
    samp(tree2, 0, 0, q)
    samp(tree2, 0, 0, q)
    # r after test 1 = [0, 1/3, 2/3]; test 2 rejects a (r(a)=0); r = norm((r - q)+) = norm([0, .133, .467])
    acc, bonus = run_one(p, tree2, [0.9, 0.0, 0.1])
    assert acc == () and bonus == 1  # .1 * .6 = .06 < .133
    assert run_one(p, tree2, [0.9, 0.0, 0.3]) == ((), 2)


def test_zero_target_probability_is_never_accepted():
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    tree = TokenTree(0)
    det(tree, 0, 2)
    assert run_one(p, tree, [0.0, 0.3])[1] == 0
    tree = TokenTree(0)
    samp(tree, 0, 2, torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))
    assert run_one(p, tree, [0.0, 0.7]) == ((), 1)


def test_all_zero_residual_falls_back_to_target_distribution():
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([0.5, 0.5 + 1e-6, 0.0], dtype=torch.float64)  # q >= p everywhere: residual (p - q)+ = 0
    tree = TokenTree(0)
    samp(tree, 0, 1, q)
    assert run_one(p, tree, [0.9999999999, 0.2])[1] == 0
    assert run_one(p, tree, [0.9999999999, 0.7])[1] == 1


def naive_first(p, tree, rng):
    """SpecInfer's naive sample-and-match at the root (host reference): sample from p, keep a matching child."""
    tok = int(np.searchsorted(np.cumsum(p), rng.random(), side="right"))
    return tok, tree.child(0, tok) is not None


def test_mss_with_fresh_samples_is_exact_and_beats_naive():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    rng = random.Random(1)
    n = 40000
    trees, uniforms = [], []
    for _ in range(n):
        tree = TokenTree(0)
        for _ in range(2):  # two children sampled iid from q
            x = int(np.searchsorted(np.cumsum(q.numpy()), rng.random(), side="right"))
            samp(tree, 0, x, q)
        trees.append(tree)
        uniforms.append([rng.random() for _ in range(3)])
    probs = torch.stack([p] + [torch.tensor([1.0, 0, 0], dtype=torch.float64)] * 2)[None].expand(n, 3, 3)
    res = run(probs.contiguous(), trees, uniforms)
    counts = np.bincount([(acc or (bonus,))[0] for acc, bonus in res], minlength=3)
    naive = [naive_first(p.numpy(), t, rng) for t in trees]
    counts_naive = np.bincount([tok for tok, _ in naive], minlength=3)
    assert counts / n == pytest.approx([0.5, 0.3, 0.2], abs=0.012)
    assert counts_naive / n == pytest.approx([0.5, 0.3, 0.2], abs=0.012)
    acc_mss = sum(1 for acc, _ in res if acc) / n
    acc_naive = sum(1 for _, hit in naive if hit) / n
    assert acc_mss > acc_naive + 0.1


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8),
                                                     (0.9, 4, 0.6), (1.0, 1, 1.0)])
def test_warpers_equal_hugging_face(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(6, 32, generator=torch.Generator().manual_seed(3)) * 3
    logits[0, :4] = 2.5  # ties
    hf = LogitsProcessorList()
    if temperature != 1.0:
        hf.append(TemperatureLogitsWarper(temperature))
    if top_k:
        hf.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        hf.append(TopPLogitsWarper(top_p))
    want = hf(None, logits.clone())
    got = warp_logits(logits, SamplingParams("sample", temperature, top_k, top_p))
    assert torch.equal(torch.isinf(want), torch.isinf(got))
    assert torch.allclose(want[~torch.isinf(want)], got[~torch.isinf(got)])
    probs = target_probs(logits, SamplingParams("sample", temperature, top_k, top_p))
    assert torch.allclose(probs.sum(-1), torch.ones(6, dtype=torch.float64))


def test_bad_sampling_parameters_are_clear_errors():
    from specstream.errors import InvalidRequestError

    for kwargs in ({"mode": "beam"}, {"temperature": 0.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**kwargs)
