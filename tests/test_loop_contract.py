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
    slots = {p.request.request_id: p.slot for p in plan.prefills}
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


def test_fifo_cancels_a_waiting_request_and_refuses_a_second_model():
    s = FifoScheduler(num_slots=1, max_len=64)
    assert not s.multi_model
    with pytest.raises(ValueError, match="one model"):
        s.add_model("other", None)
    s.add(Request("a", [1, 2], 4))
    s.add(Request("w", [3], 4))
    plan = s.schedule()
    assert [p.request.request_id for p in plan.prefills] == ["a"]  # one slot: w waits
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
