"""The loop <-> scheduler contract (issue 20 item 3): one ``Scheduler`` protocol that FIFO and QoS both implement
(no feature probes), released/preempted slots as ``SlotRelease`` records that name their model."""

from __future__ import annotations

import itertools

import pytest

from specstream.schedulers.fifo import FifoScheduler
from specstream.schedulers.plan import Request, RequestStepResult, Scheduler, SlotRelease, StepOutput
from specstream.schedulers.qos import QosConfig, QosScheduler


def _out(step, results) -> StepOutput:
    return StepOutput(step, results, 1, len(results), 0.01)


def _result(rid: str, tokens: tuple[int, ...], prefill: bool, reason: str | None = None) -> RequestStepResult:
    return RequestStepResult(rid, tokens, 0, prefill, reason)


@pytest.mark.parametrize("make", [lambda: FifoScheduler(num_slots=2, max_len=64),
                                  lambda: QosScheduler(QosConfig(num_slots=2, max_len=64,
                                                                 reserved_realtime_slots=0))],
                         ids=["fifo", "qos"])
def test_both_schedulers_implement_the_protocol_and_release_slots_with_their_model(make):
    s = make()
    assert isinstance(s, Scheduler)
    assert s.next_event_s() is None and isinstance(s.clock(), float)
    s.observe("default", 3, 3, 0.01)  # accepted by both (FIFO ignores it)
    s.add(Request("a", [1, 2, 3], 2, qos="batch"))
    s.add(Request("b", [4, 5], 4, qos="batch"))
    plan = s.schedule()
    slots = {p.request_id: p.slot for p in plan.prefills}
    assert sorted(slots) == ["a", "b"]
    s.update(_out(plan.step, (_result("a", (7,), True), _result("b", (8,), True))))
    plan = s.schedule()
    s.update(_out(plan.step, (_result("a", (9,), False, "length"), _result("b", (6,), False))))
    cancelled = s.cancel("b")
    assert cancelled is not None and cancelled.finish_reason == "cancelled" and cancelled.output_ids == [8, 6]
    assert s.cancel("b") is None and s.cancel("unknown") is None  # finished or unknown: nothing to stop
    plan = s.schedule()
    assert sorted(plan.released, key=lambda r: r.request_id) == [
        SlotRelease("a", slots["a"], "default"), SlotRelease("b", slots["b"], "default")]
    assert not s.has_work()


@pytest.mark.parametrize("make", [lambda clock: FifoScheduler(num_slots=1, max_len=64),
                                  lambda clock: QosScheduler(QosConfig(num_slots=1, max_len=64,
                                                                       reserved_realtime_slots=0), clock=clock)],
                         ids=["fifo", "qos"])
def test_both_schedulers_stamp_the_first_token_on_their_clock(make):
    """``stats.first_token_s`` is the scheduler clock at the step that committed the first token (not at a
    prefill chunk that committed nothing). The FIFO scheduler left it None, so the time to first token and the
    decode rate after it could not be measured on the engine's default scheduler."""
    now = [100.0]
    s = make(lambda: now[0])
    s.clock = lambda: now[0]
    req = Request("a", [1, 2, 3], 3, qos="batch")
    s.add(req)
    plan = s.schedule()
    now[0] = 101.5
    s.update(_out(plan.step, (RequestStepResult("a", (), 0, True, None, prefill_done=False),)))
    assert req.stats.first_token_s is None
    plan = s.schedule()
    now[0] = 102.25
    s.update(_out(plan.step, (_result("a", (7,), True),)))
    now[0] = 103.0
    plan = s.schedule()
    s.update(_out(plan.step, (_result("a", (8, 9), False, "length"),)))
    assert req.finished and req.output_ids == [7, 8, 9] and req.stats.first_token_s == 102.25


def test_fifo_cancels_a_waiting_request_and_refuses_a_second_model():
    s = FifoScheduler(num_slots=1, max_len=64)
    assert not s.multi_model
    with pytest.raises(ValueError, match="one model"):
        s.add_model("other", None)
    s.add(Request("a", [1, 2], 4))
    s.add(Request("w", [3], 4))
    plan = s.schedule()
    assert [p.request_id for p in plan.prefills] == ["a"]  # one slot: w waits
    req = s.cancel("w")
    assert req.finish_reason == "cancelled" and list(s.waiting) == [] and req.slot is None
    s.update(_out(plan.step, (_result("a", (5,), True),)))
    assert s.schedule().released == ()  # the waiting request held no slot


def test_a_device_loop_serves_a_multi_model_scheduler_only_through_the_protocol(tiny):
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

    eng = SpeculativeEngine.from_checkpoints(tiny.target, [], ngram=False,
                                             config=EngineConfig(num_slots=2, max_len=64))
    other = SpeculativeEngine.from_checkpoints(tiny.target, [], ngram=False,
                                               config=EngineConfig(num_slots=1, max_len=64)).runner
    other.name = "other"
    with pytest.raises(ValueError, match="one model"):
        eng.loop.add_runner(other)  # FIFO (the engine's default) serves one model
    assert list(eng.loop.runners) == ["default"]
    a = eng.add_request(eng.make_request([3, 4, 5], 6, request_id="a"))
    b = eng.add_request(eng.make_request([6, 7], 6, request_id="b"))
    eng.step()
    eng.loop.cancel("b")  # FIFO requests can be cancelled too (before: a silent no-op)
    while eng.has_work():
        eng.step()
    assert b.finish_reason == "cancelled" and len(a.output_ids) == 6
    assert "b" not in eng.executor.states


def test_tokens_reach_the_event_loop_as_immutable_deltas_while_the_device_thread_runs_on(tiny):
    """The first delta's callback holds the event loop until the device thread has finished the request: every
    later delta still carries only its own step's tokens (a callback reading ``req.output_ids`` would see them
    all at once), and the deltas add up to the output."""
    import asyncio
    import time

    from specstream.schedulers.plan import TokenDelta
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

    eng = SpeculativeEngine.from_checkpoints(tiny.target, [tiny.noisy], ngram=False,
                                             config=EngineConfig(num_slots=2, max_len=64))
    req = eng.make_request([3, 9, 27, 81], 12, logprobs=True, request_id="d")
    seen: list[TokenDelta] = []

    def on_tokens(delta):
        assert isinstance(delta, TokenDelta)
        if not seen:
            deadline = time.monotonic() + 30
            while not req.finished and time.monotonic() < deadline:  # the device thread runs on meanwhile
                time.sleep(0.001)
            assert req.finished
        seen.append(delta)

    async def main():
        try:
            return await eng.loop.submit(req, on_tokens=on_tokens)
        finally:
            eng.loop.stop()

    done = asyncio.run(main())
    assert len(seen) >= 2
    assert [t for d in seen for t in d.new_tokens] == done.output_ids and len(done.output_ids) == 12
    assert [d.total for d in seen] == list(itertools.accumulate(len(d.new_tokens) for d in seen))
    assert [t for d in seen for t in d.logprobs] == done.output_logprobs
    assert [d.finished for d in seen] == [False] * (len(seen) - 1) + [True] and seen[-1].finish_reason == "length"
    with pytest.raises(AttributeError):
        seen[0].new_tokens.append(1)  # a tuple: nobody extends it


def _reachable(obj, seen=None):
    """Every object reachable from ``obj`` through dataclass fields and containers (ids deduplicated)."""
    import dataclasses

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, dict):
        children = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    else:
        children = []
    for child in children:
        yield from _reachable(child, seen)


def _assert_plan_is_typed_and_immutable(plan):
    """No scheduler ``Request`` and nothing mutable reachable from a plan handed to a runner: frozen dataclasses,
    tuples and scalars only."""
    import dataclasses

    for x in _reachable(plan):
        assert not isinstance(x, Request), f"plan {plan.step} reaches the scheduler's Request {x.request_id!r}"
        assert not isinstance(x, (list, dict, set)), f"plan {plan.step} holds a mutable {type(x).__name__}"
        if dataclasses.is_dataclass(x):
            assert type(x).__dataclass_params__.frozen, f"plan {plan.step} holds a mutable {type(x).__name__}"


def _recording(executor):
    plans = []
    execute = executor.execute

    def run(plan):
        _assert_plan_is_typed_and_immutable(plan)  # before the runner sees it
        plans.append(plan)
        return execute(plan)

    executor.execute = run
    return plans


def test_runners_get_each_request_once_as_a_spec_then_ids_and_numbers_only(tiny):
    """A real engine loop (FIFO: ``n`` forked choices, a sampled request waiting for a slot): every plan the
    executor runs holds no scheduler ``Request`` and nothing mutable; each request's ``RequestSpec`` comes once,
    in the plan of its first work, the work items carry its id; the executor's own committed tokens equal what
    the scheduler booked."""
    from specstream.schedulers.plan import RequestSpec
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
    from specstream.types import SamplingParams

    eng = SpeculativeEngine.from_checkpoints(tiny.target, [tiny.noisy], ngram=True,
                                             config=EngineConfig(num_slots=3, max_len=96))
    plans = _recording(eng.executor)
    reqs = [eng.make_request([3, 4, 5, 6], 10, request_id="a", logprobs=True),
            eng.make_request([3, 4, 5, 6], 10, request_id="a1", sampling=SamplingParams("sample", seed=3)),
            eng.make_request([7, 8, 9], 8, request_id="b"),
            eng.make_request([11, 12], 9, request_id="c", sampling=SamplingParams("sample", seed=4))]
    reqs[1].fork_of = "a"
    for r in reqs:
        eng.add_request(r)
    committed = {}
    while eng.has_work():
        eng.step()
        committed.update({rid: list(st.output) for rid, st in eng.executor.states.items()})
    assert all(len(r.output_ids) == r.max_new_tokens for r in reqs), [(r.request_id, r.output_ids) for r in reqs]
    specs = [s for p in plans for s in p.admitted]
    assert sorted(s.request_id for s in specs) == ["a", "a1", "b", "c"]  # once each
    first_work = {}
    for p in plans:
        for rid in p.request_ids():
            first_work.setdefault(rid, p.step)
    assert {s.request_id: p.step for p in plans for s in p.admitted} == first_work
    assert all(isinstance(s, RequestSpec) and s.committed == () for s in specs)
    assert [p.step for p in plans if p.forks] and all(f.request_id == "a1" for p in plans for f in p.forks)
    for r in reqs:  # the executor's own list, as of its last step with the request, is a prefix of the output
        assert r.output_ids[:len(committed[r.request_id])] == committed[r.request_id]
    assert eng.executor.states == {} and eng.executor.pending == {}


def test_a_preempted_request_is_readmitted_with_its_committed_tokens_and_continues_unchanged(tiny):
    """QoS preemption on a real engine: the runner frees the request's cache; the resume's plan sends its spec
    again with the tokens committed so far (its prefill context is prompt + those), and the greedy output is the
    one the request gets alone."""
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

    def engine(sched=None):
        cfg = EngineConfig(num_slots=2, max_len=128, cost_aware=False)
        eng = SpeculativeEngine.from_checkpoints(tiny.target, [tiny.noisy], ngram=True, config=cfg)
        if sched is not None:
            eng.scheduler = sched
        return eng

    sched = QosScheduler(QosConfig(num_slots=2, max_len=128, reserved_realtime_slots=0, max_nodes_per_request=8))
    eng = engine(sched)
    plans = _recording(eng.executor)
    prompts = {"batch-a": [5, 6, 7, 8, 9], "batch-b": [10, 11, 12], "rt": [13, 14]}
    reqs = {rid: eng.make_request(p, 16 if rid != "rt" else 6, qos="realtime" if rid == "rt" else "batch",
                                  request_id=rid) for rid, p in prompts.items()}
    eng.add_request(reqs["batch-a"])
    eng.add_request(reqs["batch-b"])
    for _ in range(3):
        eng.step()
    at_preemption = {rid: list(reqs[rid].output_ids) for rid in ("batch-a", "batch-b")}
    eng.add_request(reqs["rt"])
    eng.run()
    victims = [r for r in ("batch-a", "batch-b") if reqs[r].preemptions]
    assert victims, "the realtime request preempted no batch request"
    victim = victims[0]
    specs = [s for p in plans for s in p.admitted if s.request_id == victim]
    assert len(specs) == 2 and specs[0].committed == ()
    assert specs[1].committed == tuple(at_preemption[victim]) and len(specs[1].committed) > 0
    resume = next(p for p in plans if specs[1] in p.admitted)
    (work,) = [w for w in resume.prefills if w.request_id == victim]
    assert (work.start, work.context_len) == (0, len(prompts[victim]) + len(specs[1].committed))
    alone = engine()
    ref = alone.make_request(prompts[victim], 16, request_id="ref")
    alone.add_request(ref)
    alone.run()
    assert reqs[victim].output_ids == ref.output_ids


def test_models_with_realtime_rows_step_first_by_the_loops_own_record_of_the_qos(tiny):
    """The step order (models with realtime rows first) comes from the QoS the loop copied at submit, not from
    the scheduler's live ``Request``: between the scheduler's plan and the first forward the scheduler's request
    registry is unreadable, and the order is still realtime first."""
    from specstream.stages.device_loop import DeviceLoop
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

    runners = []
    for name in ("a-interactive", "z-realtime"):
        r = SpeculativeEngine.from_checkpoints(tiny.target, [], ngram=False,
                                               config=EngineConfig(num_slots=1, max_len=64)).runner
        r.name = name
        runners.append(r)
    loop = DeviceLoop(runners)
    loop.add_request(runners[0].make_request([3, 4, 5], 3, request_id="i", qos="interactive"))
    loop.add_request(runners[1].make_request([6, 7], 3, request_id="r", qos="realtime"))
    assert loop._entries["r"].qos == "realtime" and loop._entries["i"].qos == "interactive"

    class NoLookups(dict):  # the scheduler's request registry while the loop orders the models
        def get(self, *a, **k):
            raise AssertionError("the step order read the scheduler's requests")

        __getitem__ = get

    sched = loop.scheduler
    real_registry, real_schedule = sched.requests, sched.schedule
    order: list[str] = []

    def schedule():
        plan = real_schedule()
        sched.requests = NoLookups(real_registry)  # from the plan until the first forward
        return plan

    for r in runners:
        def execute(plan, _ex=r.executor.execute, _n=r.name):
            sched.requests = real_registry
            order.append(_n)
            return _ex(plan)
        r.executor.execute = execute
    sched.schedule = schedule
    loop.step()
    assert order == ["z-realtime", "a-interactive"]
    while loop.has_work():
        loop.step()
    assert sched.requests is real_registry and order[:2] == ["z-realtime", "a-interactive"]


def test_loop_engines_never_reuse_a_request_id_after_one_is_freed(tiny):
    """Each offline transcription in a server gets a fresh ``LoopEngine`` on the loop's Whisper runner. Their
    request ids were made from ``id(engine)``, which CPython hands out again once an engine is freed: a new request
    then shared the id of a finished one whose slot release was still pending, and that release dropped the new
    request's encoder output (an HTTP 500 "forward on a slot without encoder output" seen in CI). 50 engines made
    and freed one after another give 50 distinct ids (the old ids: a handful), and the loop runs such requests to
    their end."""
    from specstream.stages.device_loop import DeviceLoop
    from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
    from specstream.stages.speech import LoopEngine

    runner = SpeculativeEngine.from_checkpoints(tiny.target, [], ngram=False,
                                                config=EngineConfig(num_slots=1, max_len=64)).runner
    loop = DeviceLoop([runner])
    ids = []
    for _ in range(50):
        eng = LoopEngine(loop, runner.name)
        ids.append(eng.make_request([3, 4, 5], 2).request_id)
        del eng  # its address is free for the next one
    assert len(set(ids)) == 50
    for k in (0, 1):
        eng = LoopEngine(loop, runner.name)
        req = loop.add_request(eng.make_request([3, 4, 5 + k], 2))
        loop.run()
        assert req.finish_reason == "length" and len(req.output_ids) == 2
        del eng
