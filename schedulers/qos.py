"""The cross-modality QoS scheduler: one plan per device step for encode batches, prefills and
speculative decode steps of every request, with QoS classes, deadlines, a token budget and a KV memory budget.

Policy, in the order :meth:`QosScheduler.schedule` applies it:

1. **Encode batches** per modality: items wait in a priority queue (class, then deadline); a batch runs when a
   ``realtime`` item is queued, when ``max_batch`` items are queued, or when the oldest has waited
   ``max_delay_s``. While higher-class work exists, ``batch``-class items take at most ``batch_share`` of a
   batch, so a flood of batch keyframes cannot delay subtitles.
2. **Preemption**: a waiting ``realtime`` request that finds no slot (or no KV memory) preempts ``batch``
   requests, most recently admitted first; their KV cache is freed and recomputed when they resume (prefill of
   prompt + output so far), so their output is unchanged. Memory overflow preempts the lowest class, most
   recently (first) admitted first. A request is never preempted for one of its own class, and a resumed request
   keeps its first admission rank, so equal-priority requests never trade places back and forth.
3. **Decodes**: every running request verifies at least its root token each step (continuous batching).
4. **Admission** (prefills) in priority order: ``realtime`` > ``interactive`` > ``batch``, earliest deadline
   first within a class. A ``batch`` request that has waited ``aging_s`` ranks as ``interactive`` with deadline
   ``arrival + aging_s`` (aging moves work between interactive and batch only). ``reserved_realtime_slots`` slots
   are for ``realtime`` only. Above ``kv_high_watermark`` of the KV budget only ``realtime`` is admitted.
5. **Tree budgets**: what is left of the token budget grows trees up to what each request's drafters ask for,
   highest class first; ``batch`` keeps ``batch_share`` of the budget when it has work. Trees shrink (batch's
   first) when the step would verify more than ``spec_token_limit`` tokens (the forward turns compute-bound and
   speculation stops paying) and, above the KV high watermark, non-realtime trees shrink to the root only.
   Low acceptance switches speculation off per request in the executor's adaptive budget
   (``requested_nodes``), which this scheduler honours.

Admission control (:meth:`QosScheduler.add`): a request that can never fit (context, KV budget, token budget) or
whose class queue is full is refused at once with a retryable :class:`~specstream.errors.CapacityError`.
The scheduler holds no tensors and reads time only from its ``clock`` (the simulator passes a virtual one).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specstream.errors import CapacityError, InvalidRequestError
from specstream.schedulers.metrics import SchedulerMetrics
from specstream.schedulers.plan import (
    QOS_CLASSES,
    DecodeWork,
    EncodeItem,
    EncodeWork,
    PrefillWork,
    Request,
    RequestStatus,
    StepOutput,
    StepPlan,
    book_step_result,
)

_RANK = {q: i for i, q in enumerate(QOS_CLASSES)}


@dataclass(frozen=True)
class EncodeBatching:
    """Batching of one encoder: at most ``max_batch`` items per batch, an item waits at most ``max_delay_s``."""

    max_batch: int = 8
    max_delay_s: float = 0.02


def _default_encoders() -> dict[str, EncodeBatching]:
    return {"image": EncodeBatching(8, 0.02), "audio": EncodeBatching(4, 0.01)}


@dataclass(frozen=True)
class QosConfig:
    """Sizes and policy knobs of :class:`QosScheduler` (documented in ``docs/scheduler.md``).

    Attributes:
        num_slots: KV cache slots (concurrent running requests).
        max_len: tokens per slot (prompt + output + tree).
        reserved_realtime_slots: slots only ``realtime`` requests may take.
        token_budget: most tokens verified per step (tree nodes + prefill tokens), across the batch.
        kv_budget_tokens: KV memory budget in cached tokens over all slots; default ``num_slots * max_len``.
        kv_bytes_per_token: bytes per cached token (reporting the budget in bytes; 0 = unknown).
        kv_high_watermark: above this fraction of the KV budget, plan smaller (trees, then admissions).
        batch_share: fraction of the token budget and of each encode batch kept for ``batch`` work.
        aging_s: a ``batch`` request queued this long ranks as ``interactive``.
        max_nodes_per_request: largest tree granted (root included).
        max_tree_depth: deepest draft token granted.
        spec_token_limit: verified decode tokens per step beyond which trees shrink; None = no limit.
        default_deadline_s: relative deadline per class for requests without one.
        max_queue: most queued requests per class (admission control).
        encoders: batching per modality; a request with another modality is invalid.
        preempt: allow realtime to preempt batch. Memory overflow preempts regardless (the KV budget is a hard
            limit).
        guard_encode_items: while a ``realtime`` request is active, most non-realtime items per encode batch
            (keeps steps short so subtitles are not delayed by keyframe floods).
        guard_prefill_tokens: while a ``realtime`` request is active, most non-realtime prefill tokens per step
            (at least one prefill is still admitted when nothing else is).
    """

    num_slots: int = 16
    max_len: int = 1024
    reserved_realtime_slots: int = 1
    token_budget: int = 4096
    kv_budget_tokens: int | None = None
    kv_bytes_per_token: int = 0
    kv_high_watermark: float = 0.8
    batch_share: float = 0.10
    aging_s: float = 5.0
    max_nodes_per_request: int = 16
    max_tree_depth: int = 8
    spec_token_limit: int | None = None
    default_deadline_s: dict[str, float] = field(
        default_factory=lambda: {"realtime": 1.0, "interactive": 10.0, "batch": 600.0})
    max_queue: dict[str, int] = field(default_factory=lambda: {"realtime": 64, "interactive": 256, "batch": 4096})
    encoders: dict[str, EncodeBatching] = field(default_factory=_default_encoders)
    preempt: bool = True
    guard_encode_items: int = 2
    guard_prefill_tokens: int = 256

    @property
    def kv_budget(self) -> int:
        return self.kv_budget_tokens if self.kv_budget_tokens is not None else self.num_slots * self.max_len

    def validate(self) -> None:
        if self.num_slots < 1 or self.max_len < 2:
            raise ValueError("num_slots must be >= 1 and max_len >= 2")
        if not 0 <= self.reserved_realtime_slots < self.num_slots:
            raise ValueError("reserved_realtime_slots must be in [0, num_slots)")
        if self.token_budget < self.num_slots + 1:
            raise ValueError("token_budget must exceed num_slots (every running request verifies its root)")
        if not 0 < self.kv_high_watermark <= 1 or not 0 <= self.batch_share < 1:
            raise ValueError("kv_high_watermark must be in (0, 1] and batch_share in [0, 1)")
        if self.kv_budget > self.num_slots * self.max_len:
            raise ValueError("kv_budget_tokens exceeds num_slots * max_len")

    @classmethod
    def from_dict(cls, d: dict) -> "QosConfig":
        d = dict(d)
        if "encoders" in d:
            d["encoders"] = {m: EncodeBatching(**v) for m, v in d["encoders"].items()}
        for key in ("default_deadline_s", "max_queue"):
            if key in d:
                merged = dict(getattr(cls(), key))
                merged.update(d[key])
                d[key] = merged
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown scheduler config keys: {sorted(unknown)}")
        cfg = cls(**d)
        cfg.validate()
        return cfg


@dataclass
class _Meta:
    """Scheduler-side bookkeeping of one request (kept out of :class:`Request`)."""

    seq: int  # arrival order
    deadline: float  # absolute deadline, seconds on the scheduler clock
    pending: dict[str, EncodeItem]  # encode items not yet done, by item id
    wait_since: float  # arrival or last preemption
    admit_rank: int | None = None  # first admission order (kept across preemptions)
    waits: list[float] = field(default_factory=list)  # queue waits, seconds (one per admission)
    first_prefill_s: float | None = None


class QosScheduler:
    """QoS classes, deadlines, token and KV budgets, preemption and encode batching; interface of
    :class:`~specstream.schedulers.fifo.FifoScheduler` (``add``, ``schedule``, ``update``, ``has_work``,
    ``pop_finished``), so :class:`~specstream.stages.speculative.engine.SpeculativeEngine` takes it as
    ``scheduler=``.

    Args:
        config: sizes and knobs.
        clock: seconds, monotonic (``time.monotonic`` live; the simulator passes its virtual clock).
            Requests' ``arrival_s`` and ``deadline_s`` are on this clock.
        metrics: Prometheus metrics to update, or None.
    """

    def __init__(self, config: QosConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 metrics: SchedulerMetrics | None = None):
        self.config = config or QosConfig()
        self.config.validate()
        self.clock = clock
        self.metrics = metrics
        self.requests: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self._queued: dict[str, Request] = {}  # not running, not finished (encode pending or waiting)
        self._meta: dict[str, _Meta] = {}
        self._encode_q: dict[str, list[tuple[str, EncodeItem, float]]] = {m: [] for m in self.config.encoders}
        self._in_flight: set[str] = set()  # encode item ids planned, not yet booked
        self.free_slots: list[int] = list(range(self.config.num_slots))[::-1]
        self._released: list[tuple[str, int]] = []
        self._preempted: list[tuple[str, int]] = []
        self._step = 0
        self._seq = 0
        self._admit_rank = 0
        self.preemptions = 0
        self.rejections: dict[str, int] = {q: 0 for q in QOS_CLASSES}
        self.peak_kv_fraction = 0.0
        self.last_plan: StepPlan | None = None

    # -- intake ---------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request, or refuse it at once.

        Raises:
            ValueError: duplicate request id.
            InvalidRequestError: unknown QoS class or encode modality.
            CapacityError: (retryable) the request can never fit (``reason`` ``"never_fits"``) or its class
                queue is full (``reason`` ``"queue_full"``).
        """
        cfg = self.config
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.qos not in _RANK:
            raise InvalidRequestError(f"unknown QoS class {request.qos!r}; expected one of {QOS_CLASSES}")
        for item in request.encodes:
            if item.modality not in cfg.encoders:
                raise InvalidRequestError(f"no encoder for modality {item.modality!r}; have {sorted(cfg.encoders)}")
        need = len(request.prompt_ids) + request.max_new_tokens
        share = math.ceil(cfg.batch_share * cfg.token_budget)
        limit = min(cfg.max_len, cfg.kv_budget, cfg.token_budget - cfg.num_slots - share)
        if need > limit:
            self._reject(request, "never_fits",
                         f"request {request.request_id!r} needs {need} tokens of context (prompt + max_new_tokens) "
                         f"but at most {limit} fit (max_len {cfg.max_len}, KV budget {cfg.kv_budget} tokens, "
                         f"token budget {cfg.token_budget})")
        queued = sum(1 for r in self._queued.values() if r.qos == request.qos)
        if queued >= cfg.max_queue[request.qos]:
            self._reject(request, "queue_full",
                         f"the {request.qos} queue is full ({queued} requests); retry later")
        deadline = request.deadline_s
        if deadline is None:
            deadline = request.arrival_s + cfg.default_deadline_s[request.qos]
        self.requests[request.request_id] = request
        self._queued[request.request_id] = request
        self._meta[request.request_id] = _Meta(self._seq, deadline, {i.item_id: i for i in request.encodes},
                                               request.arrival_s)
        self._seq += 1
        for item in request.encodes:
            self._encode_q[item.modality].append((request.request_id, item, request.arrival_s))

    def _reject(self, request: Request, reason: str, message: str) -> None:
        self.rejections[request.qos] += 1
        if self.metrics:
            self.metrics.rejections.labels(request.qos, reason).inc()
        err = CapacityError(message)
        err.reason = reason
        raise err

    def has_work(self) -> bool:
        return bool(self._queued or self.running)

    @property
    def waiting(self) -> list[Request]:
        """Queued requests (encode pending or waiting for a slot), in priority order."""
        now = self.clock()
        return sorted(self._queued.values(), key=lambda r: self._key(r, now))

    def next_event_s(self) -> float | None:
        """Clock time at which an encode batch that is waiting for more items becomes due (None: none waits)."""
        times = [min(t for _, _, t in q) + self.config.encoders[m].max_delay_s
                 for m, q in self._encode_q.items() if q]
        return min(times) if times else None

    # -- priorities -----------------------------------------------------------------------------------------
    def _effective(self, req: Request, now: float) -> tuple[int, float]:
        """(class rank, deadline) after aging: batch queued ``aging_s`` ranks as interactive."""
        meta = self._meta[req.request_id]
        rank = _RANK[req.qos]
        if req.qos == "batch" and now - req.arrival_s >= self.config.aging_s:
            return _RANK["interactive"], req.arrival_s + self.config.aging_s
        return rank, meta.deadline

    def _key(self, req: Request, now: float) -> tuple:
        rank, deadline = self._effective(req, now)
        return rank, deadline, self._meta[req.request_id].seq

    # -- planning -------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan one step. Called by the engine loop (or the simulator) before the executor runs the plan."""
        now = self.clock()
        self._step += 1
        encodes = self._plan_encodes(now)
        ready = sorted((r for r in self._queued.values() if not self._meta[r.request_id].pending),
                       key=lambda r: self._key(r, now))
        self._preempt_for_realtime(ready, now)
        self._preempt_for_memory(now)
        budget = self.config.token_budget
        order = sorted(self.running.values(), key=lambda r: self._key(r, now))
        nodes = {r.request_id: 1 for r in order}  # every running request verifies its root
        budget -= len(order)
        reserve = self._batch_reserve(order, ready)
        rt = [r for r in order if r.qos == "realtime"]
        budget -= self._grow_trees(rt, nodes, min(budget - reserve, self._kv_left(nodes, ())))
        prefills, budget = self._admit(ready, nodes, budget, reserve, now)
        reserve = min(reserve, self._batch_reserve(order, []))  # what batch trees may still claim
        inter = [r for r in order if r.qos == "interactive"]
        budget -= self._grow_trees(inter, nodes, min(budget - reserve, self._kv_left(nodes, prefills)))
        self._grow_trees([r for r in order if r.qos == "batch"], nodes, min(budget, self._kv_left(nodes, prefills)))
        decodes = tuple(DecodeWork(r, r.slot, nodes[r.request_id], self._depth(r, nodes[r.request_id]))
                        for r in order)
        released, self._released = tuple(self._released), []
        preempted, self._preempted = tuple(self._preempted), []
        plan = StepPlan(self._step, tuple(prefills), decodes, released, encodes, preempted)
        kv = self.kv_fraction(plan)
        self.peak_kv_fraction = max(self.peak_kv_fraction, kv)
        if self.metrics:
            depths = {q: 0 for q in QOS_CLASSES}
            for r in self._queued.values():
                depths[r.qos] += 1
            self.metrics.observe_step(plan, depths, kv)
        self.last_plan = plan
        return plan

    def kv_tokens(self, plan: StepPlan | None = None) -> int:
        """KV cache tokens held by running requests, plus what ``plan`` writes (tree nodes, prefill tokens)."""
        held = sum(len(r.context) for r in self.running.values() if r.status is RequestStatus.RUNNING)
        if plan is None:
            return held
        # prefilled requests are in ``running`` only after update(): count their tokens here
        return held + sum(d.node_budget for d in plan.decodes) + sum(len(p.tokens) for p in plan.prefills)

    def kv_fraction(self, plan: StepPlan | None = None) -> float:
        return self.kv_tokens(plan) / self.config.kv_budget

    def _kv_left(self, nodes: dict[str, int], prefills) -> int:
        """KV budget tokens left after holding, the planned tree nodes and the planned prefills."""
        used = self.kv_tokens() + sum(nodes.values()) + sum(len(p.tokens) for p in prefills)
        return max(0, self.config.kv_budget - used)

    def _room(self, req: Request) -> int:
        return self.config.max_len - len(req.context) + 1  # cache columns left for the root and its tree

    def _depth(self, req: Request, nodes: int) -> int:
        return max(0, min(req.remaining - 1, self.config.max_tree_depth, self._room(req) - 1, nodes - 1))

    def _want(self, req: Request) -> int:
        """Tree size the request may grow to this step (root included)."""
        cfg = self.config
        want = req.requested_nodes if req.speculate else 1
        want = min(want, cfg.max_nodes_per_request, self._room(req), req.remaining)
        if req.qos != "realtime" and self._kv_pressure():
            want = 1  # above the high watermark: shrink non-realtime trees first
        return max(1, want)

    def _kv_pressure(self) -> bool:
        return self.kv_tokens() > self.config.kv_high_watermark * self.config.kv_budget

    def _grow_trees(self, reqs: list[Request], nodes: dict[str, int], budget: int) -> int:
        """Grow trees of ``reqs`` (priority order) toward what they want, within ``budget`` and
        ``spec_token_limit``; batch trees shrink first because they come last. Returns tokens spent."""
        limit = self.config.spec_token_limit
        spent = 0
        for r in reqs:
            extra = self._want(r) - nodes[r.request_id]
            if limit is not None:
                extra = min(extra, limit - sum(nodes.values()))
            extra = max(0, min(extra, budget - spent))
            nodes[r.request_id] += extra
            spent += extra
        return spent

    def _batch_reserve(self, running: list[Request], ready: list[Request]) -> int:
        """Tokens kept for ``batch`` work this step: its guaranteed share, bounded by what it could use."""
        share = math.ceil(self.config.batch_share * self.config.token_budget)
        demand = sum(self._want(r) - 1 for r in running if r.qos == "batch")
        nxt = next((r for r in ready if r.qos == "batch"), None)
        nonrt = sum(1 for r in running if r.qos != "realtime")
        if nxt is not None and self.free_slots and nonrt < self.config.num_slots - self.config.reserved_realtime_slots:
            demand += len(nxt.context)
        return min(share, demand)

    def _admit(self, ready: list[Request], nodes: dict[str, int], budget: int, reserve: int,
               now: float) -> tuple[list[PrefillWork], int]:
        """Admit ready requests in priority order; returns the prefills and the budget left."""
        cfg = self.config
        prefills: list[PrefillWork] = []
        growth = sum(nodes.values())
        nonrt = sum(1 for r in self.running.values() if r.qos != "realtime")
        only_batch = False  # set when a higher request waits for tokens kept for batch's share
        rt_active = self._realtime_active()
        guarded = 0  # non-realtime prefill tokens admitted while realtime is active
        for req in ready:
            rank, _ = self._effective(req, now)
            is_batch_work = req.qos == "batch" and rank == _RANK["batch"]
            if only_batch and not is_batch_work:
                continue
            room = budget if is_batch_work else budget - reserve
            size = len(req.context)
            if req.qos != "realtime" and rt_active and guarded + size > cfg.guard_prefill_tokens and (
                    guarded or self.running):
                break  # realtime work is active: keep this step short

            if not self.free_slots:
                break
            if size > room:
                if req.qos == "realtime":
                    continue  # a later realtime request may still fit
                if size <= budget:
                    only_batch = True  # batch may use its guaranteed share; nothing else overtakes
                    continue
                break  # never let lower-priority work overtake a request that waits for budget
            if req.qos != "realtime" and nonrt >= cfg.num_slots - cfg.reserved_realtime_slots:
                break
            held = sum(len(r.context) for r in self.running.values())
            limit = cfg.kv_budget if req.qos == "realtime" else cfg.kv_high_watermark * cfg.kv_budget
            if (self.running or prefills) and held + growth + size + req.remaining > limit:
                if req.qos == "realtime":
                    continue
                break
            self._queued.pop(req.request_id)
            req.slot = self.free_slots.pop()
            req.status = RequestStatus.RUNNING
            meta = self._meta[req.request_id]
            if meta.admit_rank is None:
                meta.admit_rank = self._admit_rank
                self._admit_rank += 1
            wait = now - meta.wait_since
            meta.waits.append(wait)
            if meta.first_prefill_s is None:
                meta.first_prefill_s = now
            if self.metrics:
                self.metrics.queue_wait.labels(req.qos).observe(wait)
            prefills.append(PrefillWork(req, req.slot))
            budget -= size
            growth += size
            if req.qos != "realtime":
                guarded += size
            if req.qos != "realtime":
                nonrt += 1
            if is_batch_work:
                reserve = max(0, reserve - size)
        return prefills, budget

    # -- preemption -----------------------------------------------------------------------------------------
    def _victims(self, classes: tuple[str, ...]) -> list[Request]:
        """Preemptible running requests of ``classes``: lowest class first, most recently first admitted first."""
        cands = [r for r in self.running.values() if r.qos in classes]
        return sorted(cands, key=lambda r: (-_RANK[r.qos], -self._meta[r.request_id].admit_rank))

    def _preempt_for_realtime(self, ready: list[Request], now: float) -> None:
        if not self.config.preempt:
            return
        rt = [r for r in ready if r.qos == "realtime"]
        victims = self._victims(("batch",))
        free = len(self.free_slots)
        held = sum(len(r.context) for r in self.running.values())
        for req in rt:
            need_kv = held + len(req.context) + req.remaining - self.config.kv_budget
            while victims and (free < 1 or need_kv > 0):
                v = victims.pop(0)
                need_kv -= len(v.context)
                held -= len(v.context)
                self._preempt(v, now)
                free += 1
            if free < 1 or need_kv > 0:
                return
            free -= 1
            held += len(req.context) + req.remaining

    def _preempt_for_memory(self, now: float) -> None:
        """Preempt when holding plus one root per running request would exceed the KV budget."""
        victims = self._victims(QOS_CLASSES)
        while len(self.running) > 1 and self.kv_tokens() + len(self.running) > self.config.kv_budget:
            self._preempt(victims.pop(0), now)

    def _preempt(self, req: Request, now: float) -> None:
        self.running.pop(req.request_id)
        self._preempted.append((req.request_id, req.slot))
        self.free_slots.append(req.slot)
        req.slot = None
        req.status = RequestStatus.WAITING
        req.preemptions += 1
        self._queued[req.request_id] = req
        self._meta[req.request_id].wait_since = now
        self.preemptions += 1
        if self.metrics:
            self.metrics.preemptions.labels(req.qos).inc()

    # -- encode batching ------------------------------------------------------------------------------------
    def _realtime_active(self) -> bool:
        return any(r.qos == "realtime" for r in self.running.values()) or any(
            r.qos == "realtime" for r in self._queued.values())

    def _plan_encodes(self, now: float) -> tuple[EncodeWork, ...]:
        works = []
        rt_active = self._realtime_active()
        higher_active = any(r.qos != "batch" for r in self.running.values()) or any(
            r.qos != "batch" for r in self._queued.values())
        for modality, queue in self._encode_q.items():
            if not queue:
                continue
            bcfg = self.config.encoders[modality]
            has_rt = any(self.requests[rid].qos == "realtime" for rid, _, _ in queue)
            due = min(t for _, _, t in queue) + bcfg.max_delay_s <= now + 1e-12
            if not (has_rt or due or len(queue) >= bcfg.max_batch):
                continue
            queue.sort(key=lambda e: self._key(self.requests[e[0]], now) + (e[1].item_id,))
            batch_cap = max(1, math.ceil(self.config.batch_share * bcfg.max_batch)) if higher_active else None
            taken, rest, n_batch, n_other = [], [], 0, 0
            for entry in queue:
                rid = entry[0]
                is_batch = self._effective(self.requests[rid], now)[0] == _RANK["batch"]
                is_rt = self.requests[rid].qos == "realtime"
                if (len(taken) >= bcfg.max_batch or (is_batch and batch_cap is not None and n_batch >= batch_cap)
                        or (rt_active and not is_rt and n_other >= self.config.guard_encode_items)):
                    rest.append(entry)
                    continue
                taken.append(entry)
                n_batch += is_batch
                n_other += not is_rt
            self._encode_q[modality] = rest
            if not taken:
                continue
            self._in_flight.update(item.item_id for _, item, _ in taken)
            works.append(EncodeWork(modality, tuple((rid, item) for rid, item, _ in taken)))
        return tuple(works)

    # -- booking --------------------------------------------------------------------------------------------
    def update(self, output: StepOutput) -> list[Request]:
        """Book a step's results (called by the engine loop after the executor); returns finished requests."""
        finished = []
        now = self.clock()
        for enc in output.encoded:
            req = self.requests.get(enc.request_id)
            self._in_flight.discard(enc.item_id)
            if req is None or req.finished:
                continue
            meta = self._meta[req.request_id]
            meta.pending.pop(enc.item_id, None)
            if enc.error is not None:
                req.error = enc.error
                req.finish_reason = "error"
                self._finish(req)
                finished.append(req)
        for res in output.results:
            req = self.requests[res.request_id]
            if req.finished:
                continue
            done = book_step_result(req, res, now)
            if res.is_prefill:
                self.running[req.request_id] = req
            if done:
                self._finish(req)
                finished.append(req)
        return finished

    def _finish(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        self.running.pop(req.request_id, None)
        self._queued.pop(req.request_id, None)
        for modality, queue in self._encode_q.items():
            self._encode_q[modality] = [e for e in queue if e[0] != req.request_id]
        if req.slot is not None:
            self.free_slots.append(req.slot)
            self._released.append((req.request_id, req.slot))
        if self.metrics and req.stats.target_steps:
            self.metrics.tau.labels(req.qos).observe(req.stats.tau)

    def pop_finished(self, request_id: str) -> Request:
        """Forget a finished request (the caller has its output)."""
        self._meta.pop(request_id, None)
        return self.requests.pop(request_id)

    def queue_waits(self, request_id: str) -> list[float]:
        """Seconds each (re)admission of the request waited (arrival or preemption to prefill)."""
        return list(self._meta[request_id].waits)
