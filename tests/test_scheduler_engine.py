"""The QoS scheduler in the live engine on tiny random checkpoints: preemption keeps outputs unchanged, a
realtime arrival starts within one step, and one trace gives the same plans live and in the simulator."""

from __future__ import annotations

import pytest

from specstream.schedulers.costmodel import CPU_2CORE
from specstream.schedulers.plan import Request
from specstream.schedulers.qos import QosConfig, QosScheduler
from specstream.schedulers.simulator import SimConfig, TraceEvent, VirtualClock, replay, simulate
from specstream.stages.speculative.drafters.model import TreeSpec
from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
from specstream.stages.speculative.models.tiny import (
    TinyDecoderSpec,
    build_tiny_decoder,
    random_decoder_state,
    save_checkpoint,
)

SPEC = TinyDecoderSpec(max_position_embeddings=256)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = build_tiny_decoder(root / "target", SPEC, seed=3)
    same = save_checkpoint(root / "same", SPEC.config_dict(), random_decoder_state(SPEC, 3))  # full acceptance
    noisy = build_tiny_decoder(root / "noisy", SPEC, seed=5, noise_from=random_decoder_state(SPEC, 3), noise=0.6)
    return target, same, noisy


def _engine(ckpts, draft, qos: QosConfig | None, widths="1,1,3,1", clock=None):
    target, same, noisy = ckpts
    d = {"same": same, "noisy": noisy}[draft]
    cfg = EngineConfig(num_slots=qos.num_slots if qos else 8, max_len=128, tree=TreeSpec.parse(widths))
    engine = SpeculativeEngine.from_checkpoints(target, drafts=[d], config=cfg)
    if qos is not None:
        engine.scheduler = QosScheduler(qos, clock=clock or VirtualClock())
    return engine


def _prompt(i: int, n: int = 12) -> list[int]:
    return [(7 * i + 3 * k + 1) % 256 for k in range(n)]


def test_preempted_and_resumed_output_is_unchanged(ckpts):
    # uninterrupted reference: plain FIFO engine, greedy
    ref = _engine(ckpts, "noisy", None).generate([_prompt(i) for i in range(3)], max_new_tokens=40)
    clock = VirtualClock()
    qos = QosConfig(num_slots=3, max_len=128, reserved_realtime_slots=0, token_budget=256)
    engine = _engine(ckpts, "noisy", qos, clock=clock)
    batch = [engine.add_request(engine.make_request(_prompt(i), 40, request_id=f"b{i}", qos="batch"))
             for i in range(3)]
    for _ in range(3):
        engine.step()
    rt = engine.add_request(engine.make_request(_prompt(9), 6, request_id="rt", qos="realtime"))
    engine.step()
    plan = engine.scheduler.last_plan
    assert [p.request_id for p in plan.prefills] == ["rt"]
    assert [e.request_id for e in plan.preempted] == ["b2"]  # the most recently admitted batch request
    engine.run()
    assert batch[2].preemptions == 1 and rt.finish_reason == "length"
    for got, want in zip(batch, ref):
        assert got.output_ids == want.output_ids


def test_realtime_arrival_starts_within_one_step(ckpts):
    clock = VirtualClock()
    qos = QosConfig(num_slots=9, max_len=128, reserved_realtime_slots=1, token_budget=512)
    engine = _engine(ckpts, "same", qos, clock=clock)
    for i in range(8):
        engine.add_request(engine.make_request(_prompt(i), 60, request_id=f"b{i}", qos="batch"))
    engine.step()
    engine.step()
    assert len(engine.scheduler.running) == 8
    rt = engine.add_request(engine.make_request(_prompt(20), 8, request_id="rt", qos="realtime"))
    engine.step()
    plan = engine.scheduler.last_plan
    assert [p.request_id for p in plan.prefills] == ["rt"]
    assert len(plan.decodes) == 8 and not plan.preempted  # the reserved slot, nobody preempted
    assert len(rt.output_ids) == 1
    engine.step()
    assert len(rt.output_ids) > 1


def test_live_engine_and_simulator_make_the_same_plans(ckpts):
    """Same trace, same scheduler class, same virtual clock: the real executor (draft = target weights, so
    every draft token is accepted) and the simulator (acceptance 1.0) must yield identical plans."""
    events = [TraceEvent(t_ms=t, id=f"{q}{i}", qos=q, deadline_ms=d, prompt_tokens=p, max_new_tokens=m,
                         acceptance=1.0)
              for i, (t, q, d, p, m) in enumerate([
                  (0, "batch", 60000, 20, 70), (0, "batch", 60000, 14, 60), (5, "interactive", 2000, 10, 12),
                  (10, "batch", 60000, 30, 60), (60, "realtime", 300, 8, 6), (61, "batch", 60000, 12, 18),
                  (90, "interactive", 1000, 16, 10), (150, "realtime", 300, 9, 5)])]
    qos = QosConfig(num_slots=4, max_len=128, reserved_realtime_slots=0, token_budget=160, max_nodes_per_request=6,
                    spec_token_limit=14)
    widths = "1,1,1,1,1"
    sim = simulate(events, SimConfig(scheduler=qos, cost=CPU_2CORE, tree_widths=(1, 1, 1, 1, 1)), keep_plans=True)

    clock = VirtualClock()
    engine = _engine(ckpts, "same", qos, widths=widths, clock=clock)
    engine.executor.cost_aware = False  # timing-dependent tree sizes would differ from the simulator's

    def submit(ev: TraceEvent) -> Request:
        req = ev.request(prompt_ids=_prompt(len(ev.id) + int(ev.t_ms), ev.prompt_tokens))
        return engine.add_request(req)

    live = replay(events, engine.scheduler, engine.step, clock, CPU_2CORE, submit=submit, keep_plans=True)

    def shape(plans):
        return [(p.step, [(w.request_id, w.slot, w.num_tokens) for w in p.prefills],
                 [(w.request_id, w.slot, w.node_budget, w.max_depth) for w in p.decodes],
                 p.released, p.preempted) for p in plans]

    assert shape(live.plans) == shape(sim.plans)
    assert live.preemptions == sim.preemptions >= 1
    assert {k: r.output_len for k, r in live.records.items()} == {k: r.output_len for k, r in sim.records.items()}


def test_device_loop_with_two_models_and_chunked_prefill_makes_the_simulators_plans(ckpts):
    """Two models in one device loop (their own slots; one plan per step over both), chunked prefills while
    realtime work waits: the live loop and the simulator make identical plans for the same trace."""
    from specstream.schedulers.qos import ModelLimits
    from specstream.stages.device_loop import DeviceLoop, ModelRunner
    from specstream.stages.speculative.drafters.model import ModelDrafter
    from specstream.stages.speculative.executor import SpeculativeExecutor
    from specstream.stages.speculative.models.loader import load_decoder

    target, same, _ = ckpts
    events = [TraceEvent(t_ms=t, id=f"{m}-{q}{i}", qos=q, deadline_ms=d, prompt_tokens=p, max_new_tokens=n,
                         acceptance=1.0, model=m)
              for i, (t, m, q, d, p, n) in enumerate([
                  (0, "a", "batch", 60000, 90, 30), (0, "b", "interactive", 2000, 60, 20),
                  (5, "a", "realtime", 300, 8, 6), (10, "b", "batch", 60000, 100, 25),
                  (40, "b", "realtime", 300, 9, 5), (60, "a", "interactive", 2000, 20, 12)])]
    models = {"a": ModelLimits(num_slots=2, max_len=128), "b": ModelLimits(num_slots=3, max_len=128)}
    qos = QosConfig(models=models, token_budget=160, max_nodes_per_request=5, max_prefill_chunk_tokens=32,
                    spec_token_limit=20)
    sim = simulate(events, SimConfig(scheduler=qos, cost=CPU_2CORE, tree_widths=(1, 1, 1, 1)), keep_plans=True)

    clock = VirtualClock()
    runners = []
    for name, lim in models.items():
        drafter = ModelDrafter(load_decoder(same), lim.num_slots, lim.max_len, TreeSpec.parse("1,1,1,1"), 256, 256)
        ex = SpeculativeExecutor(load_decoder(target), [drafter], lim.num_slots, lim.max_len, full_nodes=5)
        ex.cost_aware = False  # timing-dependent tree sizes would differ from the simulator's
        runners.append(ModelRunner(name, ex, max_len=lim.max_len))
    loop = DeviceLoop(runners, QosScheduler(qos, clock=clock))

    def submit(ev: TraceEvent) -> Request:
        req = ev.request(prompt_ids=_prompt(len(ev.id) + int(ev.t_ms), ev.prompt_tokens))
        return loop.add_request(req)

    live = replay(events, loop.scheduler, loop.step, clock, CPU_2CORE, submit=submit, keep_plans=True)

    def shape(plans):
        return [(p.step, [(w.request_id, w.slot, w.start, w.num_tokens) for w in p.prefills],
                 [(w.request_id, w.slot, w.node_budget, w.max_depth) for w in p.decodes],
                 p.released, p.preempted) for p in plans]

    assert shape(live.plans) == shape(sim.plans)
    chunked = [w for p in live.plans for w in p.prefills if not w.final]
    assert chunked, "no prefill was chunked"
    mixed = [p for p in live.plans if {w.model for w in p.prefills + p.decodes} == {"a", "b"}]
    assert mixed, "the two models never ran in the same step"
    assert {k: r.output_len for k, r in live.records.items()} == {k: r.output_len for k, r in sim.records.items()}
    assert all(r.output_len == ev.max_new_tokens for ev, r in zip(events, (live.records[e.id] for e in events)))


def _two_model_loop(ckpts, models, qos, clock):
    from specstream.stages.device_loop import DeviceLoop, ModelRunner
    from specstream.stages.speculative.drafters.model import ModelDrafter
    from specstream.stages.speculative.executor import SpeculativeExecutor
    from specstream.stages.speculative.models.loader import load_decoder

    target, _, noisy = ckpts
    runners = []
    for name, lim in models.items():
        drafter = ModelDrafter(load_decoder(noisy), lim.num_slots, lim.max_len, TreeSpec.parse("1,1,3,1"), 256, 256)
        ex = SpeculativeExecutor(load_decoder(target), [drafter], lim.num_slots, lim.max_len, full_nodes=9)
        runners.append(ModelRunner(name, ex, max_len=lim.max_len))
    return DeviceLoop(runners, QosScheduler(qos, clock=clock))


def test_preemption_across_models_leaves_outputs_unchanged(ckpts):
    """One memory budget over two models: a realtime request of model b preempts a batch request of model a for
    memory; the batch request resumes (recompute) and its output equals an uninterrupted run's."""
    from specstream.schedulers.qos import ModelLimits

    ref = _engine(ckpts, "noisy", None).generate([_prompt(i, 40) for i in range(2)], max_new_tokens=40)
    models = {"a": ModelLimits(num_slots=2, max_len=128, kv_bytes_per_token=100),
              "b": ModelLimits(num_slots=2, max_len=128, kv_bytes_per_token=100)}
    qos = QosConfig(models=models, token_budget=512, memory_budget_bytes=100 * 125, kv_high_watermark=1.0,
                    max_prefill_chunk_tokens=None)
    clock = VirtualClock()
    loop = _two_model_loop(ckpts, models, qos, clock)
    batch = [loop.add_request(loop.runners["a"].make_request(_prompt(i, 40), 40, request_id=f"b{i}", qos="batch"))
             for i in range(2)]
    for _ in range(3):
        loop.step()
    rt = loop.add_request(loop.runners["b"].make_request(_prompt(9, 30), 20, request_id="rt", qos="realtime"))
    loop.step()
    plan = loop.scheduler.last_plan
    assert [p.request_id for p in plan.prefills] == ["rt"]
    assert [e.request_id for e in plan.preempted] == ["b1"] and plan.preempted[0].model == "a"  # another model's memory
    loop.run()
    assert batch[1].preemptions == 1 and rt.finish_reason == "length" and len(rt.output_ids) == 20
    for got, want in zip(batch, ref):
        assert got.output_ids == want.output_ids


def test_text_only_and_image_requests_share_one_vlm_forward(tmp_path):
    """A text-only request and an image request to the same VLM runner are rows of one forward."""
    from specstream.modalities.image import load_image
    from specstream.pipeline.defaults import default_caption_models
    from specstream.stages.caption import Captioner
    import skimage.data

    target, _ = default_caption_models(quiet=True)
    cap = Captioner(target, [], temporal=False, visual_aware=False)
    runner, loop = cap.runner, cap.loop
    prep = cap.vlm.prepare(skimage.data.astronaut(), "Describe this image.")
    image_req = cap.make_request(prep, 24)
    text_ids = cap.vlm.tokenizer("A sentence about keyframes.")["input_ids"]
    text_req = runner.make_request(text_ids, 12)
    for r in (image_req, text_req):
        r.eos_token_ids = ()  # untrained weights: keep both going to their length
    loop.add_request(image_req)
    while not image_req.output_ids:  # its image is encoded and prefilled
        loop.step()
    loop.add_request(text_req)
    shared = 0
    while loop.has_work():
        before = runner.executor.target_forwards
        loop.step()
        plan = loop.scheduler.last_plan
        rows = {w.request_id for w in plan.prefills + plan.decodes}
        if rows == {image_req.request_id, text_req.request_id}:
            assert runner.executor.target_forwards - before == 1  # both rows in one VLM forward
            shared += 1
    assert shared >= 10, shared
    assert len(image_req.output_ids) == 24 and len(text_req.output_ids) == 12
