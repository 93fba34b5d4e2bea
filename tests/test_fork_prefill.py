"""``n`` choices share one prefill: the first request is the source, the others fork from it
(``Request.fork_of``). The prompt runs through the target once; each fork gets a copy of the prompt's KV cache in
a slot of its own and samples its first token from the source's last prompt row with its own random stream.

Checked on the built-in tiny LLaVA (an image prompt, the image encoded once) and its tiny draft: prefill tokens
planned and run (the plan's and the executor's counters), greedy forks identical to one request alone, seeded
sampled forks equal token for token to the same seeds decoded alone (speculation off, so every step draws one
uniform whatever the batch), a fork whose source is cancelled before its prefill prefills itself, and the KV
copy itself."""

from __future__ import annotations

import pytest
import torch

TOKENS = 12


@pytest.fixture(scope="module")
def cap():
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.caption import Captioner

    target, draft = default_caption_models(quiet=True)
    return Captioner(target, [str(draft)], temporal=False, visual_aware=False, num_slots=6)


@pytest.fixture(scope="module")
def prepared(cap):
    import skimage.data

    return cap.vlm.prepare(skimage.data.astronaut(), "Describe this image.")


def _record_plans(loop):
    plans = []
    schedule = loop.scheduler.schedule

    def recording():
        plan = schedule()
        plans.append(plan)
        return plan

    loop.scheduler.schedule = recording
    return plans


def _run(cap, prepared, seeds, fork: bool, speculate: bool = True):
    """Requests of one prompt (one per seed; None = greedy), the others forking from the first when ``fork``;
    returns (requests, planned prefill tokens, encoded items, executor prefill tokens run)."""
    from specstream.types import SamplingParams

    loop, ex = cap.loop, cap.runner.executor
    before = ex.prefill_tokens
    plans = _record_plans(loop)
    try:
        reqs = []
        for s in seeds:
            sampling = SamplingParams() if s is None else SamplingParams("sample", temperature=1.0, seed=s)
            req = cap.make_request(prepared, TOKENS, sampling=sampling)
            req.eos_token_ids = ()  # untrained weights: every request runs to its length
            req.speculate = speculate
            if fork and reqs:
                req.fork_of = reqs[0].request_id
            reqs.append(req)
        for req in reqs:
            loop.add_request(req)
        loop.run()
    finally:
        del loop.scheduler.schedule
    for req in reqs:
        loop.pop(req.request_id)
    planned = sum(p.num_tokens for plan in plans for p in plan.prefills)
    encoded = sum(len(w.items) for plan in plans for w in plan.encodes)
    return reqs, planned, encoded, ex.prefill_tokens - before


def test_n_greedy_choices_prefill_the_prompt_once(cap, prepared):
    (one,), planned_one, enc_one, ran_one = _run(cap, prepared, [None], fork=False)
    prompt = len(one.prompt_ids)
    assert planned_one == ran_one == prompt and enc_one == 1
    four, planned, encoded, ran = _run(cap, prepared, [None] * 4, fork=True)
    assert (planned, ran, encoded) == (prompt, prompt, 1)  # one prefill, one image encode (old code: 4x each)
    assert [r.output_ids for r in four] == [one.output_ids] * 4 and len(one.output_ids) == TOKENS
    assert [r.stats.prefill_steps for r in four] == [1, 1, 1, 1]
    # without fork_of the same four requests prefill four times (the old behaviour of n > 1)
    _, planned_apart, encoded_apart, _ = _run(cap, prepared, [None] * 4, fork=False)
    assert (planned_apart, encoded_apart) == (4 * prompt, 4)


def test_seeded_sampled_forks_equal_the_same_seeds_alone(cap, prepared):
    seeds = [7, 8, 9, 10]
    forked, planned, _, _ = _run(cap, prepared, seeds, fork=True, speculate=False)
    assert planned == len(forked[0].prompt_ids)
    alone = [_run(cap, prepared, [s], fork=False, speculate=False)[0][0] for s in seeds]
    assert [r.output_ids for r in forked] == [r.output_ids for r in alone]
    assert len({tuple(r.output_ids) for r in forked}) == 4  # four streams, four samples of 12 tokens
    again, _, _, _ = _run(cap, prepared, seeds, fork=True, speculate=False)
    assert [r.output_ids for r in again] == [r.output_ids for r in forked]


def test_fork_first_token_is_the_single_request_distribution(cap, prepared):
    """Exactness of the fork: a fork's first token is drawn from the source's logits row with the fork's own
    uniform, so for every seed it is the token that seed draws alone (the same inverse-CDF draw from the same
    distribution), hence the same distribution over seeds."""
    seeds = list(range(100, 124))
    forked, _, _, _ = _run(cap, prepared, [99] + seeds, fork=True, speculate=False)
    firsts = [r.output_ids[0] for r in forked[1:]]
    alone = [_run(cap, prepared, [s], fork=False, speculate=False)[0][0].output_ids[0] for s in seeds]
    assert firsts == alone and len(set(firsts)) > 1


def test_speculating_forks_keep_greedy_exactness_and_batch_with_others(cap, prepared):
    """Forks decode with the model draft like any request: greedy output equals the target alone (speculation
    off), whatever else is in the batch."""
    (plain,), _, _, _ = _run(cap, prepared, [None], fork=False, speculate=False)
    three, _, _, _ = _run(cap, prepared, [None, None, None], fork=True, speculate=True)
    assert [r.output_ids for r in three] == [plain.output_ids] * 3


def test_fork_whose_source_is_cancelled_prefills_itself(cap, prepared):
    from specstream.types import SamplingParams

    loop = cap.loop
    src = cap.make_request(prepared, TOKENS, sampling=SamplingParams())
    child = cap.make_request(prepared, TOKENS, sampling=SamplingParams())
    for r in (src, child):
        r.eos_token_ids = ()
    child.fork_of = src.request_id
    loop.add_request(src)
    loop.add_request(child)
    loop.cancel(src.request_id)  # before any step: the child can no longer fork; it encodes and prefills itself
    plans = _record_plans(loop)
    try:
        loop.run()
    finally:
        del loop.scheduler.schedule
    assert src.finish_reason == "cancelled" and child.finish_reason == "length"
    assert sum(p.num_tokens for plan in plans for p in plan.prefills) == len(child.prompt_ids)
    assert not any(plan.forks for plan in plans)
    (alone,), _, _, _ = _run(cap, prepared, [None], fork=False)
    assert child.output_ids == alone.output_ids
    loop.pop(child.request_id)


def test_kv_copy_prefix():
    from specstream.stages.speculative.models.kv_cache import KVCache

    c = KVCache(2, 3, 1, 8, 2, torch.float32)
    c.k.normal_()
    c.v.normal_()
    c.positions[0, :5] = torch.arange(5)
    before = c.k[:, 1, :, 5:].clone()
    c.copy_prefix(0, 1, 5)
    assert c.lengths[1] == 5
    assert torch.equal(c.k[:, 1, :, :5], c.k[:, 0, :, :5]) and torch.equal(c.v[:, 1, :, :5], c.v[:, 0, :, :5])
    assert torch.equal(c.positions[1, :5], torch.arange(5)) and torch.equal(c.k[:, 1, :, 5:], before)
    with pytest.raises(ValueError):
        c.copy_prefix(1, 1, 2)


def test_one_model_engine_forks_too(tiny):
    """The FIFO scheduler of ``SpeculativeEngine`` plans forks as well: a text prompt with a model draft, greedy
    forks equal to the request alone, one prefill; a fork that finds no free slot prefills itself later."""
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

    eng = SpeculativeEngine.from_checkpoints(tiny.target, [tiny.noisy], config=EngineConfig(num_slots=3))
    prompt = [5, 17, 42, 99, 3, 7, 11]
    (alone,) = eng.generate([prompt], 10)
    before = eng.executor.prefill_tokens
    reqs = [eng.make_request(prompt, 10) for _ in range(4)]
    for r in reqs[1:]:
        r.fork_of = reqs[0].request_id
    for r in reqs:
        eng.add_request(r)
    eng.run()
    assert [r.output_ids for r in reqs] == [alone.output_ids] * 4
    # three slots: the source and two forks share one prefill; the fourth waits for a slot and prefills itself
    assert eng.executor.prefill_tokens - before == 2 * len(prompt)
    assert [r.stats.prefill_steps for r in reqs] == [1, 1, 1, 1]


def test_whisper_cache_copy_prefix_copies_the_cross_attention_too():
    from specstream.stages.speculative.models.whisper import WhisperKVCache

    c = WhisperKVCache(2, 3, 2, 8, 4, 6, torch.float32)
    for t in (c.k, c.v, c.cross_k, c.cross_v):
        t.normal_()
    c.enc_lengths[2] = 5
    c.copy_prefix(2, 0, 3)
    assert c.lengths[0] == 3 and c.enc_lengths[0] == 5
    assert torch.equal(c.k[:, 0, :, :3], c.k[:, 2, :, :3])
    assert torch.equal(c.cross_k[:, 0, :, :5], c.cross_k[:, 2, :, :5])
    assert torch.equal(c.cross_v[:, 0, :, :5], c.cross_v[:, 2, :, :5])


def test_a_plan_of_forks_without_their_source_is_an_error_not_a_dropped_fork(tiny):
    """A plan (or one model's share of it) that carries forks but no prefill at all must raise, as a fork whose
    source's final chunk is missing does; the old executor returned an empty step, so the fork never got its
    first token and held its slot forever."""
    from specstream.schedulers.plan import ForkWork, StepPlan
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

    eng = SpeculativeEngine.from_checkpoints(tiny.target, [], config=EngineConfig(num_slots=2))
    child = eng.make_request([5, 17, 42], 4)
    child.slot = 1
    with pytest.raises(ValueError, match="without their source's final prefill chunk"):
        eng.executor.execute(StepPlan(1, forks=(ForkWork(child, 1, "gone"),)))
