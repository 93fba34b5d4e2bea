"""Baseline policies the QoS scheduler is benchmarked against (``specstream bench scheduler``).

- :class:`FifoEncodeScheduler`: the engine's FIFO continuous batching, with encode work run in arrival order
  (every queued item of a modality, up to ``max_batch``, on the next step); no classes, no preemption.
- :class:`StaticBatchScheduler`: static batching: waits until ``batch_size`` requests are ready (or the oldest
  has waited ``max_wait_s``), runs that batch to completion, and only then admits the next one.

Both ignore QoS classes and deadlines and never refuse a request.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from specstream.schedulers.fifo import FifoScheduler
from dataclasses import replace

from specstream.schedulers.plan import EncodeWork, Request, StepOutput, StepPlan, admissions


class FifoEncodeScheduler(FifoScheduler):
    """:class:`FifoScheduler` plus encode batches in arrival order.

    Args:
        num_slots, max_len, max_nodes_per_request, token_budget, max_tree_depth: as :class:`FifoScheduler`.
        encode_max_batch: most items per encoder batch.
        clock: seconds (the simulator's virtual clock).
    """

    def __init__(self, num_slots: int, max_len: int, max_nodes_per_request: int = 64, token_budget: int = 4096,
                 max_tree_depth: int = 16, encode_max_batch: int = 8, clock: Callable[[], float] = time.monotonic):
        super().__init__(num_slots, max_len, max_nodes_per_request, token_budget, max_tree_depth)
        self.encode_max_batch = encode_max_batch
        self.clock = clock
        self._encoding: dict[str, set[str]] = {}  # request id -> pending item ids
        self._encode_q: list[tuple[str, object]] = []  # (request id, item) in arrival order
        self.preemptions = 0
        self.peak_kv_fraction = 0.0
        self.last_plan: StepPlan | None = None

    def add(self, request: Request) -> None:
        if not request.encodes:
            super().add(request)
            return
        self._register(request)  # queued, not in ``waiting`` until its encodes are booked
        self._encoding[request.request_id] = {i.item_id for i in request.encodes}
        self._encode_q.extend((request.request_id, i) for i in request.encodes)

    def has_work(self) -> bool:
        return bool(self._encoding) or super().has_work()

    def next_event_s(self) -> float | None:
        return None

    def _encodes(self) -> tuple[EncodeWork, ...]:
        by_mod: dict[str, list] = {}
        rest = []
        for rid, item in self._encode_q:
            group = by_mod.setdefault(item.modality, [])
            (group if len(group) < self.encode_max_batch else rest).append((rid, item))
        self._encode_q = rest
        return tuple(EncodeWork(m, tuple(items)) for m, items in by_mod.items())

    def _admit_gate(self) -> bool:
        return True

    def schedule(self) -> StepPlan:
        encodes = self._encodes()
        if self._admit_gate():
            plan = super().schedule()
        else:
            saved, self.waiting = self.waiting, type(self.waiting)()
            plan = super().schedule()
            self.waiting = saved
        plan = StepPlan(plan.step, plan.prefills, plan.decodes, plan.released, encodes, plan.preempted, plan.forks,
                        plan.admitted)
        plan = replace(plan, admitted=plan.admitted + admissions(self.requests, plan))
        held = sum(len(r.context) for r in self.running.values())
        kv = (held + plan.num_nodes) / (self.num_slots * self.max_len)
        self.peak_kv_fraction = max(self.peak_kv_fraction, kv)
        self.last_plan = plan
        return plan

    def update(self, output: StepOutput) -> list[Request]:
        finished = []
        for enc in output.encoded:
            pending = self._encoding.get(enc.request_id)
            if pending is None:
                continue
            pending.discard(enc.item_id)
            if not pending:
                del self._encoding[enc.request_id]
                self.waiting.append(self.requests[enc.request_id])
        finished.extend(super().update(output))
        return finished


class StaticBatchScheduler(FifoEncodeScheduler):
    """Static batching: admit ``batch_size`` ready requests at once (or fewer after ``max_wait_s``), only when
    the previous batch has finished; the batch runs to completion.

    Args:
        batch_size: requests per batch (at most ``num_slots``).
        max_wait_s: the oldest ready request waits at most this long for a full batch.
    """

    def __init__(self, num_slots: int, max_len: int, batch_size: int = 8, max_wait_s: float = 0.05, **kwargs):
        super().__init__(num_slots, max_len, **kwargs)
        self.batch_size = min(batch_size, num_slots)
        self.max_wait_s = max_wait_s
        self._batch_open = False
        self._admitted_in_batch = 0

    def _admit_gate(self) -> bool:
        if self.running:
            return False
        if not self.waiting:
            return False
        if len(self.waiting) >= self.batch_size:
            return True
        return self.clock() - self.waiting[0].arrival_s >= self.max_wait_s

    def next_event_s(self) -> float | None:
        if self.running or not self.waiting or len(self.waiting) >= self.batch_size:
            return None
        return self.waiting[0].arrival_s + self.max_wait_s

    def schedule(self) -> StepPlan:
        if self._admit_gate():
            # admit at most one batch: hide the requests beyond it
            extra = list(self.waiting)[self.batch_size:]
            for _ in extra:
                self.waiting.pop()
            plan = super().schedule()
            self.waiting.extend(extra)
            return plan
        return super().schedule()
