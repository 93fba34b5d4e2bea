"""A deterministic simulator of the engine loop: a virtual clock, a cost model and a simulated executor.

The scheduler under test is the very class the live engine uses (:class:`~specstream.schedulers.qos.
QosScheduler`, or a baseline); only the executor is replaced by :class:`SimExecutor`, which commits tokens
according to each request's assumed draft ``acceptance`` and reports the tree sizes the executor's adaptive
budget (the same :class:`~specstream.schedulers.budget.AdaptiveBudget`) would ask for. Time
advances by :meth:`CostModel.plan_s` per step. :func:`replay` drives any ``step()`` — the simulator's or the
live engine's — over a trace on a virtual clock, so one trace gives comparable plans in both.

CLI contract (keep stable): ``specstream simulate --trace TRACE.jsonl [--config CONFIG] --json`` prints
``{"classes": {"realtime"|"interactive"|"batch": {"completed", "rejected", "p50_ms", "p99_ms",
"slo_attainment"}}, "max_wait_ms", "preemptions", "peak_kv_fraction"}``. Trace lines: ``{"t_ms", "id", "qos",
"deadline_ms", "images", "audio_s", "prompt_tokens", "max_new_tokens", "acceptance", "model"}`` (``prompt_tokens``
is the whole prefill: text plus visual tokens; ``model`` is optional, ``"default"`` when absent). Latency is
arrival to last token; ``slo_attainment`` = finished within deadline / (completed + rejected).

The simulator models the device loop: several models (``SimConfig.models``: each its slots and context length,
and its own cost terms), one plan per step over all of them, each model with rows running its own forward, and
chunked prefills.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from specstream.errors import CapacityError, UnreadableSourceError, error_line
from specstream.schedulers.baselines import FifoEncodeScheduler, StaticBatchScheduler
from specstream.schedulers.costmodel import CostModel, EncodeCost, SpecGate, StepCostFit, get_profile
from specstream.schedulers.plan import (
    QOS_CLASSES,
    DecodeWork,
    EncodeItem,
    EncodeResult,
    Request,
    RequestSpec,
    RequestStepResult,
    StepOutput,
    StepPlan,
)
from specstream.schedulers.qos import QosConfig, QosScheduler


class VirtualClock:
    """Seconds on a simulated clock; callable like ``time.monotonic``."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("the clock only moves forward")
        self.now += seconds


@dataclass(frozen=True)
class TraceEvent:
    """One trace line (see the module docstring); times in ms as in the file."""

    t_ms: float
    id: str
    qos: str
    deadline_ms: float
    prompt_tokens: int
    max_new_tokens: int
    images: int = 0
    audio_s: float = 0.0
    acceptance: float = 0.0
    model: str = "default"

    @classmethod
    def from_dict(cls, d: dict) -> "TraceEvent":
        missing = {"t_ms", "id", "qos", "deadline_ms", "prompt_tokens", "max_new_tokens"} - set(d)
        if missing:
            raise ValueError(f"trace line {d.get('id', '?')!r} lacks {sorted(missing)}")
        ev = cls(float(d["t_ms"]), str(d["id"]), str(d["qos"]), float(d["deadline_ms"]), int(d["prompt_tokens"]),
                 int(d["max_new_tokens"]), int(d.get("images", 0)), float(d.get("audio_s", 0.0)),
                 float(d.get("acceptance", 0.0)), str(d.get("model", "default")))
        if ev.qos not in QOS_CLASSES:
            raise ValueError(f"trace line {ev.id!r}: unknown qos {ev.qos!r}")
        if ev.prompt_tokens < 1 or ev.max_new_tokens < 1 or not 0.0 <= ev.acceptance <= 1.0:
            raise ValueError(f"trace line {ev.id!r}: need prompt_tokens, max_new_tokens >= 1, acceptance in [0, 1]")
        return ev

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def encodes(self) -> tuple[EncodeItem, ...]:
        items = tuple(EncodeItem(f"{self.id}/img{i}", "image", 1.0) for i in range(self.images))
        if self.audio_s > 0:
            items += (EncodeItem(f"{self.id}/audio", "audio", self.audio_s),)
        return items

    def request(self, prompt_ids: list[int] | None = None) -> Request:
        """The scheduler-side request (arrival and deadline on the trace's clock, seconds)."""
        t = self.t_ms / 1000.0
        ids = prompt_ids if prompt_ids is not None else [1] * self.prompt_tokens
        return Request(self.id, ids, self.max_new_tokens, qos=self.qos, deadline_s=t + self.deadline_ms / 1000.0,
                       arrival_s=t, encodes=self.encodes(), model=self.model)


def load_trace(path: str | Path) -> list[TraceEvent]:
    """Read a JSONL trace (blank lines and ``#`` comments skipped), sorted by arrival (stable).

    Raises:
        ValueError: naming ``path:line``, for a line that is not a JSON object, lacks or mistypes a field, or
            repeats an earlier line's ``id``.
    """
    events = []
    seen: set[str] = set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            d = json.loads(line)
            if not isinstance(d, dict):
                raise ValueError(f"expected a JSON object, got {type(d).__name__}")
            ev = TraceEvent.from_dict(d)
            if ev.id in seen:
                raise ValueError(f"duplicate request id {ev.id!r}")
        except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError; TypeError: null fields
            raise ValueError(f"{path}:{n}: {exc}") from None
        seen.add(ev.id)
        events.append(ev)
    return sorted(events, key=lambda e: e.t_ms)


def tree_shape(widths: tuple[int, ...], node_budget: int, max_depth: int) -> tuple[int, int]:
    """(nodes, depth of the first path) of a static tree with ``widths`` per depth, kept breadth-first up to
    ``node_budget`` nodes (root included) and ``max_depth`` — what ``TokenTree.truncated`` keeps."""
    nodes, depth, level = 1, 0, 1
    for d, w in enumerate(widths, 1):
        if d > max_depth or nodes >= node_budget:
            break
        level *= w
        take = min(level, node_budget - nodes)
        nodes += take
        depth = d
    return nodes, depth


class SimExecutor:
    """Executes plans on paper: a draft of per-token acceptance ``a`` accepts ``a + a^2 + ... + a^d`` tokens of a
    depth-``d`` tree on average (deterministic: a per-request fractional carry), plus the bonus token.

    Mirrors :class:`~specstream.stages.speculative.executor.SpeculativeExecutor`'s bookkeeping: commit limits
    (``remaining``, ``max_len``), root-only steps when the node budget is 1, and the adaptive tree size asked for
    next step. Tracks per-slot KV lengths and the peak KV tokens held (``peak_kv_tokens``).

    With ``spec_gate`` it also makes the live executor's step-level decision
    (:class:`~specstream.schedulers.costmodel.SpecGate`) from costs it *measures* as the live one does: each
    step's target seconds (``cost.target_s``, this one cost model: a one-model simulation) go into a
    :class:`StepCostFit`, the draft seconds per level into a moving average, and the gate cuts or drops the
    plan's trees before they run. ``last_step_s`` is the seconds of the plan as executed.
    """

    def __init__(self, cost: CostModel, acceptance: dict[str, float], max_len: int,
                 tree_widths: tuple[int, ...] = (1, 1, 3, 1, 1, 1, 1, 1), full_nodes: int | None = None,
                 adaptive: bool = True, spec_gate: bool = False):
        from specstream.schedulers.budget import AdaptiveBudget

        self._budget_cls = AdaptiveBudget
        self.cost = cost
        self.acceptance = acceptance
        self.max_len = max_len
        self.tree_widths = tuple(tree_widths)
        self.full_nodes = full_nodes or tree_shape(self.tree_widths, 10**9, 10**9)[0]
        self.adaptive = adaptive
        self._carry: dict[str, float] = {}
        self._budgets: dict = {}
        #: per admitted request: its spec (:attr:`StepPlan.admitted`) and the tokens committed so far (this
        #: runner's own count; the scheduler's ``Request`` is never read)
        self._specs: dict[str, RequestSpec] = {}
        self._committed: dict[str, int] = {}
        self.lengths: dict[int, int] = {}
        self.peak_kv_tokens = 0
        #: nodes of the tree cut after each depth, root included (what the gate's cuts keep)
        self.depth_nodes = tuple(tree_shape(self.tree_widths, 10**9, d)[0] for d in range(len(self.tree_widths) + 1))
        self.gate: SpecGate | None = SpecGate() if spec_gate and adaptive else None
        self.verify_fit = StepCostFit()
        self._verify_line: tuple[float, float] | None = None
        self._level_s: float | None = None
        #: per request: committed tokens its draft has read (the live draft's KV cache length)
        self._seen: dict[str, int] = {}
        self._drafted_once = False
        #: tokens the drafts read to catch up (prompts, tokens of steps without drafts), over the run
        self.catch_up_tokens = 0
        self.last_step_s = 0.0
        #: steps whose decodes verified at least one tree, and steps with decodes
        self.drafted_steps = 0
        self.decode_steps = 0

    def _budget(self, rid: str):
        if rid not in self._budgets:
            self._budgets[rid] = self._budget_cls(full_nodes=self.full_nodes)
        return self._budgets[rid]

    def _gated(self, plan: StepPlan) -> StepPlan:
        """``plan`` with its trees cut by the gate, as the live executor's ``_gate_step`` (its warm-up until both
        costs were measured; each row's catch-up read, the tokens its draft has not seen at
        ``CostModel.draft_read_token_s`` each, weighed)."""
        if self.gate is None or not plan.decodes:
            return plan
        alphas = self.gate.row_alphas([self._budget(w.request_id).measured_alpha for w in plan.decodes])
        rows = [(w.node_budget if self._specs[w.request_id].speculate else 1, w.max_depth, a)
                for w, a in zip(plan.decodes, alphas)]
        lags = [self._lag(w) for w in plan.decodes]
        if self._verify_line is None or self._level_s is None:
            choice = self.gate.warmup(rows, self.depth_nodes, lags)
        else:
            fixed, per_token = self._verify_line
            token_s = self.cost.draft_read_token_s if self._drafted_once else per_token
            catch_up = [(lag * token_s, max(0, self._specs[w.request_id].max_new_tokens - self._committed[w.request_id]))
                        for w, lag in zip(plan.decodes, lags)]
            extra = sum(p.num_tokens for p in plan.prefills)
            choice = self.gate.decide(rows, fixed, per_token, self._level_s, self.depth_nodes, extra, catch_up)
        return replace(plan, decodes=self.gate.cut(plan.decodes, choice, self.depth_nodes))

    def _lag(self, work: DecodeWork) -> int:
        """Tokens the request's draft has not read, beyond the newest (its prompt before its first draft)."""
        return max(0, work.context_len - 1 - self._seen.get(work.request_id, 0))

    def _measure(self, plan: StepPlan) -> None:
        """Book the executed plan's target and draft seconds, as the live executor measures its own."""
        rows = len(plan.prefills) + len(plan.decodes)
        if not rows:
            return
        tokens = plan.num_nodes
        kv = sum(d.context_len for d in plan.decodes)
        self.verify_fit.observe(tokens, self.cost.target_s(rows, tokens, kv))
        line = self.verify_fit.line()
        if line is not None:
            self._verify_line = line
        elif self._verify_line is None:  # no slope yet (or none: a memory-bound forward): flat, the mean step
            self._verify_line = (self.verify_fit.mean_s(), 0.0)
        spec = [d for d in plan.decodes
                if d.node_budget > 1 and d.max_depth > 0 and self._specs[d.request_id].speculate]
        if spec:
            depth = max(tree_shape(self.tree_widths, d.node_budget, d.max_depth)[1] for d in spec)
            if depth:
                level = self.cost.draft_s(depth, sum(d.node_budget - 1 for d in spec)) / depth
                self._level_s = level if self._level_s is None else 0.8 * self._level_s + 0.2 * level

    def execute(self, plan: StepPlan) -> StepOutput:
        for rid, slot in ((r.request_id, r.slot) for r in plan.released):
            self.lengths.pop(slot, None)
            self._carry.pop(rid, None)
            self._budgets.pop(rid, None)
            self._specs.pop(rid, None)
            self._committed.pop(rid, None)
            self._seen.pop(rid, None)
        for rid, slot in ((r.request_id, r.slot) for r in plan.preempted):
            self.lengths.pop(slot, None)
            self._seen.pop(rid, None)  # the draft's slot is reset: it reads the whole context again
        for spec in plan.admitted:  # new, or resumed after a preemption (its committed tokens come with it)
            self._specs[spec.request_id] = spec
            self._committed[spec.request_id] = len(spec.committed)
        plan = self._gated(plan)
        encoded = tuple(EncodeResult(rid, item.item_id) for w in plan.encodes for rid, item in w.items)
        results = []
        peak = sum(self.lengths.values())
        for work in plan.prefills:
            self.lengths[work.slot] = work.start + work.num_tokens
            peak += work.num_tokens
            if work.final:
                results.append(self._commit(work.request_id, 0, 0, True))
            else:  # a chunk of a longer prefill: cached, nothing committed yet
                results.append(RequestStepResult(work.request_id, is_prefill=True, prefill_done=False))
        drafted = False
        catch_up_s = 0.0
        for work in plan.decodes:
            rid = work.request_id
            peak += work.node_budget
            nodes, depth = 1, 0
            if work.node_budget > 1 and work.max_depth > 0 and self._specs[rid].speculate:
                nodes, depth = tree_shape(self.tree_widths, work.node_budget, work.max_depth)
                drafted = drafted or depth > 0
            if depth > 0:  # the draft first reads what it has not seen (one batched forward with the level's)
                lag = self._lag(work)
                self.catch_up_tokens += lag
                catch_up_s += lag * self.cost.models.get(work.model, self.cost).draft_read_token_s
                self._drafted_once = True
            a = self.acceptance.get(rid, 0.0)
            expected = sum(a ** k for k in range(1, depth + 1))
            carry = self._carry.get(rid, 0.0) + expected
            accepted = min(depth, int(math.floor(carry + 1e-9)))
            self._carry[rid] = carry - accepted
            results.append(self._commit(rid, accepted, nodes, False, work.slot, depth))
            if depth > 0:  # read up to the root, then the accepted nodes are kept in its cache (the bonus is not)
                self._seen[rid] = work.context_len + results[-1].num_accepted
        if plan.decodes:
            self.decode_steps += 1
            self.drafted_steps += drafted
        self.peak_kv_tokens = max(self.peak_kv_tokens, peak)
        rows = len(plan.prefills) + len(plan.decodes)
        self.last_step_s = self.cost.plan_s(plan) + catch_up_s
        if self.gate is not None:
            self._measure(plan)
        return StepOutput(plan.step, tuple(results), 1 if rows else 0, plan.num_nodes, self.last_step_s, encoded)

    def _commit(self, rid: str, accepted: int, tree_nodes: int, is_prefill: bool,
                slot: int | None = None, depth: int | None = None) -> RequestStepResult:
        spec, done = self._specs[rid], self._committed[rid]
        limit = min(spec.max_new_tokens - done, self.max_len - len(spec.prompt_ids) - done)
        n = min(accepted + 1, limit)
        self._committed[rid] = done + n
        num_accepted = min(accepted, n)
        reason = "length" if n >= limit else None
        if not is_prefill:
            self.lengths[slot] = self.lengths.get(slot, 0) + 1 + num_accepted
        requested = 1
        if spec.speculate:
            budget = self._budget(rid)
            if not is_prefill:
                budget.observe(num_accepted, tree_nodes if tree_nodes else 1, depth)
                if self.gate is not None and depth:
                    self.gate.observe(num_accepted, depth)
            requested = budget.requested_nodes() if self.adaptive else self.full_nodes
        return RequestStepResult(rid, (0,) * n, num_accepted, is_prefill, reason, None, requested)


# -- the driver -----------------------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    """What happened to one trace request (times in seconds on the virtual clock)."""

    id: str
    qos: str
    arrival_s: float
    deadline_s: float  # relative
    rejected: bool = False
    finish_s: float | None = None
    first_prefill_s: float | None = None
    preemptions: int = 0
    output_len: int = 0

    @property
    def latency_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass
class ReplayResult:
    records: dict[str, RequestRecord]
    plans: list[StepPlan]
    steps: int
    end_s: float
    preemptions: int
    peak_kv_fraction: float
    max_wait_s: float
    outputs: dict[str, list[int]] = field(default_factory=dict)
    sim_peak_kv_tokens: int = 0  # KV tokens held + written at the busiest step, as SimExecutor saw them
    executor: object = None  # the SimExecutor that ran the plans (its gate counts, drafted steps)


def replay(events: list[TraceEvent], scheduler, step: Callable[[], list[Request]], clock: VirtualClock,
           cost: CostModel, submit: Callable[[TraceEvent], Request] | None = None, keep_plans: bool = False,
           max_steps: int = 10_000_000, step_s: Callable[[StepPlan], float] | None = None) -> ReplayResult:
    """Drive ``step()`` over ``events`` on ``clock``: arrivals are submitted when the clock reaches them; each step
    advances the clock by ``cost.plan_s(scheduler.last_plan)``; idle time jumps to the next arrival or the
    scheduler's next due encode batch.

    Args:
        scheduler: exposes ``add``, ``has_work``, ``last_plan``, ``next_event_s``, ``pop_finished``.
        step: one engine step (schedule, execute, update); returns the requests that finished.
        submit: builds and queues the request for an event (default: ``scheduler.add(event.request())``);
            may raise :class:`CapacityError`, which records a rejection.
        step_s: seconds the step just run took, given the scheduler's plan (default ``cost.plan_s``; the
            simulator passes the seconds of the plan as its executor ran it, trees cut by the gate).

    Raises:
        RuntimeError: the scheduler holds work but plans nothing and expects no event (a stall: a bug).
    """
    pending = list(events)
    pending.reverse()
    records: dict[str, RequestRecord] = {}
    plans: list[StepPlan] = []
    outputs: dict[str, list[int]] = {}
    steps = 0
    max_wait = 0.0

    def default_submit(ev: TraceEvent) -> Request:
        req = ev.request()
        scheduler.add(req)
        return req

    submit = submit or default_submit
    while pending or scheduler.has_work():
        while pending and pending[-1].t_ms / 1000.0 <= clock.now + 1e-12:
            ev = pending.pop()
            rec = RequestRecord(ev.id, ev.qos, ev.t_ms / 1000.0, ev.deadline_ms / 1000.0)
            records[ev.id] = rec
            try:
                submit(ev)
            except CapacityError:
                rec.rejected = True
        if not scheduler.has_work():
            if pending:
                clock.now = max(clock.now, pending[-1].t_ms / 1000.0)
            continue
        finished = step()
        plan = scheduler.last_plan
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"replay exceeded {max_steps} steps")
        if keep_plans:
            plans.append(plan)
        for p in plan.prefills:
            rec = records[p.request_id]
            if rec.first_prefill_s is None:
                rec.first_prefill_s = clock.now
        dt = cost.plan_s(plan) if step_s is None else step_s(plan)
        clock.advance(dt)
        for req in finished:
            rec = records[req.request_id]
            rec.finish_s = clock.now
            rec.preemptions = req.preemptions
            rec.output_len = len(req.output_ids)
            outputs[req.request_id] = list(req.output_ids)
            waits = scheduler.queue_waits(req.request_id) if hasattr(scheduler, "queue_waits") else []
            if not waits and rec.first_prefill_s is not None:
                waits = [rec.first_prefill_s - rec.arrival_s]
            max_wait = max([max_wait] + waits)
            scheduler.pop_finished(req.request_id)
        if plan.empty:
            nxt = [t for t in (pending[-1].t_ms / 1000.0 if pending else None, scheduler.next_event_s())
                   if t is not None and t > clock.now]
            if not nxt and not plan.released and not plan.preempted:
                raise RuntimeError(f"scheduler stalled at t={clock.now:.6f}s with work queued")
            if nxt:
                clock.now = min(nxt)
    return ReplayResult(records, plans, steps, clock.now, scheduler.preemptions, scheduler.peak_kv_fraction,
                        max_wait, outputs)


# -- configuration and summary --------------------------------------------------------------------------------
@dataclass
class SimConfig:
    """Simulator configuration (a JSON file for ``--config``; every key optional).

    Keys: ``policy`` (``"qos"`` | ``"fifo"`` | ``"static"``), ``scheduler`` (:class:`QosConfig` keys; its
    ``models`` give each model's slots and context length), ``cost_profile`` (``"cpu-2core"`` | ``"h200-est"``),
    ``cost`` (overrides of :class:`CostModel` fields; ``encoders`` as ``{modality: {fixed_s, per_quantum_s,
    quantum}}``; ``models`` as ``{model: {cost_profile, ...overrides}}``: each model's own forward cost),
    ``tree_widths``, ``full_nodes``, ``adaptive``, ``spec_gate`` (the executor's step-level speculation decision
    from measured costs, :class:`SimExecutor`; default off, as in acceptance-only executors), ``static_batch_size``,
    ``static_max_wait_s``.
    """

    policy: str = "qos"
    scheduler: QosConfig = field(default_factory=QosConfig)
    cost: CostModel = field(default_factory=lambda: get_profile("cpu-2core"))
    tree_widths: tuple[int, ...] = (1, 1, 3, 1, 1, 1, 1, 1)
    full_nodes: int | None = None
    adaptive: bool = True
    spec_gate: bool = False
    static_batch_size: int = 8
    static_max_wait_s: float = 0.05

    @classmethod
    def from_dict(cls, d: dict) -> "SimConfig":
        d = dict(d)
        known = {"policy", "scheduler", "cost_profile", "cost", "tree_widths", "full_nodes", "adaptive",
                 "spec_gate", "static_batch_size", "static_max_wait_s"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown simulator config keys: {sorted(unknown)}")
        cost = get_profile(d.get("cost_profile", "cpu-2core"))
        overrides = dict(d.get("cost", {}))
        if "models" in overrides:
            per_model = {}
            for name, m in overrides.pop("models").items():
                m = dict(m)
                per_model[name] = get_profile(m.pop("cost_profile", cost.name)).with_(**m)
            overrides["models"] = per_model
        if "encoders" in overrides:
            encs = dict(cost.encoders)
            encs.update({m: EncodeCost(**v) for m, v in overrides.pop("encoders").items()})
            overrides["encoders"] = encs
        cost = cost.with_(**overrides)
        cfg = cls(policy=d.get("policy", "qos"), scheduler=QosConfig.from_dict(d.get("scheduler", {})), cost=cost,
                  tree_widths=tuple(d.get("tree_widths", cls.tree_widths)), full_nodes=d.get("full_nodes"),
                  adaptive=bool(d.get("adaptive", True)), spec_gate=bool(d.get("spec_gate", False)),
                  static_batch_size=int(d.get("static_batch_size", 8)),
                  static_max_wait_s=float(d.get("static_max_wait_s", 0.05)))
        if cfg.policy not in ("qos", "fifo", "static"):
            raise ValueError(f"unknown policy {cfg.policy!r}")
        return cfg


def spec_token_limit(cost: CostModel, num_slots: int) -> int:
    """Decode tokens per step beyond which the target forward is compute-bound on ``cost``'s hardware (twice the
    tokens whose compute equals the fixed per-step cost), so trees should shrink; at least ``num_slots``."""
    return max(num_slots, int(2 * cost.step_fixed_s / max(cost.per_token_s, 1e-12)))


def make_scheduler(cfg: SimConfig, clock: Callable[[], float], metrics=None):
    """The scheduler ``cfg.policy`` names, sized by ``cfg.scheduler``."""
    q = cfg.scheduler
    full = cfg.full_nodes or tree_shape(cfg.tree_widths, 10**9, 10**9)[0]
    if cfg.policy == "qos":
        if q.spec_token_limit is None:
            q = replace(q, spec_token_limit=spec_token_limit(cfg.cost, q.num_slots))
        return QosScheduler(q, clock=clock, metrics=metrics)
    common = dict(max_nodes_per_request=min(full, q.max_nodes_per_request), token_budget=q.token_budget,
                  max_tree_depth=q.max_tree_depth, encode_max_batch=max(b.max_batch for b in q.encoders.values()),
                  clock=clock)
    if cfg.policy == "fifo":
        return FifoEncodeScheduler(q.num_slots, q.max_len, **common)
    return StaticBatchScheduler(q.num_slots, q.max_len, batch_size=cfg.static_batch_size,
                                max_wait_s=cfg.static_max_wait_s, **common)


def simulate(events: list[TraceEvent], cfg: SimConfig | None = None, keep_plans: bool = False,
             metrics=None) -> ReplayResult:
    """Run ``events`` through the configured scheduler and :class:`SimExecutor` on a virtual clock."""
    cfg = cfg or SimConfig()
    clock = VirtualClock(0.0)
    sched = make_scheduler(cfg, clock, metrics)
    ex = SimExecutor(cfg.cost, {e.id: e.acceptance for e in events}, cfg.scheduler.max_len, cfg.tree_widths,
                     cfg.full_nodes, cfg.adaptive, cfg.spec_gate)

    def step() -> list[Request]:
        plan = sched.schedule()
        return sched.update(ex.execute(plan))

    result = replay(events, sched, step, clock, cfg.cost, keep_plans=keep_plans, step_s=lambda _: ex.last_step_s)
    result.sim_peak_kv_tokens = ex.peak_kv_tokens
    result.executor = ex
    return result


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    idx = min(len(v) - 1, max(0, math.ceil(q / 100.0 * len(v)) - 1))  # nearest rank
    return v[idx]


def summarize(result: ReplayResult) -> dict:
    """The simulator's JSON object (contract in the module docstring)."""
    classes = {}
    for q in QOS_CLASSES:
        recs = [r for r in result.records.values() if r.qos == q]
        done = [r for r in recs if r.finish_s is not None]
        rejected = sum(1 for r in recs if r.rejected)
        lat = [r.latency_s * 1000.0 for r in done]
        met = sum(1 for r in done if r.latency_s <= r.deadline_s + 1e-12)
        denom = len(done) + rejected
        classes[q] = {"completed": len(done), "rejected": rejected, "p50_ms": round(_percentile(lat, 50), 3),
                      "p99_ms": round(_percentile(lat, 99), 3),
                      "slo_attainment": round(met / denom, 6) if denom else 1.0}
    return {"classes": classes, "max_wait_ms": round(result.max_wait_s * 1000.0, 3),
            "preemptions": int(result.preemptions), "peak_kv_fraction": round(float(result.peak_kv_fraction), 6)}


def load_config(path: str | Path | None) -> SimConfig:
    if path is None:
        return SimConfig()
    return SimConfig.from_dict(json.loads(Path(path).read_text()))


def simulate_main(argv: list[str]) -> int:
    """``specstream simulate --trace TRACE.jsonl [--config CONFIG] --json``; returns the exit status."""
    ap = argparse.ArgumentParser(prog="specstream simulate",
                                 description="Replay a request trace through the scheduler on a virtual clock.")
    ap.add_argument("--trace", required=True, type=Path, help="JSONL trace (one request per line)")
    ap.add_argument("--config", type=Path, help="JSON simulator config (see docs/scheduler.md)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = ap.parse_args(argv)
    try:
        events = load_trace(args.trace)
        cfg = load_config(args.config)
    except OSError as exc:  # a trace or config that cannot be read: unreadable_source, as on every command
        print(error_line(UnreadableSourceError.code, f"{exc.filename}: {exc.strerror}", as_json=args.json),
              file=sys.stderr)
        return 2
    except ValueError as exc:
        print(error_line("invalid_request", str(exc), as_json=args.json), file=sys.stderr)
        return 2
    summary = summarize(simulate(events, cfg))
    if args.json:
        print(json.dumps(summary))
    else:
        for q, c in summary["classes"].items():
            print(f"{q:12s} completed {c['completed']:6d}  rejected {c['rejected']:5d}  p50 {c['p50_ms']:9.1f} ms"
                  f"  p99 {c['p99_ms']:9.1f} ms  SLO {c['slo_attainment']:.3f}")
        print(f"max wait {summary['max_wait_ms']:.1f} ms, preemptions {summary['preemptions']}, "
              f"peak KV {summary['peak_kv_fraction']:.3f}")
    return 0

