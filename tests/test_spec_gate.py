"""Speculation never loses: the step-level gate (``SpecGate``) switches trees on or off for the whole batch from
measured costs — unit tests of the decision, the off-decision at batch 8 on the simulator's cost model (and on
at batch 1), and the live executor's gate on tiny models (exact output, host syncs per step unchanged)."""

from __future__ import annotations

import math

import pytest

from specstream.schedulers.costmodel import CPU_2CORE, GateChoice, SpecGate
from specstream.schedulers.plan import DecodeWork, Request
from specstream.schedulers.qos import QosConfig
from specstream.schedulers.simulator import SimConfig, TraceEvent, simulate

SPECINFER = (1, 2, 3, 6, 9, 12, 15, 18, 21)  # TreeSpec("1,1,3,1,1,1,1,1").depth_nodes()
# a CPU-like target: 0.16 s per forward (weights read), 0.01 s per verified token; 0.02 s per draft level
CPU = dict(fixed_s=0.16, per_token_s=0.01, level_s=0.02, depth_nodes=SPECINFER)


def test_same_costs_and_acceptance_pay_at_batch_1_and_lose_at_batch_8():
    """alpha 0.4: one draft level earns 0.4 tokens for 0.01 s of verify (+ 0.02 s of draft).

    batch 1: plain 1 / 0.17 s = 5.882 tokens/s; depth 1: 1.4 / (0.16 + 0.02 + 0.02) = 7.0 (depth 2: 1.56 / 0.23 =
    6.78) -> on, depth 1. batch 8: plain 8 / 0.24 = 33.33; depth 1: 11.2 / 0.34 = 32.94 -> off.
    """
    one = SpecGate().decide([(21, 8, 0.4)], **CPU)
    assert (one.depth, one.keep, one.probe) == (1, (True,), False)
    assert one.rate_on == pytest.approx(7.0) and one.rate_off == pytest.approx(1 / 0.17)
    eight = SpecGate().decide([(21, 8, 0.4)] * 8, **CPU)
    assert (eight.depth, eight.keep, eight.probe) == (0, (False,) * 8, False)
    assert eight.rate_on == pytest.approx(11.2 / 0.34) and eight.rate_off == pytest.approx(8 / 0.24)


def test_deep_tree_chosen_where_verify_is_cheap():
    """batch 1, alpha 0.8, 0.5 ms per node, 5 ms per level: tokens/s by depth 32.8, 50.0, 58.8, 61.5, 61.68 (depth
    4, 9 nodes), 60.5, ... -> depth 4."""
    c = SpecGate().decide([(21, 8, 0.8)], fixed_s=0.03, per_token_s=0.0005, level_s=0.005, depth_nodes=SPECINFER)
    assert (c.depth, c.keep) == (4, (True,))
    assert c.rate_on == pytest.approx(3.3616 / 0.0545) and c.rate_off == pytest.approx(1 / 0.0305)


def test_trees_that_earn_less_than_the_batch_are_dropped_and_the_good_one_kept():
    """batch 8, one request's drafts agree (alpha 0.9), seven others' do not (0.05); 5 ms per draft level. All
    eight trees at depth 2: 10.08 tokens in 0.41 s (24.6/s), below no trees (33.3/s); the seven earn 0.05 tokens
    for 0.02 s of verify each and are dropped; the good tree alone at depth 2: 9.71 tokens in 0.27 s = 35.96/s."""
    rows = [(21, 8, 0.9)] + [(21, 8, 0.05)] * 7
    c = SpecGate().decide(rows, fixed_s=0.16, per_token_s=0.01, level_s=0.005, depth_nodes=SPECINFER)
    assert (c.depth, c.keep, c.probe) == (2, (True,) + (False,) * 7, False)
    assert c.rate_on == pytest.approx(9.71 / 0.27)


def test_rows_without_a_tree_never_get_one_and_an_empty_ask_is_plain():
    c = SpecGate().decide([(1, 8, 1.0), (21, 0, 1.0), (21, 8, 0.9)], fixed_s=0.03, per_token_s=0.0005,
                          level_s=0.001, depth_nodes=SPECINFER)
    assert c.keep == (False, False, True) and c.depth > 0
    gate = SpecGate()
    plain = gate.decide([(1, 8, 1.0)] * 3, **CPU)
    assert (plain.depth, plain.keep, gate.counts) == (0, (False,) * 3, {"on": 0, "off": 0, "probe": 0})


def test_probes_take_turns_over_the_rows_and_back_off_until_speculation_pays_again():
    gate = SpecGate()
    losing = [(21, 8, 0.4)] * 8
    probes = []
    for step in range(1, 9 + 16 + 32 + 64 + 64 + 1):
        c = gate.decide(losing, **CPU)
        if c.probe:
            probes.append((step, [i for i, k in enumerate(c.keep) if k], c.depth))
        else:
            assert c.depth == 0 and not any(c.keep)
    # after 8 refused steps the probe's own cost (one level 0.02 s + two 1-node trees 0.02 s = 0.04 s) is still
    # above 2 % of the refused time (8 x 0.24 s x 0.02 = 0.0384 s): it waits one more step; then 16, 32, 64, 64
    # steps (3.84 s x 0.02 covers it); two rows of eight each time, in turn; the best depth (1)
    assert probes == [(9, [0, 1], 1), (25, [2, 3], 1), (57, [4, 5], 1), (121, [6, 7], 1), (185, [0, 1], 1)]
    assert gate.counts == {"on": 0, "off": 180, "probe": 5}
    assert gate.decide([(21, 8, 0.4)], **CPU).depth == 1  # the batch shrank to one: it pays again
    assert gate.interval == 8 and gate.refused == 0


def test_cut_applies_the_choice_to_the_plans_decodes():
    reqs = [Request(f"r{i}", [1, 2, 3], 16) for i in range(3)]
    decodes = (DecodeWork.of(reqs[0], 0, 21, 8), DecodeWork.of(reqs[1], 1, 4, 8), DecodeWork.of(reqs[2], 2, 21, 1))
    gate = SpecGate()
    cut = gate.cut(decodes, GateChoice(3, (True, True, False), False, 0.0, 0.0), SPECINFER)
    # 21 nodes cut after depth 3: 6 nodes; a 4-node budget reaches depth 3 (root, 2 levels, 1 of 3 branches)
    assert [(w.node_budget, w.max_depth) for w in cut] == [(6, 3), (4, 3), (1, 1)]
    off = gate.cut(decodes, GateChoice(0, (False,) * 3, False, 0.0, 0.0), SPECINFER)
    assert [w.node_budget for w in off] == [1, 1, 1] and [w.request_id for w in off] == [r.request_id for r in reqs]
    # before costs are measured: one draft level, for the one asking row whose draft has least to read
    assert gate.warmup([(21, 8, 1.0), (1, 8, 1.0)], SPECINFER) == GateChoice(1, (True, False), False, 0.0, 0.0)
    assert gate.warmup([(21, 8, 1.0)] * 4, SPECINFER, lags=[40, 9, 9, 70]).keep == (False, True, False, False)
    assert gate.warmup([(1, 8, 1.0)] * 3, SPECINFER) == GateChoice(0, (False,) * 3, False, 0.0, 0.0)
    chain = gate.cut(decodes[1:2], gate.warmup([(4, 8, 1.0)], ()))
    assert [(w.node_budget, w.max_depth) for w in chain] == [(2, 1)]
    with pytest.raises(ValueError):
        SpecGate(probe_every=0)
    with pytest.raises(ValueError):
        SpecGate(probe_share_of_time=0.0)


# -- the simulator: the same gate, the costs measured from the simulated steps --------------------------------
# verifying is costly (a CPU): 0.16 s per target forward + 0.01 s per verified token; drafting 0.02 s per level
# + 4 ms per draft node; per-token draft acceptance 0.3
SIM_COST = CPU_2CORE.with_(step_fixed_s=0.16, per_row_s=0.0, per_token_s=0.01, per_kv_token_s=0.0,
                           draft_level_s=0.02, draft_per_node_s=0.004)


def _sim(batch: int, acceptance: float, gate: bool, speculate: bool = True, new_tokens: int = 96,
         prompt: int = 16, cost=None):
    events = [TraceEvent(0.0, f"r{i}", "batch", 600_000.0, prompt, new_tokens, 0, 0.0, acceptance)
              for i in range(batch)]
    # spec_token_limit out of the way: the gate alone decides
    sched = QosConfig(num_slots=8, max_len=512, reserved_realtime_slots=0, spec_token_limit=10**6,
                      max_nodes_per_request=21 if speculate else 1)
    res = simulate(events, SimConfig(scheduler=sched, cost=cost or SIM_COST, spec_gate=gate))
    assert all(r.output_len == new_tokens for r in res.records.values())
    return batch * new_tokens / res.end_s, res.executor


@pytest.mark.parametrize("acceptance", [0.0, 0.3])
def test_simulator_gate_switches_speculation_off_at_batch_8_and_never_loses(acceptance):
    plain, _ = _sim(8, acceptance, gate=True, speculate=False)
    gated, ex = _sim(8, acceptance, gate=True)
    ungated, _ = _sim(8, acceptance, gate=False)
    assert gated >= 0.97 * plain
    assert ungated < 0.7 * plain  # per-request budgets alone keep drafting (acceptance only): a loss
    assert ex.gate.counts["off"] >= 0.85 * ex.decode_steps
    assert ex.gate.counts["probe"] <= 4  # at 8, 24, 56, 120 refused steps: vanishing
    assert ex.drafted_steps <= 8


def test_simulator_gate_keeps_speculation_on_where_it_pays_at_batch_1():
    """The same costs, one request whose drafts are accepted at 0.6 per token: depth 1 commits 1.6 tokens in
    0.204 s against 1 in 0.17 s (1.33x), so the gate keeps speculation on. (The simulated draft misses its first,
    warm-up level: 0.6 accepted tokens carry over; the gate, which weighs observed acceptance only, then refuses
    trees until its first probe, 10 steps later, accepts; from then on it stays on.) The draft reads the prompt
    once (15 of its 16 tokens: it drafts from the newest)."""
    plain, _ = _sim(1, 0.6, gate=True, speculate=False)
    gated, ex = _sim(1, 0.6, gate=True)
    assert gated >= 1.25 * plain
    assert ex.gate.counts["off"] <= 10 and ex.gate.counts["probe"] == 1
    assert ex.drafted_steps >= ex.decode_steps - 11


# live-like costs of the real Qwen2.5-Coder pair at int4 on a 2-core CPU (docs/benchmarks.md, 2026-12-06): a target
# step 43 ms + 8.3 ms per verified token, a draft level 15 ms (so a draft token read 2.9 ms: 8.3 x 15 / 43); 64-token
# prompts
REAL_PAIR_COST = CPU_2CORE.with_(step_fixed_s=0.043, per_row_s=0.0, per_token_s=0.0083, per_kv_token_s=0.0,
                                 draft_level_s=0.015, draft_per_node_s=0.003)


def test_gate_weighs_the_drafts_catch_up_read_of_a_fresh_batch():
    """Eight fresh 64-token prompts, 40 tokens each to write, every tree expected to be accepted (alpha 1.0):

    - without the catch-up, depth 1 commits 16 tokens in 0.043 + 0.0083 x 16 + 0.015 = 0.1908 s (83.9/s)
      against 8 in 0.1094 s (73.1/s): on;
    - each draft must first read 63 tokens (0.189 s), charged over the 20 steps the request has left at 2
      tokens a step: 9.45 ms a row, 75.6 ms for eight: 16 / 0.2664 s = 60.1/s: off at every depth;
    - alone (batch 1) the same read still pays: depth 8 commits 9 tokens in 0.043 + 0.0083 x 9 + 8 x 0.015 +
      0.189 / (40 / 9) = 0.2802 s (32.1/s) against 1 in 0.0513 s (19.5/s)."""
    costs = dict(fixed_s=0.043, per_token_s=0.0083, level_s=0.015, depth_nodes=())
    rows = [(9, 8, 1.0)] * 8
    assert SpecGate().decide(rows, **costs).depth > 0
    read = [(63 * 0.003, 40)] * 8
    off = SpecGate().decide(rows, **costs, catch_up=read)
    assert (off.depth, off.keep) == (0, (False,) * 8)
    assert off.rate_off == pytest.approx(8 / 0.1094)
    one = SpecGate().decide(rows[:1], **costs, catch_up=read[:1])
    assert (one.depth, one.keep) == (8, (True,))
    assert one.rate_on == pytest.approx(9 / (0.043 + 0.0083 * 9 + 8 * 0.015 + 0.189 / (40 / 9)))


def test_a_probe_waits_until_the_refused_time_pays_for_its_catch_up_read():
    """Batch 1, drafts refused (alpha 0.05), the draft 200 tokens behind (0.6 s to read), 400 tokens left: a
    one-level probe costs a level (15 ms), a node (8.3 ms) and the read charged over the 381 steps it serves at
    depth 1 and the acceptance seen (1.05 tokens a step: 1.57 ms): 24.9 ms, so at 2 % of the refused plain steps
    (51.3 ms each) it waits 25 steps, not 8. At
    batch 8 even trees always accepted lose to the prompt reads (see above): never a probe."""
    costs = dict(fixed_s=0.043, per_token_s=0.0083, level_s=0.015, depth_nodes=())
    gate = SpecGate()
    steps = 1
    while not gate.decide([(2, 1, 0.05)], **costs, catch_up=[(0.6, 400)]).probe:
        steps += 1
    assert steps == math.ceil((0.015 + 0.0083 + 0.6 / (400 / 1.05)) / (0.02 * 0.0513)) == 25
    eight = SpecGate()
    choices = [eight.decide([(9, 8, 0.05)] * 8, **costs, catch_up=[(0.189, 40)] * 8) for _ in range(500)]
    assert not any(c.probe or c.depth for c in choices) and eight.counts["off"] == 500


def test_fresh_batch_explores_a_quarter_of_its_rows_then_uses_the_workloads_acceptance():
    gate = SpecGate()
    assert gate.row_alphas([None] * 8) == [1.0, 1.0] + [0.0] * 6
    assert gate.row_alphas([None]) == [1.0]
    assert gate.row_alphas([0.5, None, None]) == [0.5, 1.0, 0.0]
    gate.observe(0, 4)  # two explored rows: none of four levels accepted, then all four
    gate.observe(4, 4)
    assert gate.workload_alpha == pytest.approx(4 / (4 + 0.9))  # the first miss decayed by 0.9
    assert gate.row_alphas([None, 0.25]) == [pytest.approx(4 / 4.9), 0.25]


@pytest.mark.parametrize("acceptance", [0.0, 0.5])
def test_simulator_gate_at_batch_8_with_the_drafts_catch_up_never_loses(acceptance):
    """Eight 64-token prompts at the real pair's costs. A gate that drafts every row of the fresh batch once (the
    former warm-up) pays eight prompt reads, 1.5 s, about 8 % of the run; this one reads at most two prompts."""
    plain, _ = _sim(8, acceptance, gate=True, speculate=False, prompt=64, cost=REAL_PAIR_COST)
    gated, ex = _sim(8, acceptance, gate=True, prompt=64, cost=REAL_PAIR_COST)
    assert gated >= 0.97 * plain
    assert ex.catch_up_tokens <= 2 * 64


def test_sim_config_reads_the_gate_key():
    assert SimConfig.from_dict({"spec_gate": True}).spec_gate is True
    assert SimConfig.from_dict({}).spec_gate is False


# -- the live executor ---------------------------------------------------------------------------------------
def _live_engine(tiny, drafts, ngram=False, tree="1,1,3,1,1,1,1,1", gate=True):
    from specstream.stages.speculative.drafters.model import TreeSpec
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

    paths = {"same": tiny.same, "noisy": tiny.noisy, "random": tiny.random}
    cfg = EngineConfig(num_slots=8, max_len=128, tree=TreeSpec.parse(tree), adaptive=True, cost_aware=True)
    eng = SpeculativeEngine.from_checkpoints(tiny.target, [paths[d] for d in drafts], ngram=ngram, config=cfg)
    if not gate:
        eng.executor.gate = None
    return eng


def _prompts(n: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(18)
    return [torch.randint(0, 250, (int(k),), generator=g).tolist() for k in torch.randint(3, 20, (n,), generator=g)]


def test_live_gate_switches_a_useless_draft_off_for_the_batch_and_stays_exact(tiny, hf_target):
    """A random draft at batch 8: after the warm-up step (depth-1 trees) and what the optimistic first
    acceptance estimate costs, the gate refuses trees for the whole batch, probing a quarter of the rows at a
    time; every output equals Hugging Face greedy. (Measured costs: which early steps draft depends on timing,
    the bounds below do not.)"""
    from conftest import hf_greedy

    prompts = _prompts(8)
    eng = _live_engine(tiny, ["random"])
    reqs = eng.generate(prompts, 40)
    assert [r.output_ids for r in reqs] == [hf_greedy(hf_target, p, 40) for p in prompts]
    assert all(a == 0 for r in reqs for a in r.stats.accepted_per_step)  # the random draft is never accepted
    gate = eng.executor.gate
    assert gate.counts["off"] > gate.counts["on"] and gate.counts["probe"] <= 3, gate.counts
    # one draft forward per drafted step here (depth-1 trees: the catch-up forward gives their logits): the
    # warm-up, the few steps the first optimistic acceptance estimate allows, the probes — out of 40 steps
    assert eng.executor.drafters[0].forwards <= 8
    ungated = _live_engine(tiny, ["random"], gate=False)  # per-request budgets alone: each request probes alone
    ungated.generate(prompts, 40)
    assert ungated.executor.drafters[0].forwards >= 3 * eng.executor.drafters[0].forwards


def test_a_request_without_acceptance_of_its_own_drafts_one_level_first(tiny):
    """A request's first tree rests on the other requests' acceptance (the workload's), which may be another kind
    of prompt's: it is cut to one draft level until the request has measured its own; after that its depth grows
    with its own evidence (``AdaptiveBudget.ramp``). Every tree the gate weighs is checked as it is cut."""
    eng = _live_engine(tiny, ["noisy"], tree="1,1,1,1")
    ex = eng.executor
    seen = {"unmeasured": [], "measured": []}
    cut = ex.gate.cut

    def spy(decodes, choice, depth_nodes=()):
        for w in decodes:
            own = ex.states[w.request_id].budget.measured_alpha
            seen["unmeasured" if own is None else "measured"].append(w.max_depth)
        return cut(decodes, choice, depth_nodes)

    ex.gate.cut = spy
    prompts = _prompts(5)
    eng.generate(prompts[:1], 24)  # the workload's acceptance now exists: the next requests' prior
    eng.generate(prompts[1:], 24)
    assert seen["unmeasured"] and max(seen["unmeasured"]) == 1, seen
    assert seen["measured"] and max(seen["measured"]) > 1, seen  # the configured 4 levels, once measured


def test_live_gate_keeps_the_host_syncs_per_step(tiny):
    """With the gate deciding (adaptive, cost-aware): still at most one sync per draft depth and one per verify,
    each a batched ``tolist``."""
    from test_engine_device import HostSyncs

    from specstream.types import SamplingParams

    eng = _live_engine(tiny, ["noisy", "same"], ngram=True, tree="1,1,3,1")
    for i, p in enumerate(_prompts(6)):
        eng.add_request(eng.make_request(p, 24, SamplingParams("greedy" if i % 2 else "sample", temperature=0.9,
                                                               seed=i)))
    per_step = []
    while eng.has_work():
        with HostSyncs() as syncs:
            eng.step()
        per_step.append(syncs.counts)
    assert len(per_step) >= 5
    for counts in per_step:
        assert sum(counts.values()) <= 4 * 2 + 1, counts
        assert set(counts) <= {"tolist"}, counts
    assert sum(eng.executor.gate.counts.values()) >= 1  # the gate decided steps


def test_bench_batch_sweep_smoke(tmp_path):
    """``specstream bench spec --batch-only``'s sweep on tiny shapes: every configuration at each batch size, its
    output equal to no speculation's, ratios against the same batch size's no-speculation run."""
    from specstream.pipeline.bench.spec import QUICK, batch_sweep, build_models

    target, draft = build_models(tmp_path / "m", QUICK)
    recs = batch_sweep(target, draft, (1, 2), 6, QUICK.vocab_size, rounds=1, progress=False)
    assert [(r["batch"], r["config"]) for r in recs] == [
        (b, c) for b in (1, 2) for c in ("ours/no-spec", "ours/adaptive", "ours/adaptive-no-gate", "ours/replay-c0.1")]
    assert all(r["identical"] for r in recs)
    assert all(r["vs_no_spec"] == 1.0 for r in recs if r["config"] == "ours/no-spec")
    assert all("gate" in r for r in recs if r["config"] in ("ours/adaptive", "ours/replay-c0.1"))


def test_budget_ramp_doubles_with_accepted_runs():
    """``AdaptiveBudget.ramp``: one level before any evidence of its own, 4 after the first drafted step, then
    twice the longest run of accepted levels."""
    from specstream.schedulers.budget import AdaptiveBudget

    b = AdaptiveBudget(full_nodes=17)
    assert b.ramp == 1
    b.observe(0, 1, 0)  # a step without drafts is no evidence
    assert b.ramp == 1
    b.observe(1, 2, 1)  # the first tree's one level, accepted: 4, not the 16 an acceptance of 1.0 would allow
    assert b.ramp == 4
    b.observe(4, 5, 4)
    assert b.ramp == 8
    b.observe(2, 9, 8)  # a rejection never lowers it
    assert b.ramp == 8
    b.observe(8, 9, 8)
    assert b.ramp == 16


def test_live_gate_grows_deep_trees_from_evidence_and_skips_the_prompt_read_as_first_cost(tiny, hf_target):
    """A draft identical to the target with a 16-level chain. The step after the warm-up may draft 4 levels
    (its acceptance of 1.0 rests on one level), then 8, then 16, and the output equals Hugging Face greedy.
    The warm-up step, whose draft read the whole prompt, is not the first measurement of a draft level's cost,
    so the gate warms up once more, on a step that reads only what the step before committed."""
    from conftest import hf_greedy

    prompt = _prompts(1)[0] + list(range(3, 40))  # a long prompt: its read is one-off
    eng = _live_engine(tiny, ["same"], tree=",".join(["1"] * 16))
    ex = eng.executor
    asked, warmups = [], []
    decide, warmup = ex.gate.decide, ex.gate.warmup

    def spy_decide(rows, *args, **kwargs):
        asked.append(max(m for _, m, _ in rows))
        return decide(rows, *args, **kwargs)

    def spy_warmup(rows, *args, **kwargs):
        warmups.append(ex._level_s)
        return warmup(rows, *args, **kwargs)

    ex.gate.decide, ex.gate.warmup = spy_decide, spy_warmup
    out = eng.generate([prompt], 60)[0].output_ids
    assert out == hf_greedy(hf_target, prompt, 60)
    assert asked and asked[0] <= 4, asked  # the first decision after the warm-up: 4 levels at most, not 16
    assert max(asked) == 16 and asked.index(16) > asked.index(8) > 0, asked
    assert len(warmups) >= 2 and warmups[:2] == [None, None]  # the prompt-reading step measured nothing
    assert ex._level_s is not None
