"""Greedy speculative decoding is lossless: identical, token for token, to Hugging Face greedy ``generate``."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_clear_greedy_path, hf_greedy
from specstream.errors import ContextLengthError, InvalidRequestError, TokenizerMismatchError
from specstream.stages.speculative.drafters.model import TreeSpec
from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

G = torch.Generator().manual_seed(1234)
PROMPTS = [torch.randint(0, 256, (n,), generator=G).tolist() for n in (1, 3, 7, 12, 20, 5)]
REPETITIVE = [[5, 6, 7, 8] * 4, [1, 2, 3, 1, 2, 3, 1, 2], [9] * 6 + [10, 11] * 3]
LENGTHS = (1, 2, 9, 24)


@pytest.fixture(scope="module")
def references(hf_target):
    refs = {}
    for prompt in PROMPTS + REPETITIVE:
        full = hf_greedy(hf_target, prompt, max(LENGTHS))
        assert_clear_greedy_path(hf_target, prompt, full)
        refs[tuple(prompt)] = full
    return refs


def engine(tiny, drafts=(), ngram=False, tree="1,1,3,1,1,1,1,1", **kw):
    paths = {"same": tiny.same, "noisy": tiny.noisy, "random": tiny.random, "padded": tiny.padded,
             "small": tiny.small_random}
    cfg = EngineConfig(**{"num_slots": 8, "max_len": 256, "tree": TreeSpec.parse(tree), **kw})
    return SpeculativeEngine.from_checkpoints(tiny.target, [paths[d] for d in drafts], ngram=ngram, config=cfg)


CASES = [
    ("same", (["same"], False, "1,1,3,1,1,1,1,1")),
    ("random", (["random"], False, "1,1,3,1,1,1,1,1")),
    ("noisy", (["noisy"], False, "1,1,3,1,1,1,1,1")),
    ("noisy-dynamic", (["noisy"], False, "dynamic:24")),
    ("padded-vocab", (["padded"], False, "2,2,2")),
    ("ngram", ([], True, "1,1,1,1,1,1")),
    ("merged", (["noisy", "random"], True, "1,2,1,1")),
    ("none", ([], False, "1")),
]


@pytest.mark.parametrize("name,case", CASES, ids=[c[0] for c in CASES])
def test_greedy_output_identical_to_hf_generate(tiny, references, name, case):
    drafts, ngram, tree = case
    eng = engine(tiny, drafts, ngram, tree, adaptive=False)  # always speculate: this tests exactness
    for n in LENGTHS:
        prompts = PROMPTS + REPETITIVE
        reqs = eng.generate(prompts, n)
        for prompt, req in zip(prompts, reqs):
            assert req.output_ids == references[tuple(prompt)][:n], (name, n, prompt)
            assert req.finish_reason == "length"
            assert req.stats.committed == n
    if name == "same":
        assert reqs[0].stats.mean_accepted > 5


def test_draft_identical_to_target_commits_depth_plus_one_per_forward(tiny):
    for depth in (1, 3, 6):
        eng = engine(tiny, ["same"], tree=",".join(["1"] * depth), adaptive=False)
        for n in (1, 2, 10, 17):
            before = eng.target_forwards
            reqs = eng.generate([PROMPTS[2]], n)
            steps = 1 + math.ceil((n - 1) / (depth + 1))
            assert reqs[0].stats.target_steps == steps
            assert eng.target_forwards - before == steps
            assert reqs[0].stats.accepted_per_step == [min(depth, n - 2 - k * (depth + 1)) for k in range(steps - 1)]


def test_one_target_forward_per_step_for_the_whole_batch(tiny, references):
    eng = engine(tiny, ["same"], tree="1,1,1,1", adaptive=False)
    reqs = eng.generate(PROMPTS[:6], 21)
    # all six prompts are admitted in the first step: 1 prefill forward + ceil(20/5) verify forwards in all
    assert eng.target_forwards == 1 + 4
    assert all(r.stats.target_steps == 5 for r in reqs)


def test_batch_invariance_alone_vs_ragged_batch_of_8(tiny, references):
    prompts = (PROMPTS + REPETITIVE)[:8]
    for drafts, ngram in ((["noisy"], False), ([], True), (["noisy"], True)):
        alone = [engine(tiny, drafts, ngram).generate([p], 24)[0].output_ids for p in prompts]
        eng = engine(tiny, drafts, ngram)
        batch = eng.generate(prompts, 24)
        assert [r.output_ids for r in batch] == alone


def test_requests_join_and_leave_between_steps(tiny, references):
    eng = engine(tiny, ["noisy"], num_slots=3)
    first = [eng.add_request(eng.make_request(p, 24)) for p in PROMPTS[:2]]
    eng.step()
    eng.step()
    later = [eng.add_request(eng.make_request(p, n)) for p, n in zip(PROMPTS[2:], (5, 24, 9, 2))]
    eng.run()
    for req in first + later:
        assert req.output_ids == references[tuple(req.prompt_ids)][: req.max_new_tokens]


def test_merged_tree_tau_at_least_best_single_drafter(tiny):
    prompts = REPETITIVE + PROMPTS[:3]
    taus = {}
    for name, drafts, ngram in (("noisy", ["noisy"], False), ("ngram", [], True), ("merged", ["noisy"], True)):
        eng = engine(tiny, drafts, ngram, tree="1,1,3,1,1,1", adaptive=False)
        reqs = eng.generate(prompts, 24)
        taus[name] = sum(r.stats.committed for r in reqs) / sum(r.stats.target_steps for r in reqs)
    assert taus["merged"] >= max(taus["noisy"], taus["ngram"]), taus


def test_eos_inside_an_accepted_block_ends_output_there(tiny, hf_target):
    prompt = PROMPTS[3]
    free = hf_greedy(hf_target, prompt, 24)
    eos = free[6]  # the 7th token: with a draft identical to the target it is inside an accepted block
    first = free.index(eos)
    path = tiny.with_eos(eos)
    cfg = EngineConfig(num_slots=2, tree=TreeSpec.parse("1,1,1,1,1,1,1,1"), adaptive=False)
    eng = SpeculativeEngine.from_checkpoints(path, [tiny.same], config=cfg)
    assert eng.eos_token_ids == (eos,)
    req = eng.generate([prompt], 24)[0]
    assert req.output_ids == free[: first + 1] == hf_greedy(hf_target, prompt, 24, eos=eos)
    assert req.finish_reason == "eos"
    assert req.stats.accepted_per_step and max(req.stats.accepted_per_step) >= 1
    # nothing after the EOS was cached: the slot was freed and its length reset
    assert all(n == 0 for n in eng.executor.cache.lengths)


def test_bad_inputs_are_clear_errors(tiny, tmp_path):
    eng = engine(tiny, [])
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        eng.make_request([], 4)
    with pytest.raises(ContextLengthError):
        eng.make_request([1] * 256, 4)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        eng.make_request([1, 999], 4)
    with pytest.raises(InvalidRequestError):
        eng.make_request([1], 0)


def test_draft_with_different_tokenizer_is_rejected(tiny, tmp_path):
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    def train(text, path):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel()
        tok.train_from_iterator([text] * 20, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.save(str(path))

    t_dir, d_dir = tmp_path / "t", tmp_path / "d"
    shutil.copytree(tiny.target, t_dir)
    shutil.copytree(tiny.same, d_dir)
    train("the quick brown fox jumps over the lazy dog " * 10, t_dir / "tokenizer.json")
    train("lorem ipsum dolor sit amet consectetur adipiscing " * 10, d_dir / "tokenizer.json")
    with pytest.raises(TokenizerMismatchError, match="vocabularies differ"):
        SpeculativeEngine.from_checkpoints(t_dir, [d_dir])
    shutil.copy(t_dir / "tokenizer.json", d_dir / "tokenizer.json")
    eng = SpeculativeEngine.from_checkpoints(t_dir, [d_dir])
    assert eng.tokenizer is not None


def test_nan_logits_fail_only_that_request(tiny, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "nan"
    shutil.copytree(tiny.target, bad)
    state = load_file(str(bad / "model.safetensors"))
    state["model.embed_tokens.weight"][250] = float("nan")
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    eng = SpeculativeEngine.from_checkpoints(bad, [tiny.same], config=EngineConfig(num_slots=4))
    good = eng.add_request(eng.make_request(PROMPTS[1], 12))
    poisoned = eng.add_request(eng.make_request([3, 250, 4], 12))
    eng.run()
    assert poisoned.error["code"] == "numerical_error" and poisoned.finish_reason == "error"
    assert good.error is None and len(good.output_ids) == 12


def test_stream_yields_tokens_per_step(tiny, references):
    # acceptance alone sizes the trees (``cost_aware=False``): with measured costs the step gate's choice follows
    # the wall clock, and under load (a parallel test run) it drafted fewer levels and the chunks differed
    eng = engine(tiny, ["same"], tree="1,1,1", cost_aware=False)
    chunks = list(eng.stream(PROMPTS[4], 10))
    assert chunks[0] == tuple(references[tuple(PROMPTS[4])][:1])
    assert [t for c in chunks for t in c] == references[tuple(PROMPTS[4])][:10]
    # the prefill's token, then the whole 3-deep chain accepted (3 drafts + the bonus token) per step
    assert [len(c) for c in chunks] == [1, 4, 4, 1]


def test_adaptive_budget_switches_off_useless_or_costly_drafts_and_probes():
    from specstream.schedulers.budget import AdaptiveBudget

    b = AdaptiveBudget(full_nodes=21)
    assert b.requested_nodes() == 21
    for _ in range(10):
        b.observe(0, 21)  # nothing accepted
    assert b.requested_nodes() == 1
    asked = []
    for _ in range(16):
        n = b.requested_nodes()
        asked.append(n)
        b.observe(0, n)
    assert asked.count(4) == 2 and asked.count(1) == 14  # a 4-node probe every 8 steps
    good = AdaptiveBudget(full_nodes=21)
    for _ in range(5):
        good.observe(3, 21)
    assert good.requested_nodes(cost_ratio=0.5) == 21
    assert good.requested_nodes(cost_ratio=5.0) == 1  # 4 tokens per step do not pay for 6x the step time


def test_adaptive_budget_shortens_a_costly_deep_tree_instead_of_switching_it_off():
    """With the draft's cost per level known, a request asks for the depth with the best expected speed-up.

    SpecInfer's 8-level tree at a per-level acceptance of 2/3: when a draft level costs 0.3 of a verify, the
    whole tree costs 3.4 plain steps for an expected 2.9 tokens, so the old rule switched drafting off; the best
    depth is 2 (3 nodes: 1 + 2/3 + 4/9 = 2.11 tokens for 1.6 steps).
    """
    from specstream.schedulers.budget import AdaptiveBudget

    spec = TreeSpec.parse("1,1,3,1,1,1,1,1")
    assert spec.depth_nodes() == (1, 2, 3, 6, 9, 12, 15, 18, 21)
    assert TreeSpec.parse("dynamic:20").depth_nodes() == ()
    b = AdaptiveBudget(full_nodes=21, depth_nodes=spec.depth_nodes())
    for _ in range(40):
        b.observe(2, 21, 8)  # two levels accepted, the third rejected
    assert b.alpha == pytest.approx(2 / 3, abs=1e-4) and b.ema == pytest.approx(2.0, abs=1e-4)
    assert b.requested_nodes(cost_ratio=2.4) == 1  # without the per-level cost: off (3 tokens < 3.4 steps)
    assert b.best_depth(0.3) == 2 and b.requested_nodes(2.4, depth_cost=0.3) == 3
    assert b.best_depth(0.05) == 5 and b.requested_nodes(0.4, depth_cost=0.05) == 12
    assert b.best_depth(0.0) == 8 and b.requested_nodes(0.0, depth_cost=0.0) == 21
    assert b.requested_nodes(12.0, depth_cost=1.5) == 1  # no depth pays: off, with the usual probes
    # verifying nodes costs too (a CPU at batch 8): 0.4 of a plain step per node leaves depth 1, 1.0 none
    assert b.best_depth(0.05, node_cost=0.4) == 1 and b.requested_nodes(0.4, 0.05, node_cost=0.4) == 2
    assert b.best_depth(0.05, node_cost=1.0) == 0 and b.requested_nodes(0.4, 0.05, node_cost=1.0) == 1
    sure = AdaptiveBudget(full_nodes=21, depth_nodes=spec.depth_nodes())
    for _ in range(10):
        sure.observe(8, 21, 8)  # every level accepted: no miss, alpha 1
    assert sure.alpha == 1.0 and sure.requested_nodes(2.4, depth_cost=0.3) == 21


def test_step_cost_fit_separates_a_steps_fixed_cost_from_its_per_token_cost():
    from specstream.schedulers.costmodel import StepCostFit

    fit = StepCostFit()
    fit.observe(5, 0.1 + 5 * 0.01)
    assert fit.line() is None  # one size: no slope yet
    for n in (1, 8, 40, 3, 21):
        fit.observe(n, 0.1 + n * 0.01)
    intercept, slope = fit.line()
    assert intercept == pytest.approx(0.1) and slope == pytest.approx(0.01)
    flat = StepCostFit()
    for n in (1, 8, 40, 3):
        flat.observe(n, 0.2)  # a memory-bound step: no per-token cost to speak of
    assert flat.line() is None


def test_engine_measures_draft_cost_per_level_and_stays_exact(tiny, references):
    eng = engine(tiny, ["noisy"], tree="1,1,3,1,1,1,1,1", cost_aware=True)
    assert eng.executor.depth_nodes == (1, 2, 3, 6, 9, 12, 15, 18, 21)
    reqs = eng.generate(PROMPTS[:4], 24)
    assert [r.output_ids for r in reqs] == [references[tuple(p)][:24] for p in PROMPTS[:4]]
    assert eng.executor.depth_cost is not None and eng.executor.depth_cost > 0


def test_random_draft_is_switched_off_by_adaptivity(tiny, references):
    eng = engine(tiny, ["random"], tree="1,1,3,1,1,1,1,1")
    req = eng.generate([PROMPTS[3]], 24)[0]
    assert req.output_ids == references[tuple(PROMPTS[3])][:24]
    drafted_steps = len([a for a in req.stats.accepted_per_step])
    assert eng.executor.drafters[0].forwards <= 8 * 8  # a few full trees, then probes only
    assert drafted_steps == req.stats.target_steps - 1


def test_prompt_holding_the_pad_id_and_eos_matches_hf(tiny, hf_target):
    """Token 0 (the oracle's pad id) and the EOS inside the prompt, the EOS as its last token: ordinary tokens."""
    prompt = [4, 174, 162, 164, 18, 75, 131, 79, 194, 150, 240, 33, 43, 20, 33, 115, 66, 20, 153, 7, 229, 169, 82,
              76, 235, 190, 195, 17, 46, 39, 218, 105, 148, 213, 246, 198, 119, 10, 0, 93]
    want = hf_greedy(hf_target, prompt, 32)
    assert_clear_greedy_path(hf_target, prompt, want)
    engine = SpeculativeEngine.from_checkpoints(tiny.target, [tiny.noisy], ngram=True,
                                                config=EngineConfig(num_slots=2, max_len=256))
    assert engine.generate([prompt], 32)[0].output_ids == want
    with torch.no_grad():  # the oracle itself: a plain argmax loop over full forwards
        ids = list(prompt)
        for _ in range(32):
            ids.append(int(hf_target(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ids[len(prompt):] == want
    eos_prompt = prompt[:-1] + [7]
    eng7 = SpeculativeEngine.from_checkpoints(tiny.with_eos(7), [tiny.same], config=EngineConfig(num_slots=1))
    out = eng7.generate([eos_prompt], 16)[0]
    assert out.output_ids == hf_greedy(hf_target, eos_prompt, 16, eos=7)


@pytest.mark.parametrize("drafts,ngram", [((), False), (("same",), False), (("noisy",), True)],
                         ids=["none", "same", "noisy+ngram"])
def test_logprobs_equal_hf_log_softmax_with_and_without_drafts(tiny, hf_target, references, drafts, ngram):
    """``Request.logprobs``: each committed token's log-probability equals HF's log-softmax of its scores
    (within 1e-4), whichever tree row verified it; requests without the flag get none."""
    eng = engine(tiny, list(drafts), ngram, adaptive=False)
    prompts = PROMPTS[:4] + REPETITIVE[:1]
    reqs = [eng.add_request(eng.make_request(p, 12, logprobs=True)) for p in prompts]
    plain = eng.add_request(eng.make_request(PROMPTS[4], 12))
    eng.run()
    for p, req in zip(prompts, reqs):
        assert req.output_ids == references[tuple(p)][:12]
        with torch.no_grad():
            logits = hf_target(torch.tensor([p + req.output_ids])).logits[0, len(p) - 1:-1].double()
        want = logits.log_softmax(-1).gather(1, torch.tensor(req.output_ids)[:, None])[:, 0]
        assert len(req.output_logprobs) == 12
        assert torch.allclose(torch.tensor(req.output_logprobs, dtype=torch.float64), want, atol=1e-4), \
            (req.output_logprobs, want.tolist())
    assert plain.output_logprobs == [] and len(plain.output_ids) == 12
    if drafts == ("same",):
        assert reqs[0].stats.mean_accepted > 3  # the values came from tree rows, not only prefill rows


def test_a_reconfigured_engine_shares_the_weights_and_stays_exact(tiny, references):
    """``reconfigured``: another configuration (slots, tree, the n-gram drafter, drafts off) over the loaded
    weights, with its own caches: the same target and draft modules (nothing loaded again), HF's greedy tokens in
    every configuration, and the first engine still exact after the second ran."""
    from specstream.stages.speculative.drafters.model import ModelDrafter
    from specstream.stages.speculative.drafters.ngram import NgramDrafter

    first = engine(tiny, ["noisy"], tree="1,1,3,1,1,1,1,1", adaptive=False)
    prompts = PROMPTS + REPETITIVE
    draft = first.executor.drafters[0]
    cases = [(EngineConfig(num_slots=4, max_len=128, tree=TreeSpec.parse("2,2,2"), adaptive=False), True, True),
             (EngineConfig(num_slots=2, max_len=64, adaptive=False), False, False)]
    for cfg, drafts, ngram in cases:
        eng = first.reconfigured(cfg, drafts=drafts, ngram=ngram)
        assert eng.target is first.target and eng.executor.cache is not first.executor.cache
        models = [d for d in eng.executor.drafters if isinstance(d, ModelDrafter)]
        assert [d.model for d in models] == ([draft.model] if drafts else [])
        assert all(d.cache is not draft.cache for d in models)
        assert any(isinstance(d, NgramDrafter) for d in eng.executor.drafters) == ngram
        assert eng.max_len == cfg.max_len and eng.executor.cache.num_slots == cfg.num_slots
        for prompt, req in zip(prompts, eng.generate(prompts, 24)):
            assert req.output_ids == references[tuple(prompt)][:24]
        if drafts:
            assert sum(r.stats.target_steps for r in eng.generate(prompts, 24)) < 24 * len(prompts)
    for prompt, req in zip(prompts, first.generate(prompts, 24)):
        assert req.output_ids == references[tuple(prompt)][:24]
