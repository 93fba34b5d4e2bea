"""Exact sampling: speculative outputs follow the target's own sampling distribution, whatever the drafts.

The target has a vocabulary of 8, so the distribution of the first tokens is enumerated exactly (Hugging Face
forwards + the same warpers). 20,000 requests run as one continuous batch; a chi-square test compares the joint
counts of (token 1, token 2) and of (token 2, token 3) — tokens 2 and 3 are the first ones decided by tree
verification — with the exact distribution.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specstream.kernels.sampling import target_probs
from specstream.types import SamplingParams
from specstream.stages.speculative.drafters.model import TreeSpec
from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
from specstream.stages.speculative.models.tiny import TinyDecoderSpec, build_tiny_decoder, random_decoder_state, \
    save_checkpoint

V = 8
N = 20_000
PROMPT = [1, 2, 3, 1, 2, 3, 1]
PARAMS = SamplingParams("sample", temperature=1.7, top_k=6, top_p=0.95, seed=0)


@pytest.fixture(scope="module")
def vocab8(tmp_path_factory):
    root = tmp_path_factory.mktemp("v8")
    spec = TinyDecoderSpec(vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=64, head_scale=2.0)
    state = random_decoder_state(spec, seed=21)
    target = save_checkpoint(root / "target", spec.config_dict(), state)
    draft = build_tiny_decoder(root / "draft", spec, seed=22, noise_from=state, noise=0.6)
    draft2 = build_tiny_decoder(root / "draft2", spec, seed=23, noise_from=state, noise=1.0)
    return target, draft, draft2


def exact_joint(target, length: int = 3) -> dict[tuple[int, ...], float]:
    """P(t1, ..., t_length) under the target's own sampling, enumerated with HF forwards."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def dist(prefix):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(prefix)])).logits[0, -1:]
        return target_probs(logits, PARAMS)[0].numpy()

    joint = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, pr in joint.items():
            p = dist(prefix)
            for t in range(V):
                if p[t] > 0:
                    nxt[prefix + (t,)] = pr * p[t]
        joint = nxt
    return joint


def chi_square_p(counts: dict, expected_probs: dict, n: int) -> float:
    """Chi-square p-value; cells with expected count < 5 are pooled. Impossible cells must be empty."""
    for cell, c in counts.items():
        assert expected_probs.get(cell, 0.0) > 0, f"impossible outcome {cell} observed {c} times"
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for cell, p in expected_probs.items():
        if p * n < 5:
            pool_o += counts.get(cell, 0)
            pool_e += p * n
        else:
            obs.append(counts.get(cell, 0))
            exp.append(p * n)
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = np.array(exp) * (sum(obs) / sum(exp))
    return float(chisquare(obs, exp).pvalue)


def marginal(joint, idx):
    out = {}
    for cell, p in joint.items():
        key = tuple(cell[i] for i in idx)
        out[key] = out.get(key, 0.0) + p
    return out


DRAFTERS = {
    "model-sampled": (True, False, "2,2"),
    "model-dynamic": (True, False, "dynamic:6"),
    "ngram": (False, True, "1,1"),
    "merged": (True, True, "2,1"),
}


@pytest.fixture(scope="module")
def joint(vocab8):
    return exact_joint(vocab8[0], 4)


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_first_tokens_follow_target_distribution(vocab8, joint, name):
    target, draft, _ = vocab8
    use_model, ngram, tree = DRAFTERS[name]
    cfg = EngineConfig(num_slots=N, max_len=32, tree=TreeSpec.parse(tree), adaptive=False, token_budget=10**7)
    eng = SpeculativeEngine.from_checkpoints(target, [draft] if use_model else [], ngram=ngram, config=cfg)
    reqs = []
    for i in range(N):
        params = SamplingParams("sample", PARAMS.temperature, PARAMS.top_k, PARAMS.top_p, seed=1000 + i)
        reqs.append(eng.add_request(eng.make_request(PROMPT, 4, params)))
    eng.run()
    assert eng.target_forwards <= 4  # one batch: prefill + at most 3 verify forwards
    outs = [tuple(r.output_ids[:3]) for r in reqs]
    accepted = sum(sum(r.stats.accepted_per_step) for r in reqs)
    assert accepted > N * 0.2, f"{name}: drafts were hardly ever accepted ({accepted})"
    for idx in ((0, 1), (1, 2)):
        counts = {}
        for o in outs:
            key = tuple(o[i] for i in idx)
            counts[key] = counts.get(key, 0) + 1
        p = chi_square_p(counts, marginal(joint, idx), N)
        assert p > 1e-3, f"{name}: tokens {idx} deviate from the target distribution (p={p:.2e})"


#: adaptivity on, budgets that cut sampled levels, merges of two sampled drafters (and an n-gram drafter)
ADAPTIVE = {
    # name: (draft models, ngram, tree, max nodes per request)
    "width4-cut-merge": (2, False, "4,1", 4),
    "width3-merge-ngram": (2, True, "3,1,1", 6),
}


@pytest.mark.parametrize("name", sorted(ADAPTIVE))
def test_tokens_follow_target_distribution_with_adaptivity_cuts_and_merges(vocab8, joint, name):
    target, draft, draft2 = vocab8
    n_models, ngram, tree, max_nodes = ADAPTIVE[name]
    cfg = EngineConfig(num_slots=N, max_len=32, tree=TreeSpec.parse(tree), adaptive=True, token_budget=10**7,
                       max_nodes_per_request=max_nodes)
    eng = SpeculativeEngine.from_checkpoints(target, [draft, draft2][:n_models], ngram=ngram, config=cfg)
    reqs = []
    for i in range(N):
        params = SamplingParams("sample", PARAMS.temperature, PARAMS.top_k, PARAMS.top_p, seed=5000 + i)
        reqs.append(eng.add_request(eng.make_request(PROMPT, 5, params)))
    eng.run()
    outs = [tuple(r.output_ids[:4]) for r in reqs]
    sizes = {n for r in reqs for n in r.stats.accepted_per_step}
    assert len(sizes) > 1  # drafts were accepted in some steps and not in others
    worst = 1.0
    for idx in ((0, 1), (1, 2), (2, 3)):
        counts = {}
        for o in outs:
            key = tuple(o[i] for i in idx)
            counts[key] = counts.get(key, 0) + 1
        worst = min(worst, chi_square_p(counts, marginal(joint, idx), N))
    assert worst > 1e-3, f"{name}: tokens deviate from the target distribution (p={worst:.2e})"


def test_chi_square_detects_a_wrong_distribution(joint):
    """The test above has power: samples from the untempered distribution are rejected."""
    rng = np.random.default_rng(0)
    cells = list(joint)
    probs = np.array([joint[c] for c in cells])
    wrong = probs ** 1.3
    wrong /= wrong.sum()
    draws = rng.choice(len(cells), size=N, p=wrong)
    counts = {}
    for d in draws:
        key = cells[d][:2]
        counts[key] = counts.get(key, 0) + 1
    assert chi_square_p(counts, marginal(joint, (0, 1)), N) < 1e-6


def test_sampled_logprobs_are_the_warped_target_distribution(vocab8):
    """``Request.logprobs`` for sampled requests: log of the target's warped distribution at the sampled token,
    for tokens accepted from a tree as well as bonus tokens."""
    from transformers import AutoModelForCausalLM

    target, draft, _ = vocab8
    cfg = EngineConfig(num_slots=64, max_len=32, tree=TreeSpec.parse("2,2"), adaptive=False)
    eng = SpeculativeEngine.from_checkpoints(target, [draft], ngram=False, config=cfg)
    reqs = [eng.add_request(eng.make_request(PROMPT, 6, SamplingParams("sample", PARAMS.temperature, PARAMS.top_k,
                                                                       PARAMS.top_p, seed=i), logprobs=True))
            for i in range(64)]
    eng.run()
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert sum(sum(r.stats.accepted_per_step) for r in reqs) > 20
    for r in reqs:
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + r.output_ids])).logits[0, len(PROMPT) - 1:-1]
        probs = target_probs(logits, PARAMS).double()
        want = probs.gather(1, torch.tensor(r.output_ids)[:, None])[:, 0].log()
        assert torch.allclose(torch.tensor(r.output_logprobs, dtype=torch.float64), want, atol=1e-4)
