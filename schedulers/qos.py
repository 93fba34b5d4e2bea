"""The cross-modality QoS scheduler: one plan per device step for every model of the device loop — encode batches,
prefills (chunked) and speculative decode steps of every request — with QoS classes, deadlines, a token budget
and one memory budget over every model's KV cache and encoder outputs.

Policy, in the order :meth:`QosScheduler.schedule` applies it:

1. **Encode batches** per modality: items wait in a priority queue (class, then deadline); a batch runs when a
   ``realtime`` item is queued, when ``max_batch`` items are queued, or when the oldest has waited
   ``max_delay_s``. While higher-class work exists, ``batch``-class items take at most ``batch_share`` of a
   batch, so a flood of batch keyframes cannot delay subtitles.
2. **Preemption**: a waiting ``realtime`` request that finds no slot of its model (or no memory) preempts
   ``batch`` requests (of its model for a slot, of any model for memory), most recently admitted first; their KV
   cache is freed and recomputed when they resume (prefill of prompt + output so far), so their output is
   unchanged. Memory overflow preempts the lowest class, most recently (first) admitted first. A request is never
   preempted for one of its own class, and a resumed request keeps its first admission rank.
3. **Decodes**: every decoding request verifies at least its root token each step (continuous batching).
4. **Prefills** in priority order: ``realtime`` > ``interactive`` > ``batch``, earliest deadline first within a
   class; requests in the middle of a chunked prefill take their next chunk in the same order. A prompt is
   **chunked** (vLLM's chunked prefill) to what the step's token budget has room for; a non-realtime request
   prefills at most ``max_prefill_chunk_tokens`` per step, so every step stays bounded for a subtitle window that
   arrives during it, and all non-realtime prefills together take at most ``realtime_prefill_chunk_tokens`` per
   step while realtime work is queued or running, so the steps that carry realtime rows stay short. A ``batch`` request whose deadline slack (deadline - now - estimated
   service time) falls below ``promote_slack_s`` is **promoted**: it leaves batch's reserved share and competes
   for the budget ahead of every other batch request, but still after all interactive work, so it never passes a
   higher class. ``reserved_realtime_slots`` slots per model are for ``realtime`` only. Above
   ``kv_high_watermark`` of the memory budget only ``realtime`` is admitted. **Forks** (``Request.fork_of``: the
   other choices of an ``n > 1`` request) wait for their source's final prefill chunk and are admitted with it
   (:class:`~specstream.schedulers.plan.ForkWork`: a slot and the memory for their context, no token budget),
   so a prompt is prefilled once for all its choices.
5. **Tree budgets**: what is left of the token budget grows trees up to what each request's drafters ask for,
   highest class first; ``batch`` keeps ``batch_share`` of the budget when it has work. Trees shrink (batch's
   first) when the step would verify more than ``spec_token_limit`` tokens (the forward turns compute-bound and
   speculation stops paying) and, above the high watermark, non-realtime trees shrink to the root only. Low
   acceptance switches speculation off per request in the executor's adaptive budget (``requested_nodes``); the
   granted trees are an upper bound, which the executor's step gate (:class:`~specstream.schedulers.costmodel.
   SpecGate`) cuts or drops for the whole batch when its measured costs say they lose.

**Models.** A request names its model (``Request.model``); each model has its own slots and context length
(:class:`ModelLimits`), a per-token cost relative to the budget's unit (``token_cost``) and the bytes one cached
token holds (``kv_bytes_per_token``). With ``memory_budget_bytes`` the memory budget is in bytes over every
model's cached tokens and the encoder outputs held; without it, one model's budget is ``kv_budget_tokens``.

Admission control (:meth:`QosScheduler.add`): a request for a model that is not configured is refused with
``model_not_loaded``; one that can never fit (context length, memory) or whose class queue is full is refused at
once with a retryable :class:`~specstream.errors.CapacityError`. The scheduler holds no tensors and reads time
only from its ``clock`` (the simulator passes a virtual one).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from specstream.errors import CapacityError, InvalidRequestError, ModelNotLoadedError
from specstream.schedulers.costmodel import StepCostFit
from specstream.schedulers.metrics import SchedulerMetrics
from specstream.schedulers.plan import (
    admissions,
    QOS_CLASSES,
    DecodeWork,
    EncodeItem,
    EncodeWork,
    ForkWork,
    Phase,
    PrefillWork,
    Request,
    RequestsView,
    RequestStatus,
    SlotRelease,
    StepOutput,
    StepPlan,
    book_step_result,
)

_RANK = {q: i for i, q in enumerate(QOS_CLASSES)}
#: rank of a promoted batch request: after every interactive request, before other batch work
_PROMOTED = _RANK["interactive"] + 0.5
#: a prefill chunk smaller than this (unless it ends the prompt) waits for a step with more room
MIN_CHUNK = 16
MAX_DEFER_S = 1.0  # realtime_step_budget_s: a deferred model still joins a step after waiting this long
OBSERVE_DECAY = 0.98  # weight of an older step in the per-token cost fit (about the last 50 steps count)


@dataclass(frozen=True)
class EncodeBatching:
    """Batching of one encoder: at most ``max_batch`` items per batch, an item waits at most ``max_delay_s``."""

    max_batch: int = 8
    max_delay_s: float = 0.02


def _default_encoders() -> dict[str, EncodeBatching]:
    return {"image": EncodeBatching(8, 0.02), "audio": EncodeBatching(4, 0.01)}


@dataclass(frozen=True)
class ModelLimits:
    """One model of the device loop, as the scheduler sees it.

    Attributes:
        num_slots: its KV cache slots.
        max_len: tokens per slot (prompt + output + tree).
        reserved_realtime_slots: of its slots, those only realtime requests may take.
        kv_bytes_per_token: bytes one cached token holds (all layers, K and V); 0 = count tokens.
        token_cost: cost of one of its tokens in a forward, relative to the token budget's unit (e.g. a
            Whisper-tiny decoder token costs a small fraction of a 7B VLM token).
    """

    num_slots: int
    max_len: int
    reserved_realtime_slots: int = 0
    kv_bytes_per_token: int = 0
    token_cost: float = 1.0

    @classmethod
    def from_dict(cls, d: dict) -> "ModelLimits":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown model limit keys: {sorted(unknown)}")
        return cls(**d)


@dataclass(frozen=True)
class QosConfig:
    """Sizes and policy knobs of :class:`QosScheduler` (documented in ``docs/scheduler.md``).

    Attributes:
        num_slots, max_len, reserved_realtime_slots: the ``"default"`` model's limits when ``models`` is not given.
        token_budget: most tokens verified per step (tree nodes + prefill tokens, weighted by each model's
            ``token_cost``), across the batch and the models.
        kv_budget_tokens: one model's memory budget in cached tokens; default ``num_slots * max_len``.
        kv_bytes_per_token: bytes per cached token of the default model (0 = unknown).
        kv_high_watermark: above this fraction of the memory budget, plan smaller (trees, then admissions).
        batch_share: fraction of the token budget and of each encode batch kept for ``batch`` work.
        promote_slack_s: a ``batch`` request whose deadline slack falls below this is promoted (see the module
            docstring); slack = deadline - now - ``service_s_per_token`` * tokens still to generate.
        service_s_per_token: estimated seconds per generated token of a request (slack estimate).
        max_prefill_chunk_tokens: most prefill tokens of one non-realtime request per step (a longer prompt is
            prefilled in chunks over several steps). None: no cap but the token budget.
        realtime_prefill_chunk_tokens: most non-realtime prefill tokens per step, all requests together, while
            realtime work is queued or running (at least ``MIN_CHUNK``, so a prompt still progresses under a
            continuous subtitle stream).
        realtime_prefill_budget_s: instead, while realtime work is active, the seconds of non-realtime prefill a
            step may carry, from each model's measured prefill seconds per token (:meth:`QosScheduler.observe`;
            the device loop reports every step). A cheap model's prompt then goes in one step, a large model's in
            chunks. Until a model has been measured, ``realtime_prefill_chunk_tokens`` applies. None: tokens only.
        realtime_step_budget_s: while realtime work of some model is active, another model's rows (decodes and
            prefills) join a step only if that model's recent steps took at most this long on average
            (:meth:`QosScheduler.observe`); otherwise they wait until no realtime work is active. A device runs a
            step's models one after another, so a costly model's part would lengthen every step of a subtitle
            window (on the 2-core CPU, 8 caption clients made subtitle p95 1.23x its value alone). The model of
            the realtime work always runs (its other rows share its forward), and a model that has waited
            ``MAX_DEFER_S`` (1 s) joins the next step, so it is slowed, never starved. None: no such rule.
        max_nodes_per_request: largest tree granted (root included).
        max_tree_depth: deepest draft token granted.
        spec_token_limit: verified decode tokens per step beyond which trees shrink; None = no limit.
        default_deadline_s: relative deadline per class for requests without one.
        max_queue: most queued requests per class (admission control).
        encoders: batching per modality; a request with another modality is invalid.
        preempt: allow realtime to preempt batch. Memory overflow preempts regardless (the budget is a hard
            limit).
        guard_encode_items: while a ``realtime`` request is active, most non-realtime items per encode batch.
        models: per model name, its :class:`ModelLimits` (None: one model, ``"default"``, from the fields above).
        memory_budget_bytes: one memory budget in bytes over every model's cached tokens (each needs
            ``kv_bytes_per_token``) and the encoder outputs held; None: count tokens (``kv_budget_tokens``).
    """

    num_slots: int = 16
    max_len: int = 1024
    reserved_realtime_slots: int = 1
    token_budget: int = 4096
    kv_budget_tokens: int | None = None
    kv_bytes_per_token: int = 0
    kv_high_watermark: float = 0.8
    batch_share: float = 0.10
    promote_slack_s: float = 10.0
    service_s_per_token: float = 0.05
    max_prefill_chunk_tokens: int | None = 512
    realtime_prefill_chunk_tokens: int = 32
    realtime_prefill_budget_s: float | None = None
    realtime_step_budget_s: float | None = None
    max_nodes_per_request: int = 16
    max_tree_depth: int = 8
    spec_token_limit: int | None = None
    default_deadline_s: dict[str, float] = field(
        default_factory=lambda: {"realtime": 1.0, "interactive": 10.0, "batch": 600.0})
    max_queue: dict[str, int] = field(default_factory=lambda: {"realtime": 64, "interactive": 256, "batch": 4096})
    encoders: dict[str, EncodeBatching] = field(default_factory=_default_encoders)
    preempt: bool = True
    guard_encode_items: int = 2
    models: dict[str, ModelLimits] | None = None
    memory_budget_bytes: int | None = None

    @property
    def kv_budget(self) -> int:
        """The memory budget in its unit (bytes with ``memory_budget_bytes``, else tokens)."""
        if self.memory_budget_bytes is not None:
            return self.memory_budget_bytes
        if self.models is None:
            return self.kv_budget_tokens if self.kv_budget_tokens is not None else self.num_slots * self.max_len
        return sum(m.num_slots * m.max_len for m in self.models.values())

    def model_limits(self) -> dict[str, ModelLimits]:
        if self.models is not None:
            return dict(self.models)
        return {"default": ModelLimits(self.num_slots, self.max_len, self.reserved_realtime_slots,
                                       self.kv_bytes_per_token, 1.0)}

    @property
    def total_slots(self) -> int:
        return sum(m.num_slots for m in self.model_limits().values())

    def validate(self) -> None:
        limits = self.model_limits()
        if not limits and self.memory_budget_bytes is None:
            raise ValueError("at least one model is needed (or a memory_budget_bytes to add models to later)")
        for name, m in limits.items():
            if m.num_slots < 1 or m.max_len < 2:
                raise ValueError(f"model {name!r}: num_slots must be >= 1 and max_len >= 2")
            if not 0 <= m.reserved_realtime_slots < m.num_slots:
                raise ValueError(f"model {name!r}: reserved_realtime_slots must be in [0, num_slots)")
            if m.token_cost <= 0:
                raise ValueError(f"model {name!r}: token_cost must be > 0")
            if self.memory_budget_bytes is not None and m.kv_bytes_per_token <= 0:
                raise ValueError(f"model {name!r}: memory_budget_bytes needs its kv_bytes_per_token")
        if self.token_budget < self.total_slots + 1:
            raise ValueError("token_budget must exceed the slots (every running request verifies its root)")
        if not 0 < self.kv_high_watermark <= 1 or not 0 <= self.batch_share < 1:
            raise ValueError("kv_high_watermark must be in (0, 1] and batch_share in [0, 1)")
        if self.models is None and self.memory_budget_bytes is None and self.kv_budget > self.num_slots * self.max_len:
            raise ValueError("kv_budget_tokens exceeds num_slots * max_len")
        if self.max_prefill_chunk_tokens is not None and self.max_prefill_chunk_tokens < 1:
            raise ValueError("max_prefill_chunk_tokens must be >= 1 (or None)")
        if self.realtime_prefill_chunk_tokens < MIN_CHUNK:
            raise ValueError(f"realtime_prefill_chunk_tokens must be >= {MIN_CHUNK}")

    @classmethod
    def from_dict(cls, d: dict) -> "QosConfig":
        d = dict(d)
        if "encoders" in d:
            d["encoders"] = {m: EncodeBatching(**v) for m, v in d["encoders"].items()}
        if "models" in d and d["models"] is not None:
            d["models"] = {name: ModelLimits.from_dict(v) for name, v in d["models"].items()}
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
class _Entry:
    """The scheduler's one record of a request: the request, its phase (which fixes its queue membership) and the
    scheduler-side bookkeeping kept out of :class:`Request`. Created by :meth:`QosScheduler.add`, moved between
    phases only by :meth:`QosScheduler._set_phase`, dropped only by :meth:`QosScheduler.pop_finished`."""

    request: Request
    seq: int  # arrival order
    deadline: float  # absolute deadline, seconds on the scheduler clock
    pending: dict[str, EncodeItem]  # encode items not yet done, by item id
    wait_since: float  # arrival or last preemption
    phase: Phase | None = None  # None until add() files it as QUEUED
    admit_rank: int | None = None  # first admission order (kept across preemptions)
    waits: list[float] = field(default_factory=list)  # queue waits, seconds (one per admission)
    first_prefill_s: float | None = None
    cached: int = 0  # context tokens in the KV cache during a chunked prefill
    planned: int = 0  # context tokens planned into the cache (cached + chunks not yet booked)
    encoded_bytes: int = 0  # encoder outputs held (memory budget, bytes mode)
    fork_of: str | None = None  # held back until this request's source plans its final prefill chunk


class QosScheduler:
    """QoS classes, deadlines, token and memory budgets, chunked prefill, preemption and encode batching over
    every model of a device loop; interface of :class:`~specstream.schedulers.fifo.FifoScheduler` (``add``,
    ``schedule``, ``update``, ``has_work``, ``pop_finished``).

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
        self.limits = self.config.model_limits()
        self.bytes_mode = self.config.memory_budget_bytes is not None
        #: the memory budget (bytes in bytes mode, else tokens); :meth:`add_model` grows it
        self.kv_budget = self.config.kv_budget
        self.clock = clock
        self.metrics = metrics
        self.multi_model = True
        #: the one registry: request id -> its record, from add() to pop_finished(), in arrival order
        self._entries: dict[str, _Entry] = {}
        #: request id -> Request, a read-only view of ``_entries``
        self.requests = RequestsView(self._entries)
        # Ordered indexes of the records by phase (id -> Request, in the order they entered the phase: decodes and
        # sums run in that order), so a step walks only the requests of a phase. Written only by _set_phase.
        self.running: dict[str, Request] = {}  # Phase.RUNNING: prefilled, decoding
        self.prefilling: dict[str, Request] = {}  # Phase.PREFILLING: slot held, prefill chunks still to run
        self._queued: dict[str, Request] = {}  # Phase.QUEUED: not admitted (encode pending or waiting)
        self._index = {Phase.QUEUED: self._queued, Phase.PREFILLING: self.prefilling, Phase.RUNNING: self.running}
        self.encoders: dict[str, EncodeBatching] = dict(self.config.encoders)  # add_modality extends it
        self._encode_q: dict[str, list[tuple[str, EncodeItem, float]]] = {m: [] for m in self.encoders}
        self._in_flight: set[str] = set()  # encode item ids planned, not yet booked
        self._free: dict[str, list[int]] = {m: list(range(lim.num_slots))[::-1] for m, lim in self.limits.items()}
        self._released: list[SlotRelease] = []
        self._preempted: list[SlotRelease] = []
        self._step = 0
        self._seq = 0
        self._admit_rank = 0
        self.preemptions = 0
        self.rejections: dict[str, int] = {q: 0 for q in QOS_CLASSES}
        self.peak_kv_fraction = 0.0
        self.last_plan: StepPlan | None = None
        #: per model: measured marginal forward seconds per token (:meth:`observe`)
        self.prefill_s_per_token: dict[str, float] = {}
        self._fit: dict[str, StepCostFit] = {}  # model -> its steps' seconds against their tokens
        self._deferred_since: dict[str, float] = {}  # model -> when its rows started waiting for realtime work
        self._forks: list[ForkWork] = []  # the forks the step being planned starts (``_prefill`` fills it)

    # -- per model ------------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> list[int]:
        """Free slots of the only model (one-model schedulers; see :meth:`free_slots_of`)."""
        if len(self._free) != 1:
            raise AttributeError("several models: use free_slots_of(model)")
        return next(iter(self._free.values()))

    @free_slots.setter
    def free_slots(self, value: list[int]) -> None:
        self._free[next(iter(self._free))] = value

    def free_slots_of(self, model: str) -> list[int]:
        return self._free[model]

    def add_model(self, name: str, limits: ModelLimits, memory_bytes: int = 0) -> None:
        """Serve one more model (a runner joining the device loop); ``memory_bytes`` (bytes mode) joins the
        memory budget: its KV cache and its encoder outputs' allowance.

        Raises:
            ValueError: the name is taken, or bytes mode without ``limits.kv_bytes_per_token``.
        """
        if name in self.limits:
            raise ValueError(f"model {name!r} is already served")
        if self.bytes_mode and limits.kv_bytes_per_token <= 0:
            raise ValueError(f"model {name!r}: the memory budget is in bytes; give kv_bytes_per_token")
        self.limits[name] = limits
        self._free[name] = list(range(limits.num_slots))[::-1]
        if self.bytes_mode:
            self.kv_budget += memory_bytes
        if self.metrics:
            for q in QOS_CLASSES:
                self.metrics.queue_depth.labels(name, q).set(0)

    def add_modality(self, modality: str, batching: EncodeBatching | None = None) -> None:
        """Batch ``modality`` inputs too (a runner joining the device loop encodes them); a modality already
        configured keeps its batching."""
        if modality not in self.encoders:
            self.encoders[modality] = batching or _default_encoders().get(modality, EncodeBatching())
            self._encode_q[modality] = []

    def _lim(self, req: Request) -> ModelLimits:
        return self.limits[req.model]

    def _unit(self, req: Request) -> int:
        """Memory units one cached token of ``req``'s model holds."""
        return self._lim(req).kv_bytes_per_token if self.bytes_mode else 1

    def _cost(self, req: Request) -> float:
        return self._lim(req).token_cost

    # -- intake ---------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request, or refuse it at once.

        Raises:
            ValueError: duplicate request id.
            ModelNotLoadedError: its model is not one of this scheduler's.
            InvalidRequestError: unknown QoS class or encode modality.
            CapacityError: (retryable) the request can never fit (``reason`` ``"never_fits"``) or its class
                queue is full (``reason`` ``"queue_full"``).
        """
        cfg = self.config
        if request.request_id in self._entries:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.model not in self.limits:
            raise ModelNotLoadedError(f"model {request.model!r} is not loaded in this process "
                                      f"(loaded: {', '.join(sorted(self.limits))})")
        if request.qos not in _RANK:
            raise InvalidRequestError(f"unknown QoS class {request.qos!r}; expected one of {QOS_CLASSES}")
        for item in request.encodes:
            if item.modality not in self.encoders:
                raise InvalidRequestError(f"no encoder for modality {item.modality!r}; have {sorted(self.encoders)}")
        lim = self._lim(request)
        need = len(request.prompt_ids) + request.max_new_tokens
        memory = self.kv_budget // max(1, self._unit(request))
        limit = min(lim.max_len, memory)
        if need > limit:
            self._reject(request, "never_fits",
                         f"request {request.request_id!r} needs {need} tokens of context (prompt + max_new_tokens) "
                         f"but at most {limit} fit (model {request.model!r}: max_len {lim.max_len}, memory budget "
                         f"{memory} tokens)")
        queued = sum(1 for r in self._queued.values() if r.qos == request.qos)
        if queued >= cfg.max_queue[request.qos]:
            self._reject(request, "queue_full",
                         f"the {request.qos} queue is full ({queued} requests); retry later")
        deadline = request.deadline_s
        if deadline is None:
            deadline = request.arrival_s + cfg.default_deadline_s[request.qos]
        fork_of = request.fork_of if self._can_fork_from(request) else None
        entry = _Entry(request, self._seq, deadline, {} if fork_of else {i.item_id: i for i in request.encodes},
                       request.arrival_s, fork_of=fork_of)
        self._entries[request.request_id] = entry
        self._set_phase(entry, Phase.QUEUED)
        self._seq += 1
        if fork_of is None:
            self._enqueue_encodes(request)

    def _enqueue_encodes(self, request: Request) -> None:
        entry = self._entries[request.request_id]
        entry.pending = {i.item_id: i for i in request.encodes}
        for item in request.encodes:
            self._encode_q[item.modality].append((request.request_id, item, request.arrival_s))

    def _can_fork_from(self, request: Request) -> bool:
        """``request`` names a fork source (:attr:`Request.fork_of`) of its model and prompt whose final prefill
        chunk is not planned yet: it then waits for that chunk instead of prefilling (and encoding) itself."""
        entry = self._entries.get(request.fork_of) if request.fork_of is not None else None
        src = entry.request if entry is not None else None
        if src is None or src.finished or src.model != request.model or src.prompt_ids != request.prompt_ids:
            return False
        if src.output_ids or entry.fork_of is not None:
            return False
        return entry.phase is Phase.QUEUED or (entry.phase is Phase.PREFILLING and entry.planned < len(src.context))

    def _reject(self, request: Request, reason: str, message: str) -> None:
        self.rejections[request.qos] += 1
        if self.metrics:
            self.metrics.rejections.labels(request.model, request.qos, reason).inc()
        err = CapacityError(message)
        err.reason = reason
        raise err

    def has_work(self) -> bool:
        return bool(self._queued or self.running or self.prefilling)

    @property
    def waiting(self) -> list[Request]:
        """Queued requests (encode pending or waiting for a slot), in priority order."""
        now = self.clock()
        return sorted(self._queued.values(), key=lambda r: self._key(r, now))

    def next_event_s(self) -> float | None:
        """Clock time at which an encode batch that is waiting for more items becomes due (None: none waits)."""
        times = [min(t for _, _, t in q) + self.encoders[m].max_delay_s
                 for m, q in self._encode_q.items() if q]
        return min(times) if times else None

    # -- priorities -----------------------------------------------------------------------------------------
    def slack_s(self, req: Request, now: float) -> float:
        """Deadline - now - the estimated time to generate what is left (``service_s_per_token`` per token)."""
        return self._entries[req.request_id].deadline - now - self.config.service_s_per_token * req.remaining

    def _effective(self, req: Request, now: float) -> tuple[float, float]:
        """(rank, deadline): a batch request short of slack is promoted (after interactive, before batch)."""
        entry = self._entries[req.request_id]
        rank = _RANK[req.qos]
        if req.qos == "batch" and self.slack_s(req, now) < self.config.promote_slack_s:
            return _PROMOTED, entry.deadline
        return rank, entry.deadline

    def _key(self, req: Request, now: float) -> tuple:
        rank, deadline = self._effective(req, now)
        return rank, deadline, self._entries[req.request_id].seq

    def _is_batch_work(self, req: Request, now: float) -> bool:
        return self._effective(req, now)[0] == _RANK["batch"]

    # -- planning -------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan one step. Called by the device loop (or the simulator) before the executors run the plan."""
        now = self.clock()
        self._step += 1
        encodes = self._plan_encodes(now)
        ready = sorted((r for r in self._queued.values() if not self._entries[r.request_id].pending),
                       key=lambda r: self._key(r, now))
        self._preempt_for_realtime(ready, now)
        self._preempt_for_memory(now)
        budget = float(self.config.token_budget)
        deferred = self._deferred_models(ready, now)
        order = sorted((r for r in self.running.values() if r.model not in deferred), key=lambda r: self._key(r, now))
        nodes = {r.request_id: 1 for r in order}  # every decoding request verifies its root
        budget -= sum(self._cost(r) for r in order)
        reserve = self._batch_reserve(order, ready, now)
        rt = [r for r in order if r.qos == "realtime"]
        budget -= self._grow_trees(rt, nodes, budget - reserve, self._mem_left(nodes, ()))
        prefills, budget = self._prefill(ready, nodes, budget, reserve, now, deferred)
        forks, self._forks = tuple(self._forks), []
        reserve = min(reserve, self._batch_reserve(order, [], now))  # what batch trees may still claim
        inter = [r for r in order if not self._is_batch_work(r, now) and r.qos != "realtime"]
        budget -= self._grow_trees(inter, nodes, budget - reserve, self._mem_left(nodes, prefills, forks))
        self._grow_trees([r for r in order if self._is_batch_work(r, now)], nodes, budget,
                         self._mem_left(nodes, prefills, forks))
        decodes = tuple(DecodeWork.of(r, r.slot, nodes[r.request_id], self._depth(r, nodes[r.request_id]))
                        for r in order)
        released, self._released = tuple(self._released), []
        preempted, self._preempted = tuple(self._preempted), []
        plan = StepPlan(self._step, tuple(prefills), decodes, released, encodes, preempted, forks)
        plan = replace(plan, admitted=admissions(self.requests, plan))
        kv = self.kv_fraction(plan)
        self.peak_kv_fraction = max(self.peak_kv_fraction, kv)
        if self.metrics:
            depths: dict[tuple[str, str], int] = {(m, q): 0 for m in self.limits for q in QOS_CLASSES}
            for r in self._queued.values():
                depths[(r.model, r.qos)] += 1
            self.metrics.observe_step(plan, depths, kv)
        self.last_plan = plan
        return plan

    def _held(self) -> int:
        """Memory units held: cached tokens of decoding and prefilling requests, plus encoder outputs (bytes
        mode)."""
        held = sum(len(r.context) * self._unit(r) for r in self.running.values())
        held += sum(self._entries[r.request_id].cached * self._unit(r) for r in self.prefilling.values())
        if self.bytes_mode:
            held += sum(e.encoded_bytes for e in self._entries.values())
        return held

    def kv_tokens(self, plan: StepPlan | None = None) -> int:
        """Memory held by running and prefilling requests (tokens, or bytes with ``memory_budget_bytes``), plus
        what ``plan`` writes (tree nodes, prefill chunks, the prompts copied into forks' slots)."""
        held = self._held()
        if plan is None:
            return held
        unit = lambda rid: self._unit(self._entries[rid].request)  # noqa: E731
        return held + sum(d.node_budget * unit(d.request_id) for d in plan.decodes) + sum(
            p.num_tokens * unit(p.request_id) for p in plan.prefills) + sum(
            f.context_len * unit(f.request_id) for f in plan.forks)

    def kv_fraction(self, plan: StepPlan | None = None) -> float:
        return self.kv_tokens(plan) / self.kv_budget

    def _mem_left(self, nodes: dict[str, int], prefills, forks=()) -> int:
        """Memory units left after holding, the planned tree nodes, the planned prefill chunks and the prompts
        copied into the planned forks' slots (a fork holds no cached tokens until the step's copy)."""
        entries = self._entries
        used = self._held() + sum(n * self._unit(entries[rid].request) for rid, n in nodes.items()) + sum(
            p.num_tokens * self._unit(entries[p.request_id].request) for p in prefills) + sum(
            f.context_len * self._unit(entries[f.request_id].request) for f in forks)
        return max(0, self.kv_budget - used)

    def _room(self, req: Request) -> int:
        return self._lim(req).max_len - len(req.context) + 1  # cache columns left for the root and its tree

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
        return self._held() > self.config.kv_high_watermark * self.kv_budget

    def _grow_trees(self, reqs: list[Request], nodes: dict[str, int], budget: float, mem: int) -> float:
        """Grow trees of ``reqs`` (priority order) toward what they want, within the token ``budget`` (cost
        units), the memory left ``mem`` and ``spec_token_limit``. Returns the budget spent."""
        limit = self.config.spec_token_limit
        spent = 0.0
        for r in reqs:
            extra = self._want(r) - nodes[r.request_id]
            if limit is not None:
                extra = min(extra, limit - sum(nodes.values()))
            extra = min(extra, math.floor((budget - spent) / self._cost(r) + 1e-9), mem // max(1, self._unit(r)))
            extra = max(0, extra)
            nodes[r.request_id] += extra
            spent += extra * self._cost(r)
            mem -= extra * self._unit(r)
        return spent

    def _batch_reserve(self, running: list[Request], ready: list[Request], now: float) -> float:
        """Budget kept for ``batch`` work this step: its guaranteed share, bounded by what it could use."""
        share = math.ceil(self.config.batch_share * self.config.token_budget)
        demand = sum((self._want(r) - 1) * self._cost(r) for r in running if self._is_batch_work(r, now))
        demand += sum(min(len(r.context) - self._entries[r.request_id].planned, share) * self._cost(r)
                      for r in self.prefilling.values() if self._is_batch_work(r, now))
        nxt = next((r for r in ready if self._is_batch_work(r, now)), None)
        if nxt is not None and self._can_take_slot(nxt):
            demand += len(nxt.context) * self._cost(nxt)
        return min(share, demand)

    def _can_take_slot(self, req: Request) -> bool:
        lim = self._lim(req)
        if not self._free[req.model]:
            return False
        if req.qos == "realtime":
            return True
        nonrt = sum(1 for r in list(self.running.values()) + list(self.prefilling.values())
                    if r.model == req.model and r.qos != "realtime")
        return nonrt < lim.num_slots - lim.reserved_realtime_slots

    def _deferred_models(self, ready: list[Request], now: float) -> set[str]:
        """Models whose rows wait this step (``realtime_step_budget_s``): not the model of any active realtime
        request, recent steps averaging more than the budget, and not yet waiting ``MAX_DEFER_S`` (after that
        one step of theirs joins, so a continuous subtitle stream slows captions but never starves them)."""
        limit = self.config.realtime_step_budget_s
        if limit is None:
            return set()
        active = [*self.running.values(), *self.prefilling.values(), *ready]
        # a realtime request still waiting for its encoder output counts too: its encode runs in this step
        rt_models = {r.model for r in [*active, *self._queued.values()] if r.qos == "realtime"}
        costly = {m for m in {r.model for r in active} - rt_models
                  if (mean := self.mean_step_s(m)) is not None and mean > limit} if rt_models else set()
        deferred = set()
        for m in costly:
            since = self._deferred_since.setdefault(m, now)
            if now - since < MAX_DEFER_S:
                deferred.add(m)
            else:
                del self._deferred_since[m]  # this step it runs; the wait starts again afterwards
        for m in set(self._deferred_since) - costly:
            del self._deferred_since[m]
        return deferred

    def mean_step_s(self, model: str) -> float | None:
        """Mean seconds of ``model``'s recent steps (the same forgetting as the per-token fit); None until one
        step was observed."""
        fit = self._fit.get(model)
        return fit.mean_s() if fit is not None else None

    def _prefill(self, ready: list[Request], nodes: dict[str, int], budget: float, reserve: float,
                 now: float, deferred: set[str] = frozenset()) -> tuple[list[PrefillWork], float]:
        """Prefill chunks in priority order: requests in the middle of a chunked prefill and newly admitted ones.
        Returns the work and the budget left."""
        cfg = self.config
        prefills: list[PrefillWork] = []
        growth = sum(n * self._unit(self._entries[rid].request) for rid, n in nodes.items())
        only_batch = False  # set when a higher request waits for tokens kept for batch's share
        rt_active = self._realtime_active()
        cap = cfg.realtime_prefill_chunk_tokens if rt_active else None
        guarded = 0  # non-realtime prefill tokens planned this step while realtime is active
        spent_s = 0.0  # their estimated seconds (realtime_prefill_budget_s)
        cands = sorted(list(self.prefilling.values()) + ready, key=lambda r: self._key(r, now))
        forks: list[ForkWork] = []
        self._forks = forks
        forked: set[str] = set()
        for req in cands:
            if req.model in deferred:
                continue  # its model waits while realtime work of another model is active
            cont = req.request_id in self.prefilling
            batch_work = self._is_batch_work(req, now)
            if only_batch and not batch_work:
                continue
            if not cont and not self._free[req.model]:
                continue  # no slot of its model (another model's request may still go)
            entry = self._entries[req.request_id]
            if entry.fork_of is not None or req.request_id in forked:
                continue  # it starts as a copy of its source's prefill (planned with that chunk)
            start = entry.planned if cont else 0
            left = len(req.context) - start
            room = math.floor((budget if batch_work else budget - reserve) / self._cost(req) + 1e-9)
            n = left
            if req.qos != "realtime":
                if cfg.max_prefill_chunk_tokens is not None:
                    n = min(n, cfg.max_prefill_chunk_tokens)
                est = self.prefill_s_per_token.get(req.model) if cfg.realtime_prefill_budget_s else None
                if cap is not None and est is not None:
                    allowed = math.floor((cfg.realtime_prefill_budget_s - spent_s) / est + 1e-9)
                    if not guarded:
                        allowed = max(allowed, MIN_CHUNK)  # the step's first prefill always progresses
                    n = min(n, allowed)
                    if n <= 0:
                        break  # realtime work is active: this step's prefill share is spent
                elif cap is not None:
                    n = min(n, cap - guarded)
                    if n <= 0:
                        break  # realtime work is active: this step's prefill share is spent
            if n > room:
                if req.qos == "realtime":
                    continue  # a later realtime request may still fit
                if room >= MIN_CHUNK:
                    n = room  # chunk it to what fits
                elif left * self._cost(req) <= budget:
                    only_batch = True  # batch may use its guaranteed share; nothing else overtakes
                    continue
                else:
                    break  # never let lower-priority work overtake a request that waits for budget
            if n < min(MIN_CHUNK, left):
                break
            if not cont:
                if not self._can_take_slot(req):
                    continue  # the model's other slots are reserved for realtime
                limit = self.kv_budget if req.qos == "realtime" else cfg.kv_high_watermark * self.kv_budget
                need = (len(req.context) + req.remaining) * self._unit(req)
                if (self.running or self.prefilling or prefills) and self._held() + growth + need > limit:
                    if req.qos == "realtime":
                        continue
                    break
                self._admit(req, now)
            prefills.append(PrefillWork.of(req, req.slot, n, start))
            entry.planned = start + n
            budget -= n * self._cost(req)
            growth += n * self._unit(req)
            if entry.planned >= len(req.context):
                growth += self._plan_forks(req, forks, growth, now)
                forked.update(fw.request_id for fw in forks)
            if req.qos != "realtime":
                guarded += n
                spent_s += n * self.prefill_s_per_token.get(req.model, 0.0)
            if batch_work:
                reserve = max(0.0, reserve - n * self._cost(req))
        return prefills, budget

    def _plan_forks(self, source: Request, forks: list[ForkWork], growth: int, now: float) -> int:
        """``source``'s final prefill chunk is planned: every request waiting to fork from it takes a slot now
        (when one is free and the memory budget has room for its context and output) and is planned as a
        :class:`ForkWork`; the others stop waiting and prefill themselves later. Costs no token budget (a fork adds
        no row to the forward). Returns the memory units the forks hold after the step."""
        limit = self.kv_budget if source.qos == "realtime" else self.config.kv_high_watermark * self.kv_budget
        held = 0
        for child in sorted((r for r in self._queued.values()
                             if self._entries[r.request_id].fork_of == source.request_id),
                            key=lambda r: self._entries[r.request_id].seq):
            entry = self._entries[child.request_id]
            entry.fork_of = None
            need = (len(child.context) + child.remaining) * self._unit(child)
            if not self._can_take_slot(child) or self._held() + growth + held + need > limit:
                continue  # no slot or no room: it prefills itself (the executor shares the prompt embeddings)
            self._admit(child, now)
            entry.planned = len(child.context)
            forks.append(ForkWork.of(child, child.slot, source.request_id))
            held += len(child.context) * self._unit(child)
        return held

    def _release_forks(self, source: Request) -> None:
        """``source`` ended before its final prefill chunk: requests waiting to fork from it prefill themselves
        (their media are queued for encoding now)."""
        for child in list(self._queued.values()):
            entry = self._entries[child.request_id]
            if entry.fork_of == source.request_id:
                entry.fork_of = None
                self._enqueue_encodes(child)

    def _admit(self, req: Request, now: float) -> None:
        entry = self._entries[req.request_id]
        if entry.phase is not Phase.QUEUED:
            raise RuntimeError(f"request {req.request_id!r} is {entry.phase}, not queued")
        req.slot = self._free[req.model].pop()
        req.status = RequestStatus.RUNNING
        self._set_phase(entry, Phase.PREFILLING)
        entry.cached = entry.planned = 0
        if entry.admit_rank is None:
            entry.admit_rank = self._admit_rank
            self._admit_rank += 1
        wait = now - entry.wait_since
        entry.waits.append(wait)
        if entry.first_prefill_s is None:
            entry.first_prefill_s = now
        if self.metrics:
            self.metrics.queue_wait.labels(req.model, req.qos).observe(wait)

    # -- preemption -----------------------------------------------------------------------------------------
    def _victims(self, classes: tuple[str, ...], model: str | None = None) -> list[Request]:
        """Preemptible requests of ``classes`` (of ``model`` when given): lowest class first, most recently
        first admitted first."""
        cands = [r for r in list(self.running.values()) + list(self.prefilling.values())
                 if r.qos in classes and (model is None or r.model == model)]
        return sorted(cands, key=lambda r: (-_RANK[r.qos], -self._entries[r.request_id].admit_rank))

    def _preempt_for_realtime(self, ready: list[Request], now: float) -> None:
        if not self.config.preempt:
            return
        free = {m: len(v) for m, v in self._free.items()}
        held = self._held()
        for req in (r for r in ready if r.qos == "realtime"):
            need_mem = held + (len(req.context) + req.remaining) * self._unit(req) - self.kv_budget
            slot_victims = self._victims(("batch",), req.model)
            while slot_victims and free[req.model] < 1:
                v = slot_victims.pop(0)
                need_mem -= self._freed(v)
                held -= self._freed(v)
                self._preempt(v, now)
                free[req.model] += 1
            mem_victims = self._victims(("batch",))
            while mem_victims and need_mem > 0:
                v = mem_victims.pop(0)
                need_mem -= self._freed(v)
                held -= self._freed(v)
                self._preempt(v, now)
                free[v.model] += 1
            if free[req.model] < 1 or need_mem > 0:
                return
            free[req.model] -= 1
            held += (len(req.context) + req.remaining) * self._unit(req)

    def _freed(self, req: Request) -> int:
        cached = len(req.context) if req.request_id in self.running else self._entries[req.request_id].cached
        return cached * self._unit(req)

    def _preempt_for_memory(self, now: float) -> None:
        """Preempt when holding plus one root per decoding request would exceed the memory budget."""
        victims = self._victims(QOS_CLASSES)
        while (len(self.running) + len(self.prefilling) > 1 and victims and self._held() + sum(
                self._unit(r) for r in self.running.values()) > self.kv_budget):
            self._preempt(victims.pop(0), now)

    def _preempt(self, req: Request, now: float) -> None:
        entry = self._entries[req.request_id]
        self._preempted.append(SlotRelease(req.request_id, req.slot, req.model))
        self._free[req.model].append(req.slot)
        req.slot = None
        req.status = RequestStatus.WAITING
        req.preemptions += 1
        req.spec_sent = False  # the runner frees its cache: the resume sends the spec again, with the output so far
        self._set_phase(entry, Phase.QUEUED)
        entry.wait_since = now
        entry.cached = entry.planned = 0
        self.preemptions += 1
        if self.metrics:
            self.metrics.preemptions.labels(req.model, req.qos).inc()

    # -- encode batching ------------------------------------------------------------------------------------
    def _realtime_active(self) -> bool:
        return any(r.qos == "realtime" for r in self.running.values()) or any(
            r.qos == "realtime" for r in self._queued.values()) or any(
            r.qos == "realtime" for r in self.prefilling.values())

    def _plan_encodes(self, now: float) -> tuple[EncodeWork, ...]:
        works = []
        rt_active = self._realtime_active()
        higher_active = any(r.qos != "batch" for r in self.running.values()) or any(
            r.qos != "batch" for r in self._queued.values())
        for modality, queue in self._encode_q.items():
            if not queue:
                continue
            bcfg = self.encoders[modality]
            entries = self._entries
            has_rt = any(entries[rid].request.qos == "realtime" for rid, _, _ in queue)
            due = min(t for _, _, t in queue) + bcfg.max_delay_s <= now + 1e-12
            if not (has_rt or due or len(queue) >= bcfg.max_batch):
                continue
            queue.sort(key=lambda e: self._key(entries[e[0]].request, now) + (e[1].item_id,))
            batch_cap = max(1, math.ceil(self.config.batch_share * bcfg.max_batch)) if higher_active else None
            taken, rest, n_batch, n_other = [], [], 0, 0
            for entry in queue:
                rid = entry[0]
                req = entries[rid].request
                is_batch = self._is_batch_work(req, now)
                is_rt = req.qos == "realtime"
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
    def observe(self, model: str, prefill_tokens: int, tokens: int, seconds: float) -> None:
        """One model's work in a step took ``seconds`` for ``tokens`` (prefill tokens + tree nodes; ``prefill_tokens``
        of them prefill). The model's marginal seconds per token is the slope of a least-squares line through
        its recent steps (exponentially forgotten, weight ``OBSERVE_DECAY`` per step): a step's fixed cost (the
        weights read, the drafts, Python) is the intercept, so small chunks do not make tokens look costly. Read
        by ``realtime_prefill_budget_s``; unknown until the model's steps differ enough in size."""
        fit = self._fit.setdefault(model, StepCostFit(OBSERVE_DECAY, MIN_CHUNK ** 2 / 4))
        fit.observe(tokens, seconds)
        slope = fit.slope()  # None while the steps are too alike in size to tell per-token from fixed cost
        if slope is not None:
            self.prefill_s_per_token[model] = slope

    def update(self, output: StepOutput) -> list[Request]:
        """Book a step's results (called by the device loop after the executors); returns finished requests."""
        finished = []
        now = self.clock()
        for enc in output.encoded:
            entry = self._entries.get(enc.request_id)
            self._in_flight.discard(enc.item_id)
            if entry is None or entry.request.finished:
                continue
            req = entry.request
            item = entry.pending.pop(enc.item_id, None)
            if item is not None and enc.error is None:
                entry.encoded_bytes += item.out_bytes
            if enc.error is not None:
                req.error = enc.error
                req.finish_reason = "error"
                self._finish(req)
                finished.append(req)
        for res in output.results:
            entry = self._entries[res.request_id]
            req = entry.request
            if req.finished:
                continue
            done = book_step_result(req, res, now)
            if res.is_prefill and res.error is None:
                if res.prefill_done:
                    entry.cached = entry.planned = 0
                    self._set_phase(entry, Phase.RUNNING)
                else:
                    entry.cached = entry.planned
            if done:
                self._finish(req)
                finished.append(req)
        return finished

    def _finish(self, req: Request) -> None:
        self._release_forks(req)
        req.status = RequestStatus.FINISHED
        entry = self._entries[req.request_id]
        self._set_phase(entry, Phase.FINISHED)
        entry.encoded_bytes = 0  # the request's encoder outputs are dropped with it
        for modality, queue in self._encode_q.items():
            self._encode_q[modality] = [e for e in queue if e[0] != req.request_id]
        if req.slot is not None:
            self._free[req.model].append(req.slot)
            self._released.append(SlotRelease(req.request_id, req.slot, req.model))
        if self.metrics and req.stats.target_steps:
            self.metrics.tau.labels(req.model, req.qos).observe(req.stats.tau)

    def cancel(self, request_id: str) -> Request | None:
        """Stop a request now (its client went away): finished with reason ``cancelled``, its slot released at
        the next step. Returns it, or None when it is unknown or already finished."""
        entry = self._entries.get(request_id)
        if entry is None or entry.request.finished:
            return None
        req = entry.request
        req.finish_reason = "cancelled"
        self._finish(req)
        return req

    def pop_finished(self, request_id: str) -> Request:
        """Forget a finished request (the caller has its output): its record leaves the registry, the one place
        a request is dropped (it left every phase index when it finished).

        Raises:
            KeyError: unknown request id.
        """
        return self._entries.pop(request_id).request

    def _set_phase(self, entry: _Entry, phase: Phase) -> None:
        """Move ``entry`` to ``phase``: the one writer of the phase indexes (``_queued``, ``prefilling``,
        ``running``). A record entering a phase goes to the end of that phase's order; staying keeps its place."""
        if entry.phase is phase:
            return
        rid = entry.request.request_id
        old = self._index.get(entry.phase)
        if old is not None:
            del old[rid]
        new = self._index.get(phase)
        if new is not None:
            new[rid] = entry.request
        entry.phase = phase

    def queue_waits(self, request_id: str) -> list[float]:
        """Seconds each (re)admission of the request waited (arrival or preemption to prefill)."""
        return list(self._entries[request_id].waits)
