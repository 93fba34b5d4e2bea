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
    assert [p.request.request_id for p in plan.prefills] == ["rt"]
    assert [e[0] for e in plan.preempted] == ["b2"]  # the most recently admitted batch request
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
    assert [p.request.request_id for p in plan.prefills] == ["rt"]
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
        return [(p.step, [(w.request.request_id, w.slot, len(w.tokens)) for w in p.prefills],
                 [(w.request.request_id, w.slot, w.node_budget, w.max_depth) for w in p.decodes],
                 p.released, p.preempted) for p in plans]

    assert shape(live.plans) == shape(sim.plans)
    assert live.preemptions == sim.preemptions >= 1
    assert {k: r.output_len for k, r in live.records.items()} == {k: r.output_len for k, r in sim.records.items()}
