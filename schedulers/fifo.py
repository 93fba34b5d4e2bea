"""First-come-first-served scheduler: the engine's default policy.

Admits waiting requests in arrival order while KV slots are free, and grants each running request the tree
size its drafters ask for, within a per-step token budget (total tree nodes verified). The QoS scheduler
replaces this policy, not the loop.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

from specstream.schedulers.plan import (
    admissions,
    book_step_result,
    DecodeWork,
    ForkWork,
    Phase,
    PrefillWork,
    Request,
    RequestsView,
    RequestStatus,
    SlotRelease,
    StepOutput,
    StepPlan,
)


@dataclass
class _Entry:
    """The scheduler's one record of a request: the request and its phase (which fixes its queue membership).
    Created by :meth:`FifoScheduler._register`, moved between phases only by :meth:`FifoScheduler._set_phase`,
    dropped only by :meth:`FifoScheduler.pop_finished`."""

    request: Request
    phase: Phase = Phase.QUEUED


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
        #: the one registry: request id -> its record, from add() to pop_finished(), in arrival order
        self._entries: dict[str, _Entry] = {}
        #: request id -> Request, a read-only view of ``_entries``
        self.requests = RequestsView(self._entries)
        # Ordered views of the records by phase, so a step walks only the requests it plans:
        self.waiting: deque[Request] = deque()  # the queue (Phase.QUEUED), in admission order
        self.running: dict[str, Request] = {}  # Phase.RUNNING (prefilled, decoding), in the order they prefilled
        self.free_slots: list[int] = list(range(num_slots))[::-1]
        self._released: list[SlotRelease] = []
        self.metrics = None  # no Prometheus metrics of its own
        self.multi_model = False
        self.clock = time.monotonic
        self._step = 0

    # -- intake ---------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request.

        Raises:
            ValueError: duplicate request id.
        """
        self._register(request)
        self.waiting.append(request)

    def _register(self, request: Request) -> _Entry:
        """File ``request``'s record (phase ``QUEUED``); the caller puts it in a queue.

        Raises:
            ValueError: duplicate request id.
        """
        if request.request_id in self._entries:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        entry = self._entries[request.request_id] = _Entry(request)
        return entry

    def _set_phase(self, request: Request, phase: Phase) -> None:
        """Move ``request``'s record to ``phase``: the one writer of the ``running`` index (``waiting`` is a queue
        the planner pops in order). Entering ``RUNNING`` goes to the end of its order; staying keeps its place."""
        entry = self._entries[request.request_id]
        if entry.phase is phase:
            return
        if entry.phase is Phase.RUNNING:
            del self.running[request.request_id]
        if phase is Phase.RUNNING:
            self.running[request.request_id] = request
        entry.phase = phase

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
            self._set_phase(req, Phase.PREFILLING)
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
            self._set_phase(child, Phase.PREFILLING)
            out.append(ForkWork.of(child, child.slot, source.request_id))
        return out

    # -- booking --------------------------------------------------------------------------------------------
    def update(self, output: StepOutput) -> list[Request]:
        """Book a step's results; returns the requests that finished in it."""
        finished = []
        now = self.clock()
        for res in output.results:
            req = self._entries[res.request_id].request
            done = book_step_result(req, res, now)
            if res.is_prefill:
                self._set_phase(req, Phase.RUNNING)
            if done:
                self._finish(req)
                finished.append(req)
        return finished

    def _finish(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        self._set_phase(req, Phase.FINISHED)
        if req.slot is not None:
            self.free_slots.append(req.slot)
            self._released.append(SlotRelease(req.request_id, req.slot, req.model))

    def pop_finished(self, request_id: str) -> Request:
        """Forget a finished request (the caller has its output): its record leaves the registry, the one place
        a request is dropped (it left the queue and the running index when it finished).

        Raises:
            KeyError: unknown request id.
        """
        return self._entries.pop(request_id).request

    def cancel(self, request_id: str) -> Request | None:
        """Stop a request now: finished with reason ``cancelled`` (out of the queue, or its slot released at the
        next step). Returns it, or None when it is unknown or already finished."""
        entry = self._entries.get(request_id)
        if entry is None or entry.phase is Phase.FINISHED:
            return None
        req = entry.request
        req.finish_reason = "cancelled"
        if entry.phase is Phase.QUEUED and req in self.waiting:  # (a baseline's request may still be encoding)
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
