"""QosScheduler planning on hand-built queues: exact plans."""

from __future__ import annotations

import pytest

from specstream.errors import CapacityError, InvalidRequestError
from specstream.schedulers.metrics import SchedulerMetrics
from specstream.schedulers.plan import EncodeItem, EncodeResult, Request, RequestStepResult, SlotRelease, StepOutput
from specstream.schedulers.qos import EncodeBatching, QosConfig, QosScheduler
from specstream.schedulers.simulator import VirtualClock


def req(rid, qos, n, t=0.0, deadline=None, max_new=20, encodes=()):
    return Request(rid, [1] * n, max_new, qos=qos, arrival_s=t, deadline_s=deadline, encodes=tuple(encodes))


def book(s, plan, requested=16, tokens=1):
    """Answer ``plan`` as an executor would: one token per prefill, ``tokens`` per decode."""
    res = [RequestStepResult(p.request_id, (5,), 0, True, None, None, requested) for p in plan.prefills]
    res += [RequestStepResult(d.request_id, (5,) * tokens, tokens - 1, False, None, None, requested)
            for d in plan.decodes]
    enc = tuple(EncodeResult(rid, it.item_id) for w in plan.encodes for rid, it in w.items)
    return s.update(StepOutput(plan.step, tuple(res), 1, plan.num_nodes, 0.01, enc))


def prefills(plan):
    return [(p.request_id, p.slot, p.num_tokens) for p in plan.prefills]


def decodes(plan):
    return [(d.request_id, d.slot, d.node_budget, d.max_depth) for d in plan.decodes]


def test_priority_order_edf_and_tree_budgets_with_batch_share():
    clock = VirtualClock()
    s = QosScheduler(QosConfig(num_slots=4, max_len=64, reserved_realtime_slots=1, token_budget=48, batch_share=0.1,
                               max_nodes_per_request=16, max_tree_depth=8), clock=clock)
    s.add(req("b1", "batch", 10))
    s.add(req("i1", "interactive", 8, deadline=9.0))
    s.add(req("i2", "interactive", 12, deadline=3.0))
    s.add(req("r1", "realtime", 5))
    plan = s.schedule()
    # realtime, then interactive by earliest deadline, then batch; slots popped from the free list
    assert prefills(plan) == [("r1", 0, 5), ("i2", 1, 12), ("i1", 2, 8), ("b1", 3, 10)]
    book(s, plan, requested=20)
    plan = s.schedule()
    # 48 tokens: 4 roots; batch keeps ceil(4.8) = 5; realtime grows first (+15), interactive within the rest
    # minus batch's share (+15, +9), batch gets its share (+5)
    assert decodes(plan) == [("r1", 0, 16, 8), ("i2", 1, 16, 8), ("i1", 2, 10, 8), ("b1", 3, 6, 5)]
    assert plan.num_nodes == 48


def test_reserved_slot_and_preemption_of_batch_by_realtime():
    clock = VirtualClock()
    s = QosScheduler(QosConfig(num_slots=3, max_len=64, reserved_realtime_slots=1, token_budget=64), clock=clock)
    for i in range(3):
        s.add(req(f"b{i}", "batch", 6, t=0.0))
    plan = s.schedule()
    assert prefills(plan) == [("b0", 0, 6), ("b1", 1, 6)]  # slot 2 stays reserved for realtime
    book(s, plan)
    s.add(req("r1", "realtime", 4))
    plan = s.schedule()
    assert prefills(plan) == [("r1", 2, 4)] and not plan.preempted
    book(s, plan)
    s.add(req("r2", "realtime", 4))
    plan = s.schedule()
    # no free slot: the most recently admitted batch request is preempted; its KV is freed
    assert plan.preempted == (SlotRelease("b1", 1, "default"),)
    assert prefills(plan) == [("r2", 1, 4)]
    assert [d[0] for d in decodes(plan)] == ["r1", "b0"]
    b1 = s.requests["b1"]
    assert b1.preemptions == 1 and b1.slot is None and len(b1.output_ids) == 2
    book(s, plan)
    # realtime finishes -> b1 resumes by prefilling prompt + the 2 tokens it had
    for rid in ("r1", "r2"):
        s.requests[rid].max_new_tokens = len(s.requests[rid].output_ids) + 1
    plan = s.schedule()
    out = StepOutput(plan.step, tuple(
        RequestStepResult(d.request_id, (5,), 0, False,
                          "length" if s.requests[d.request_id].qos == "realtime" else None, None, 1)
        for d in plan.decodes),
        1, 0, 0.01)
    s.update(out)
    plan = s.schedule()
    assert sorted(plan.released, key=lambda r: r.request_id) == [SlotRelease("r1", 2, "default"),
                                                                  SlotRelease("r2", 1, "default")]
    assert prefills(plan) == [("b1", 1, 6 + 2)]


def test_equal_priority_never_preempts_and_slack_promotes_batch_after_interactive_only():
    clock = VirtualClock()
    s = QosScheduler(QosConfig(num_slots=2, max_len=64, reserved_realtime_slots=0, token_budget=64,
                               promote_slack_s=2.0, service_s_per_token=1.0), clock=clock)
    s.add(req("i0", "interactive", 4, deadline=100.0, max_new=50))
    s.add(req("i1", "interactive", 4, deadline=100.0, max_new=50))
    book(s, s.schedule())
    s.add(req("b-small", "batch", 4, t=0.0, deadline=20.0, max_new=4))  # slack at t=6: 20 - 6 - 4 = 10
    s.add(req("b-big", "batch", 4, t=0.0, deadline=30.0, max_new=40))  # slack at t=6: 30 - 6 - 40 = -16
    clock.now = 6.0
    s.add(req("i2", "interactive", 4, t=6.0, deadline=50.0))  # no slot: it waits, no preemption
    plan = s.schedule()
    assert not plan.preempted and not plan.prefills
    assert s.slack_s(s.requests["b-big"], clock.now) == pytest.approx(-16.0)
    # earliest deadline first would take b-small; b-big is short of slack: promoted ahead of the other batch
    # work, but never ahead of an interactive request
    assert [r.request_id for r in s.waiting] == ["i2", "b-big", "b-small"]
    s.requests["i0"].max_new_tokens = len(s.requests["i0"].output_ids) + 1
    s.update(StepOutput(plan.step, (RequestStepResult("i0", (5,), 0, False, "length", None, 1),
                                    RequestStepResult("i1", (5,), 0, False, None, None, 1)), 1, 2, 0.01))
    plan = s.schedule()
    assert prefills(plan) == [("i2", 0, 4)]


def test_long_prefill_is_chunked_while_realtime_waits_and_realtime_starts_next_step():
    clock = VirtualClock()
    s = QosScheduler(QosConfig(num_slots=3, max_len=4096, reserved_realtime_slots=1, token_budget=4096,
                               max_prefill_chunk_tokens=None), clock=clock)
    s.add(req("cap", "interactive", 3000, deadline=60.0))  # a visual-token prefill of 3000 tokens
    plan = s.schedule()
    assert [(p.request_id, p.start, p.num_tokens, p.final) for p in plan.prefills] == [
        ("cap", 0, 3000, True)]  # nothing realtime, no chunk bound: one step takes it whole
    s1 = QosScheduler(QosConfig(num_slots=3, max_len=4096, reserved_realtime_slots=1, token_budget=4096,
                                max_prefill_chunk_tokens=1024), clock=clock)
    s1.add(req("cap", "interactive", 3000, deadline=60.0))
    s1.add(req("cap2", "interactive", 700, deadline=60.0))
    plan = s1.schedule()  # bounded steps even with nothing realtime: 1024 per request, requests side by side
    assert [(p.request_id, p.start, p.num_tokens, p.final) for p in plan.prefills] == [
        ("cap", 0, 1024, False), ("cap2", 0, 700, True)]
    s2 = QosScheduler(QosConfig(num_slots=3, max_len=4096, reserved_realtime_slots=1, token_budget=4096,
                                max_prefill_chunk_tokens=None, realtime_prefill_chunk_tokens=256), clock=clock)
    s2.add(req("cap", "interactive", 3000, deadline=60.0))
    s2.add(req("sub0", "realtime", 6))
    chunks = []
    for step in range(14):
        plan = s2.schedule()
        nonrt = sum(p.num_tokens for p in plan.prefills if s2.requests[p.request_id].qos != "realtime")
        assert nonrt <= 256  # no plan holds more than the chunk while realtime work is active
        chunks += [(p.start, p.num_tokens) for p in plan.prefills if p.request_id == "cap"]
        if step == 0:
            assert [p.request_id for p in plan.prefills][0] == "sub0"  # realtime first, same step
        if step == 3:
            s2.add(req("sub1", "realtime", 6, t=clock.now))
        if step == 4:  # the window that arrived during the prefill is scheduled in the next step
            assert "sub1" in [p.request_id for p in plan.prefills]
        res = tuple(RequestStepResult(p.request_id, (5,) if p.final else (), 0, True, None, None, 1,
                                      prefill_done=p.final) for p in plan.prefills)
        res += tuple(RequestStepResult(d.request_id, (5,), 0, False, None, None, 1) for d in plan.decodes)
        s2.update(StepOutput(plan.step, res, 1, plan.num_nodes, 0.01))
    # contiguous chunks in order; the last one (184 tokens) yields the first token
    assert chunks == [(256 * k, 256) for k in range(11)] + [(2816, 184)]
    assert "cap" in s2.running and s2.requests["cap"].stats.target_steps >= 12


def test_encode_batches_per_modality_priority_and_delay():
    clock = VirtualClock()
    cfg = QosConfig(num_slots=8, max_len=64, token_budget=128, batch_share=0.25,
                    encoders={"image": EncodeBatching(max_batch=4, max_delay_s=0.05),
                              "audio": EncodeBatching(max_batch=2, max_delay_s=0.01)})
    s = QosScheduler(cfg, clock=clock)
    for i in range(3):
        s.add(req(f"b{i}", "batch", 8, encodes=[EncodeItem(f"b{i}/img", "image")]))
    plan = s.schedule()
    assert plan.encodes == () and s.next_event_s() == pytest.approx(0.05)  # waits for more images
    s.add(req("i0", "interactive", 8, deadline=1.0, encodes=[EncodeItem("i0/img", "image")]))
    s.add(req("r0", "realtime", 8, encodes=[EncodeItem("r0/a", "audio", 2.0)]))
    plan = s.schedule()
    # realtime audio goes at once; 4 images are a full batch: interactive first, batch capped at its share
    # (ceil(0.25 * 4) = 1 while higher-class work exists)
    assert [(w.modality, [it.item_id for _, it in w.items]) for w in plan.encodes] == [
        ("image", ["i0/img", "b0/img"]), ("audio", ["r0/a"])]
    assert plan.prefills == ()  # nothing is encoded yet
    book(s, plan)
    plan = s.schedule()
    assert prefills(plan) == [("r0", 0, 8), ("i0", 1, 8), ("b0", 2, 8)]


def test_kv_high_watermark_shrinks_non_realtime_trees_first():
    clock = VirtualClock()
    s = QosScheduler(QosConfig(num_slots=3, max_len=100, reserved_realtime_slots=0, token_budget=256,
                               kv_budget_tokens=200, max_nodes_per_request=8), clock=clock)
    s.add(req("r", "realtime", 40, max_new=60))
    s.add(req("b", "batch", 40, max_new=60))
    book(s, s.schedule(), requested=8)
    for _ in range(5):
        plan = s.schedule()
        assert decodes(plan) == [("r", 0, 8, 7), ("b", 1, 8, 7)]  # at most 146 held of 200: below 80 %
        book(s, plan, requested=8, tokens=8)
    plan = s.schedule()  # 162 held > 160 = 80 %: batch decodes its root only, realtime keeps its tree
    assert decodes(plan) == [("r", 0, 8, 7), ("b", 1, 1, 0)]
    assert s.kv_tokens(plan) == 162 + 9 <= 200


def test_admission_control_refuses_at_once_with_retryable_error():
    metrics = SchedulerMetrics()
    s = QosScheduler(QosConfig(num_slots=2, max_len=64, token_budget=128,
                               max_queue={"realtime": 1, "interactive": 1, "batch": 1}), metrics=metrics)
    with pytest.raises(CapacityError) as e:
        s.add(req("big", "batch", 60, max_new=10))
    assert e.value.retryable and e.value.reason == "never_fits" and e.value.code == "over_capacity"
    s.add(req("b0", "batch", 4))
    with pytest.raises(CapacityError) as e:
        s.add(req("b1", "batch", 4))
    assert e.value.reason == "queue_full"
    with pytest.raises(InvalidRequestError):
        s.add(req("x", "bulk", 4))
    with pytest.raises(InvalidRequestError):
        s.add(req("v", "batch", 4, encodes=[EncodeItem("v/1", "video")]))
    text = metrics.render().decode()
    assert 'specstream_scheduler_rejections_total{model="default",qos="batch",reason="queue_full"} 1.0' in text
    assert 'specstream_scheduler_rejections_total{model="default",qos="batch",reason="never_fits"} 1.0' in text
    plan = s.schedule()
    assert 'specstream_scheduler_batch_size_count{model="default"} 1.0' in metrics.render().decode() and plan.prefills


def test_realtime_prefill_budget_in_seconds_follows_each_models_measured_cost():
    """While a subtitle window is active, a cheap model's whole prompt fits the step's prefill seconds and a costly
    model's prompt is chunked to them (at least MIN_CHUNK tokens, so it still progresses); decode-only forwards do
    not move the estimate."""
    from specstream.schedulers.plan import Request as R
    from specstream.schedulers.qos import MIN_CHUNK, ModelLimits

    clock = VirtualClock()
    models = {"vlm": ModelLimits(num_slots=4, max_len=4096), "big": ModelLimits(num_slots=4, max_len=4096),
              "whisper": ModelLimits(num_slots=2, max_len=448)}
    s = QosScheduler(QosConfig(models=models, token_budget=8192, max_prefill_chunk_tokens=None,
                               realtime_prefill_chunk_tokens=32, realtime_prefill_budget_s=0.01), clock=clock)
    # a decode step and a prefill step each: 3 ms fixed, then 50 us (vlm) and 500 us (big) per token
    for model, per_token in (("vlm", 5e-5), ("big", 5e-4)):
        s.observe(model, 0, 4, 0.003 + 4 * per_token)
        s.observe(model, 600, 604, 0.003 + 604 * per_token)
    s.observe("whisper", 0, 4, 0.01)  # steps all alike: no estimate
    s.observe("whisper", 0, 5, 0.01)
    assert s.prefill_s_per_token == {"vlm": pytest.approx(5e-5), "big": pytest.approx(5e-4)}
    s.add(R("w", [1] * 6, 8, qos="realtime", model="whisper"))
    s.add(R("cap", [1] * 150, 8, qos="interactive", deadline_s=5.0, model="vlm"))
    s.add(R("doc", [1] * 600, 8, qos="interactive", deadline_s=6.0, model="big"))
    plan = s.schedule()
    got = [(p.request_id, p.num_tokens) for p in plan.prefills]
    # the window first; the cheap prompt whole (7.5 ms); what is left (2.5 ms: 5 tokens of the costly model) is
    # under the smallest chunk, so the costly prompt waits for the next step
    assert got == [("w", 6), ("cap", 150)]
    s2 = QosScheduler(QosConfig(models=models, token_budget=8192, max_prefill_chunk_tokens=None,
                                realtime_prefill_budget_s=0.01), clock=clock)
    s2.observe("big", 0, 1, 0.001)
    s2.observe("big", 600, 601, 0.601)  # 1 ms per token: 10 tokens fit, the smallest chunk (16) goes anyway
    s2.add(R("w", [1] * 6, 8, qos="realtime", model="whisper"))
    s2.add(R("doc", [1] * 600, 8, qos="interactive", deadline_s=6.0, model="big"))
    assert [(p.request_id, p.num_tokens) for p in s2.schedule().prefills] == [("w", 6), ("doc", MIN_CHUNK)]
    s3 = QosScheduler(QosConfig(models=models, token_budget=8192, max_prefill_chunk_tokens=None,
                                realtime_prefill_budget_s=0.01), clock=clock)  # nothing measured yet: tokens cap
    s3.add(R("w", [1] * 6, 8, qos="realtime", model="whisper"))
    s3.add(R("cap", [1] * 150, 8, qos="interactive", deadline_s=5.0, model="vlm"))
    assert [(p.request_id, p.num_tokens) for p in s3.schedule().prefills] == [("w", 6), ("cap", 32)]


def test_costly_model_waits_while_another_models_realtime_work_runs():
    """``realtime_step_budget_s``: a model whose steps average more than the budget sits out the steps that
    carry another model's realtime rows (a device runs a step's models one after another), for at most
    MAX_DEFER_S; a cheap model, the realtime model's own other rows and an unmeasured model still join."""
    from specstream.schedulers.plan import Request as R
    from specstream.schedulers.qos import MAX_DEFER_S, ModelLimits

    clock = VirtualClock()
    models = {"vlm": ModelLimits(num_slots=4, max_len=4096), "text": ModelLimits(num_slots=4, max_len=4096),
              "whisper": ModelLimits(num_slots=2, max_len=448)}
    s = QosScheduler(QosConfig(models=models, token_budget=8192, realtime_step_budget_s=0.01), clock=clock)
    s.add(R("cap", [1] * 40, 8, qos="interactive", deadline_s=30.0, model="vlm"))
    s.add(R("chat", [1] * 20, 8, qos="interactive", deadline_s=30.0, model="text"))
    s.add(R("job", [1] * 10, 8, qos="batch", model="whisper"))
    plan = s.schedule()  # nothing measured, no realtime work: everyone prefills
    assert sorted(p.request_id for p in plan.prefills) == ["cap", "chat", "job"]
    book(s, plan)
    s.observe("vlm", 40, 40, 0.08)  # 80 ms steps
    s.observe("text", 20, 20, 0.004)  # 4 ms steps
    s.add(R("w", [1] * 6, 8, qos="realtime", model="whisper"))
    plan = s.schedule()
    assert [p.request_id for p in plan.prefills] == ["w"]
    assert sorted(d.request_id for d in plan.decodes) == ["chat", "job"]  # the VLM waits
    assert s.mean_step_s("vlm") == pytest.approx(0.08) and s.mean_step_s("whisper") is None
    clock.advance(MAX_DEFER_S + 0.01)
    assert "cap" in {d.request_id for d in s.schedule().decodes}  # waited 1 s: joins one step
    assert "cap" not in {d.request_id for d in s.schedule().decodes}  # and waits again
    off = QosScheduler(QosConfig(models=models, token_budget=8192), clock=clock)  # the rule off: both run
    off.observe("vlm", 40, 40, 0.08)
    off.add(R("w", [1] * 6, 8, qos="realtime", model="whisper"))
    off.add(R("cap", [1] * 40, 8, qos="interactive", deadline_s=30.0, model="vlm"))
    assert sorted(p.request_id for p in off.schedule().prefills) == ["cap", "w"]
