"""QosScheduler plans forks (``Request.fork_of``) on hand-built queues: a fork waits (no prefill, no encode)
until its source's final prefill chunk is planned, then takes a slot in that plan as a ``ForkWork``; forks that
find no slot prefill themselves later; forks of a source that ends before its prefill encode and prefill
themselves."""

from __future__ import annotations

from specstream.schedulers.plan import EncodeItem, EncodeResult, Request, RequestStepResult, StepOutput
from specstream.schedulers.qos import QosConfig, QosScheduler
from specstream.schedulers.simulator import VirtualClock


def _book(s, plan):
    """Answer ``plan`` as the executor does: a chunk that is not final yields no token; a final chunk and each
    fork yield one; a decode one; a request ends at its ``max_new_tokens``."""
    def one(r, is_prefill):
        end = "length" if len(r.output_ids) + 1 >= r.max_new_tokens else None
        return RequestStepResult(r.request_id, (5,), 0, is_prefill, end, None, 1)

    res = []
    for p in plan.prefills:
        if p.start + p.num_tokens >= len(s.requests[p.request_id].context):
            res.append(one(s.requests[p.request_id], True))
        else:
            res.append(RequestStepResult(p.request_id, (), 0, True, None, None, 1, prefill_done=False))
    res += [one(s.requests[f.request_id], True) for f in plan.forks]
    res += [one(s.requests[d.request_id], False) for d in plan.decodes]
    enc = tuple(EncodeResult(rid, it.item_id) for w in plan.encodes for rid, it in w.items)
    return s.update(StepOutput(plan.step, tuple(res), 1, plan.num_nodes, 0.01, enc))


def _group(n, prompt=40, encodes=False):
    reqs = []
    for i in range(n):
        enc = (EncodeItem(f"c{i}/img", "image"),) if encodes else ()
        r = Request(f"c{i}", [1] * prompt, 8, qos="interactive", arrival_s=0.0, encodes=enc)
        if i:
            r.fork_of = "c0"
        reqs.append(r)
    return reqs


def test_forks_ride_on_the_final_chunk_and_the_rest_wait_for_slots():
    s = QosScheduler(QosConfig(num_slots=3, max_len=128, reserved_realtime_slots=0, token_budget=64,
                               max_prefill_chunk_tokens=16), clock=VirtualClock())
    for r in _group(4):
        s.add(r)
    plans = []
    while s.has_work():
        plan = s.schedule()
        plans.append(plan)
        _book(s, plan)
    chunks = [[(p.request_id, p.start, p.num_tokens) for p in plan.prefills] for plan in plans]
    assert chunks[:3] == [[("c0", 0, 16)], [("c0", 16, 16)], [("c0", 32, 8)]]  # the source alone, chunked
    assert [[(f.request_id, f.source) for f in plan.forks] for plan in plans[:3]] == [
        [], [], [("c1", "c0"), ("c2", "c0")]]  # with its final chunk: as many forks as slots
    # the fourth found no slot: it prefills itself once one frees (no fork of a source that is decoding)
    own = [(i, p.start, p.num_tokens) for i, plan in enumerate(plans) for p in plan.prefills
           if p.request_id == "c3"]
    assert [x[1:] for x in own] == [(0, 16), (16, 16), (32, 8)] and own[0][0] > 3
    assert sum(len(plan.forks) for plan in plans) == 2
    assert all(len(s.requests[f"c{i}"].output_ids) == 8 for i in range(4))


def test_forks_skip_the_encode_and_encode_when_their_source_ends_first():
    clock = VirtualClock()
    s = QosScheduler(QosConfig(num_slots=4, max_len=128, reserved_realtime_slots=0, token_budget=256), clock=clock)
    for r in _group(3, encodes=True):
        s.add(r)
    clock.advance(0.05)  # the image encoder's batching delay
    plan = s.schedule()
    assert [[rid for rid, _ in w.items] for w in plan.encodes] == [["c0"]]  # the image is encoded once
    _book(s, plan)
    plan = s.schedule()
    assert [p.request_id for p in plan.prefills] == ["c0"]
    assert [f.request_id for f in plan.forks] == ["c1", "c2"] and not plan.encodes
    _book(s, plan)
    # a source cancelled before its prefill: its forks stop waiting, encode and prefill themselves
    s2 = QosScheduler(QosConfig(num_slots=4, max_len=128, reserved_realtime_slots=0, token_budget=256),
                      clock=clock)
    for r in _group(3, encodes=True):
        s2.add(r)
    s2.cancel("c0")
    seen_enc, seen_pre = set(), set()
    while s2.has_work():
        plan = s2.schedule()
        assert not plan.forks
        seen_enc |= {rid for w in plan.encodes for rid, _ in w.items}
        seen_pre |= {p.request_id for p in plan.prefills}
        clock.advance(0.05)
        _book(s2, plan)
    assert seen_enc == seen_pre == {"c1", "c2"}


def test_a_fork_added_after_its_source_prefilled_is_an_ordinary_request():
    s = QosScheduler(QosConfig(num_slots=4, max_len=128, reserved_realtime_slots=0, token_budget=256),
                     clock=VirtualClock())
    src, late = _group(2)
    s.add(src)
    _book(s, s.schedule())  # the source prefilled (decoding now)
    s.add(late)
    plan = s.schedule()
    assert [p.request_id for p in plan.prefills] == ["c1"] and not plan.forks


def test_trees_planned_after_forks_leave_room_for_the_forks_prompt_copies():
    """A decoding request's tree is grown after the step's forks are admitted: the memory left for it must count
    the prompts copied into the forks' slots this step, or the plan overruns the budget (the old ``_mem_left``
    counted held memory, tree nodes and prefill chunks only: 185 of 160 tokens here)."""
    s = QosScheduler(QosConfig(num_slots=4, max_len=128, reserved_realtime_slots=0, token_budget=512,
                               kv_budget_tokens=160, kv_high_watermark=1.0,
                               max_nodes_per_request=64), clock=VirtualClock())
    d = Request("d", [1] * 40, 80, qos="interactive", arrival_s=0.0)
    d.speculate = True
    s.add(d)
    _book(s, s.schedule())  # d's prompt: it decodes from now on
    d.requested_nodes = 64  # its drafters ask for a 64-node tree
    for r in _group(2):
        s.add(r)
    plan = s.schedule()
    assert [p.request_id for p in plan.prefills] == ["c0"]
    assert [f.request_id for f in plan.forks] == ["c1"]
    assert s.kv_tokens(plan) <= s.kv_budget
    assert [dw.node_budget for dw in plan.decodes] == [160 - 41 - 40 - 40]  # what d's cache, c0's chunk and c1's copy leave
