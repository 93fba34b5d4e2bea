"""First-come-first-served scheduler: the engine's default policy.

Admits waiting requests in arrival order while KV slots are free, and grants each running request the tree
size its drafters ask for, within a per-step token budget (total tree nodes verified). The QoS scheduler
replaces this policy, not the loop.
"""

from __future__ import annotations

import time
from collections import deque

from dataclasses import replace

from specstream.schedulers.plan import (
    admissions,
    book_step_result,
    DecodeWork,
    ForkWork,
    PrefillWork,
    Request,
    RequestStatus,
    SlotRelease,
    StepOutput,
    StepPlan,
)


class FifoScheduler:
    """FIFO admission, continuous batching.

    Args:
        num_slots: KV cache slots (concurrent requests).
        max_len: tokens per slot (prompt + output + tree).
        max_nodes_per_request: largest tree granted to one request (root included).
        token_budget: most tree nodes verified per step across the batch (prefill tokens count too).
        max_tree_depth: deepest draft token.
    """

    def __init__(self, num_slots: int, max_len: int, max_nodes_per_request: int = 64, token_budget: int = 4096,
                 max_tree_depth: int = 16):
        self.num_slots = num_slots
        self.max_len = max_len
        self.max_nodes_per_request = max_nodes_per_request
        self.token_budget = token_budget
        self.max_tree_depth = max_tree_depth
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.free_slots: list[int] = list(range(num_slots))[::-1]
        self._released: list[SlotRelease] = []
        self.metrics = None  # no Prometheus metrics of its own
        self.multi_model = False
        self.clock = time.monotonic
        self._step = 0

    # -- intake ---------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- planning -------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan one step. Called by the engine loop before :meth:`Executor.execute`."""
        self._step += 1
        budget = self.token_budget
        decodes = []
        for req in self.running.values():
            nodes = max(1, min(req.requested_nodes if req.speculate else 1, self.max_nodes_per_request))
            room = self.max_len - len(req.context) + 1  # cache columns left for the root and its tree
            nodes = max(1, min(nodes, room, budget - (len(self.running) - len(decodes) - 1)))
            depth = max(0, min(req.remaining - 1, self.max_tree_depth, room - 1))
            decodes.append(DecodeWork.of(req, req.slot, nodes, depth))
            budget -= nodes
        prefills, forks = [], []
        children: dict[str, list[Request]] = {}  # fork source id -> its waiting forks, in queue order
        for r in self.waiting:
            if r.fork_of is not None:
                children.setdefault(r.fork_of, []).append(r)
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            if prefills and len(req.prompt_ids) > budget:
                break
            self.waiting.popleft()
            req.slot = self.free_slots.pop()
            req.status = RequestStatus.RUNNING
            prefills.append(PrefillWork.of(req, req.slot))
            budget -= len(req.prompt_ids)
            forks.extend(self._forks_of(req, children.get(req.request_id, ())))
        released, self._released = tuple(self._released), []
        plan = StepPlan(self._step, tuple(prefills), tuple(decodes), released, forks=tuple(forks))
        return replace(plan, admitted=admissions(self.requests, plan))

    def _forks_of(self, source: Request, children) -> list[ForkWork]:
        """Waiting requests that fork from ``source`` (:attr:`Request.fork_of`, same prompt), while slots are
        free: they start from its prefill (one prompt prefill for ``n`` choices). The others prefill themselves
        when their turn comes.

        ``children`` are the requests queued with ``fork_of == source.request_id`` when the step's planning began,
        in queue order (indexed once per step: a scan of the whole queue per admitted request made admitting
        ``n`` requests cost O(n^2)); those planned since (status no longer waiting) are passed over."""
        out = []
        for child in [r for r in children if r.status is RequestStatus.WAITING and r.prompt_ids == source.prompt_ids
                      and not r.output_ids]:
            if not self.free_slots:
                break
            self.waiting.remove(child)
            child.slot = self.free_slots.pop()
            child.status = RequestStatus.RUNNING
            out.append(ForkWork.of(child, child.slot, source.request_id))
        return out

    # -- booking --------------------------------------------------------------------------------------------
    def update(self, output: StepOutput) -> list[Request]:
        """Book a step's results; returns the requests that finished in it."""
        finished = []
        now = self.clock()
        for res in output.results:
            req = self.requests[res.request_id]
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
        if req.slot is not None:
            self.free_slots.append(req.slot)
            self._released.append(SlotRelease(req.request_id, req.slot, req.model))

    def pop_finished(self, request_id: str) -> Request:
        """Forget a finished request (the caller has its output)."""
        return self.requests.pop(request_id)

    def cancel(self, request_id: str) -> Request | None:
        """Stop a request now: finished with reason ``cancelled`` (out of the queue, or its slot released at the
        next step). Returns it, or None when it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.status is RequestStatus.FINISHED:
            return None
        req.finish_reason = "cancelled"
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req)
        return req

    def add_model(self, name: str, limits, memory_bytes: int = 0) -> None:
        """FIFO serves one model.

        Raises:
            ValueError: always.
        """
        raise ValueError("this loop's scheduler serves one model")

    def add_modality(self, modality: str, batching=None) -> None:
        """FIFO plans no encodes.

        Raises:
            ValueError: always.
        """
        raise ValueError("the FIFO scheduler plans no encodes")

    def observe(self, model: str, prefill_tokens: int, tokens: int, seconds: float) -> None:
        """FIFO has no cost model: step times are ignored."""

    def next_event_s(self) -> float | None:
        """FIFO has no timed events."""
        return None
