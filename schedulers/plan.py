"""Typed messages of the engine loop: requests (scheduler state), step plans and step outputs.

``Scheduler.schedule() -> StepPlan`` decides; ``Executor.execute(plan) -> StepOutput`` runs tensors;
``Scheduler.update(output)`` books the results (vLLM's ``EngineCore.step``). Nothing here holds a tensor.

The scheduler's :class:`Request` is mutable scheduler state and never leaves the scheduler: a runner learns of a
request once, from the frozen :class:`RequestSpec` in :attr:`StepPlan.admitted` (again after a preemption, with
its committed tokens), and each step's work items carry ids and per-step numbers only.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from specstream.types import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued: encode pending, or waiting for a slot (new or preempted)
    RUNNING = "running"
    FINISHED = "finished"


class Phase(enum.Enum):
    """Where a request stands in a scheduler: the state field of its one record (the scheduler's registry entry),
    from which its queue membership follows. Finer than :class:`RequestStatus`: an admitted request is
    ``PREFILLING`` (slot held, prefill not booked yet) before it is ``RUNNING`` (decoding)."""

    QUEUED = "queued"  # not admitted: encode pending, waiting for a slot, or preempted
    PREFILLING = "prefilling"  # slot held, prefill (chunks) not all booked
    RUNNING = "running"  # prefilled, decoding
    FINISHED = "finished"  # done, cancelled or failed; the record stays until ``pop_finished``


class RequestsView(Mapping):
    """Read-only ``request id -> Request`` view of a scheduler's registry (``request id -> record`` whose
    ``request`` field is the :class:`Request`). Holds nothing of its own: a record added or popped shows at once.
    ``get``, ``values`` and ``items`` are written out because the loop and :func:`admissions` call them every
    step."""

    __slots__ = ("_entries",)

    def __init__(self, entries: dict):
        self._entries = entries

    def __getitem__(self, request_id: str) -> "Request":
        return self._entries[request_id].request

    def get(self, request_id: str, default=None):
        entry = self._entries.get(request_id)
        return default if entry is None else entry.request

    def __contains__(self, request_id) -> bool:
        return request_id in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def values(self):
        return [e.request for e in self._entries.values()]

    def items(self):
        return [(rid, e.request) for rid, e in self._entries.items()]

    def __repr__(self) -> str:
        return f"RequestsView({list(self._entries)!r})"


#: QoS classes, highest priority first.
QOS_CLASSES: tuple[str, ...] = ("realtime", "interactive", "batch")


@dataclass(frozen=True)
class EncodeItem:
    """One piece of media a request needs encoded before its prefill (tensor-free: the executor's encoder
    registry knows where the pixels or samples are, by ``item_id``).

    Attributes:
        item_id: unique id (the executor's key for the media and for the encoder output).
        modality: encoder name in the executor's registry, e.g. ``"image"`` or ``"audio"``.
        units: work size for the cost model: images for ``"image"``, seconds of audio for ``"audio"``.
        out_bytes: bytes its encoder output holds until the request ends (the memory budget counts them).
    """

    item_id: str
    modality: str
    units: float = 1.0
    out_bytes: int = 0


@dataclass(frozen=True)
class MMInput:
    """One multimodal input of a request: an image, an audio window (and, once computed, its encoder output,
    which the executor keeps in the request's record, not here).

    Attributes:
        item_id: unique id (the encode batch's key).
        modality: ``"image"`` or ``"audio"``: which encoder of the device loop takes it.
        data: the payload the model runner's encoder reads (prepared pixels, a log-mel window); opaque to the
            scheduler, which never looks inside.
        units: cost-model size: images for ``"image"``, seconds of audio for ``"audio"``.
        out_bytes: bytes of its encoder output once computed (counted against the memory budget until the request
            ends).
    """

    item_id: str
    modality: str
    data: object = field(default=None, compare=False, repr=False)
    units: float = 1.0
    out_bytes: int = 0

    def encode_item(self) -> "EncodeItem":
        return EncodeItem(self.item_id, self.modality, self.units, self.out_bytes)


@dataclass
class RequestStats:
    """Per-request speculation statistics.

    ``target_steps`` counts target forwards that included the request, prefill included;
    ``prefill_steps`` counts those that were prefill (one per prefill chunk; the last one commits the first token
    and verifies no draft); ``accepted_per_step`` counts draft tokens accepted per verification step (bonus token
    excluded), one entry per verify step, so ``target_steps == prefill_steps + len(accepted_per_step)`` unless
    the request ended in an error; ``tau`` = committed tokens / target steps.
    """

    target_steps: int = 0
    prefill_steps: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    committed: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    first_token_s: float | None = None

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted_per_step) / len(self.accepted_per_step) if self.accepted_per_step else 0.0

    @property
    def tau(self) -> float:
        return self.committed / self.target_steps if self.target_steps else 0.0

    def to_dict(self) -> dict:
        return {
            "target_steps": self.target_steps,
            "accepted_per_step": list(self.accepted_per_step),
            "mean_accepted": round(self.mean_accepted, 6),
            "tau": round(self.tau, 6),
            "draft_s": round(self.draft_s, 6),
            "verify_s": round(self.verify_s, 6),
        }


_JOIN_LOCK = threading.Lock()


@dataclass
class Request:
    """A text-generation request as the scheduler sees it (token ids, limits, state; no tensors).

    Attributes:
        request_id: unique id.
        prompt_ids: prompt token ids (non-empty).
        max_new_tokens: exact cap on generated tokens.
        sampling: greedy or sampling parameters.
        eos_token_ids: tokens that end the output (included in it).
        speculate: False decodes one token per target step.
        qos, deadline_s: QoS class and absolute deadline (monotonic seconds) for QoS schedulers.
        draft_prompt_ids: the prompt as text-only drafters see it (a VLM prompt without its image tokens);
            None = ``prompt_ids``.
        visual_span: ``[start, end)`` prompt positions of the visual tokens: the target's attention mass on
            them is exported per committed token (``RequestStepResult.visual_attention``).
        encodes: media to encode before the prefill (QoS scheduler; the FIFO scheduler ignores it).
        preemptions: times the request lost its KV cache to a higher class or memory pressure; it then waits,
            and resumes by prefilling ``prompt_ids + output_ids`` (re-sent as :attr:`RequestSpec.committed`).
        logits_processors: per-request rules applied to every verified logits row along that row's own token
            path, before argmax / sampling (:mod:`specstream.stages.speculative.logits`; objects, no tensors).
        model: the model runner of the device loop that serves the request (``"default"`` in a one-model engine).
        mm_inputs: images / audio windows to encode before the prefill (:class:`MMInput`); their encode items
            are :attr:`encodes`.
        draft_hypothesis: a previous hypothesis of the same content (generated ids of the previous ASR window or
            keyframe caption) that the temporal drafter drafts from; None for none.
        logprobs: also return each committed token's log-probability under the target (natural log, after the
            logits processors; after the warpers for sampled requests) in :attr:`output_logprobs` (vLLM's
            ``logprobs=0``). Speculation does not change them: a token's row is the one that verified it.
        fork_of: the id of a request of the same model with the same prompt (OpenAI's ``n`` choices) whose prefill
            this one shares: it is held back while that request prefills, and when the final prefill chunk of the
            source is planned it takes a slot of its own and receives a copy of the prompt's KV cache and of the
            last prompt row's logits (:class:`ForkWork`) instead of prefilling; it then decodes alone with its own
            random stream. Added after its source and before that prefill ends (``DeviceLoop.submit_group``).
            When the source ends before its prefill, or no slot is free at the fork, it prefills itself.
    """

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    speculate: bool = True
    qos: str = "interactive"
    deadline_s: float | None = None
    arrival_s: float = field(default_factory=time.monotonic)
    draft_prompt_ids: list[int] | None = None
    visual_span: tuple[int, int] | None = None
    encodes: tuple[EncodeItem, ...] = ()
    logits_processors: tuple = ()
    logprobs: bool = False
    draft_hypothesis: tuple[int, ...] | None = None
    model: str = "default"
    mm_inputs: tuple[MMInput, ...] = ()
    fork_of: str | None = None
    # state
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: dict | None = None
    requested_nodes: int = 1
    stats: RequestStats = field(default_factory=RequestStats)
    preemptions: int = 0
    prefilled: int = 0  # context tokens in the KV cache (a chunked prefill advances it step by step)
    spec_sent: bool = False  # the runner holds this request's RequestSpec (False again after a preemption)
    _joined_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.mm_inputs and not self.encodes:
            self.encodes = tuple(m.encode_item() for m in self.mm_inputs)

    def _joined(self, key: str, prompt: list[int]) -> list[int]:
        """``prompt + output_ids`` kept as one list that grows by the new tokens only: O(new tokens) per step
        instead of a copy of the whole context per read. Rebuilt when ``prompt`` or
        ``output_ids`` was replaced or shrank. Callers read it and never change it."""
        with _JOIN_LOCK:  # the event loop may read a length while the device thread extends
            cached = self._joined_cache.get(key)
            out = self.output_ids
            if cached is None or cached[0] is not prompt or cached[1] is not out or cached[2] > len(out):
                cached = [prompt, out, len(out), prompt + out]
                self._joined_cache[key] = cached
            elif cached[2] < len(out):
                n = len(out)
                cached[3].extend(out[cached[2]:n])
                cached[2] = n
            return cached[3]

    @property
    def context(self) -> list[int]:
        """Prompt + committed tokens (read-only: a list shared between reads)."""
        return self._joined("target", self.prompt_ids)

    @property
    def draft_context(self) -> list[int]:
        """What drafters see: the draft prompt (text only for a VLM) + committed tokens (read-only, shared)."""
        return self._joined("draft", self.prompt_ids if self.draft_prompt_ids is None else self.draft_prompt_ids)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class RequestSpec:
    """What a runner knows of a request: an immutable copy of the scheduler's :class:`Request` minus its state,
    sent once, in :attr:`StepPlan.admitted`, in the first plan that gives the runner work for it (an encode, a
    prefill chunk or a fork), and again when it resumes after a preemption (then :attr:`committed` holds the
    tokens it had committed). The runner keeps its own committed-token list from there on (it commits the
    tokens); the scheduler books the same tokens from the step results into its ``Request``. Runners never see
    the scheduler's ``Request``.

    Attributes: as :class:`Request`'s of the same name (lists made tuples), plus
        committed: the tokens committed before this admission (empty for a new request; a resumed one's output so
            far: its prefill context is ``prompt_ids + committed``).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    speculate: bool = True
    qos: str = "interactive"
    model: str = "default"
    draft_prompt_ids: tuple[int, ...] | None = None
    visual_span: tuple[int, int] | None = None
    logits_processors: tuple = ()
    logprobs: bool = False
    draft_hypothesis: tuple[int, ...] | None = None
    mm_inputs: tuple[MMInput, ...] = ()
    fork_of: str | None = None
    committed: tuple[int, ...] = ()

    @staticmethod
    def of(req: Request) -> "RequestSpec":
        """The spec of ``req`` as it stands (its committed tokens included): O(context), once per admission."""
        return RequestSpec(
            req.request_id, tuple(req.prompt_ids), req.max_new_tokens, req.sampling, tuple(req.eos_token_ids),
            req.speculate, req.qos, req.model,
            None if req.draft_prompt_ids is None else tuple(req.draft_prompt_ids),
            None if req.visual_span is None else tuple(req.visual_span), tuple(req.logits_processors),
            req.logprobs, None if req.draft_hypothesis is None else tuple(req.draft_hypothesis),
            tuple(req.mm_inputs), req.fork_of, tuple(req.output_ids))


def admissions(requests, plan: "StepPlan") -> tuple[RequestSpec, ...]:
    """The specs of the requests ``plan``'s work names (:meth:`StepPlan.request_ids`, in order, each once) whose
    runner does not hold one yet (:attr:`Request.spec_sent` False: new, or preempted since); marks them sent.
    Every scheduler builds :attr:`StepPlan.admitted` with it.

    The requests that fork from a source whose final prefill chunk is in ``plan`` (:attr:`Request.fork_of`) are
    admitted with it too, with or without a :class:`ForkWork` of their own: the runner hands each the source's
    prompt embeddings at that chunk, and one that found no slot prefills itself with them later."""
    out = []

    def add(req):
        if req is not None and not req.spec_sent and req.status is not RequestStatus.FINISHED:
            req.spec_sent = True
            out.append(RequestSpec.of(req))

    for rid in plan.request_ids():
        add(requests.get(rid))
    sources = {p.request_id for p in plan.prefills if p.final}
    if sources:
        for req in list(requests.values()):
            if req.fork_of in sources:
                add(req)
    return tuple(out)


@dataclass(frozen=True)
class PrefillWork:
    """Prefill context positions ``[start, start + num_tokens)`` of request ``request_id`` into ``slot``.

    The context is the prompt; for a request resuming after preemption it is the prompt plus the tokens committed
    before it lost its KV cache (recompute: :attr:`RequestSpec.committed` of its new admission), so the resumed
    output continues unchanged. A long prefill is split into chunks over several steps (vLLM's chunked prefill):
    each chunk attends the chunks before it, already in the cache; only the :attr:`final` chunk yields the next
    token. ``context_len`` is the whole context's length (the runner checks its own record against it).
    """

    request_id: str
    slot: int
    num_tokens: int
    start: int = 0
    context_len: int = 0
    model: str = "default"

    @staticmethod
    def of(req: Request, slot: int, num_tokens: int = -1, start: int = 0) -> "PrefillWork":
        """The chunk ``[start, start + num_tokens)`` of ``req``'s context (``num_tokens`` -1: to its end)."""
        n = len(req.prompt_ids) + len(req.output_ids)
        return PrefillWork(req.request_id, slot, n - start if num_tokens < 0 else num_tokens, start, n, req.model)

    @property
    def final(self) -> bool:
        """True when this chunk ends the context (its last row yields the first new token)."""
        return self.start + self.num_tokens >= self.context_len


@dataclass(frozen=True)
class ForkWork:
    """Request ``request_id`` starts as a copy of ``source`` (the id of a request whose final prefill chunk is in
    the same plan): after that chunk's forward the executor copies the source slot's KV cache (columns
    ``[0, prompt)``) into ``slot`` and samples the fork's first token from the source's last prompt row with the
    fork's own random stream. The fork's prompt is never run through the target: ``n`` choices cost one prefill
    (the idea of vLLM's parallel sampling, whose choices share the prompt's KV blocks, and of SGLang's ``fork``;
    here slots are static, so the prompt columns are copied once, on the device). ``context_len``: the fork's
    context (its prompt), which must be what the source prefilled.
    """

    request_id: str
    slot: int
    source: str
    context_len: int = 0
    model: str = "default"

    @staticmethod
    def of(req: Request, slot: int, source: str) -> "ForkWork":
        return ForkWork(req.request_id, slot, source, len(req.prompt_ids) + len(req.output_ids), req.model)


@dataclass(frozen=True)
class EncodeWork:
    """One encoder batch: every item has the same ``modality``; ``items`` are in priority order.

    Attributes:
        modality: encoder name in the executor's registry.
        items: the media to encode, each tagged with the request it belongs to.
    """

    modality: str
    items: tuple[tuple[str, EncodeItem], ...]  # (request id, item)

    @property
    def units(self) -> float:
        return sum(item.units for _, item in self.items)


@dataclass(frozen=True)
class DecodeWork:
    """One speculative step for request ``request_id``: a tree of at most ``node_budget`` nodes (root included) and
    draft depth at most ``max_depth``; ``node_budget == 1`` means plain decoding (root only). ``context_len``:
    the request's context (prompt + committed tokens) as the scheduler booked it when planning (the cost model's
    KV read)."""

    request_id: str
    slot: int
    node_budget: int
    max_depth: int
    context_len: int = 0
    model: str = "default"

    @staticmethod
    def of(req: Request, slot: int, node_budget: int, max_depth: int) -> "DecodeWork":
        return DecodeWork(req.request_id, slot, node_budget, max_depth, len(req.prompt_ids) + len(req.output_ids),
                          req.model)


@dataclass(frozen=True)
class TokenDelta:
    """What one step committed for one request, as an immutable record made on the device thread and posted to
    the caller's event loop (:meth:`DeviceLoop.submit`): the caller never reads a list the device thread extends.

    Attributes:
        request_id: the request.
        new_tokens: the token ids committed in this step (empty for a step that only finished or failed it).
        logprobs: their log-probabilities (natural log) when the request asked for them, else ``()``.
        total: committed tokens of the request after this delta.
        finished: the request ended in this step.
        finish_reason: ``eos``, ``length``, ``cancelled``, ``error`` or None while it runs.
        error: the request's error (``{"code", "message"}``) or None.
    """

    request_id: str
    new_tokens: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    total: int = 0
    finished: bool = False
    finish_reason: str | None = None
    error: dict | None = None

    @staticmethod
    def of(req: Request, new_tokens) -> "TokenDelta":
        """The delta of ``req`` after a step that committed ``new_tokens`` (call on the device thread)."""
        new = tuple(new_tokens)
        lps = tuple(req.output_logprobs[len(req.output_logprobs) - len(new):]) if req.logprobs and new else ()
        return TokenDelta(req.request_id, new, lps, len(req.output_ids), req.finished, req.finish_reason,
                          None if req.error is None else dict(req.error))


@dataclass(frozen=True)
class SlotRelease:
    """A slot the executor must let go before the step: a finished request's (``StepPlan.released``: drop all its
    executor state) or a preempted one's (``StepPlan.preempted``: free its KV cache, keep its record).

    Attributes:
        request_id: the request.
        slot: its KV cache slot in ``model``'s executor.
        model: the runner of the device loop that holds the slot (``"default"`` in a one-model engine).
    """

    request_id: str
    slot: int
    model: str = "default"


@dataclass(frozen=True)
class StepPlan:
    """What the executor runs this step: encoder batches, then prefills and decode steps in one target forward.

    ``released`` slots belong to finished requests: drop all their executor state. ``preempted`` slots belong
    to requests that will resume later: free their KV cache (target and drafters) but keep their random
    streams, adaptive tree budgets and prefix embeddings. The executor handles both before anything else.
    ``forks`` start from the KV cache and the last logits row of a final prefill chunk of ``prefills``; each
    gets a :class:`RequestStepResult` of its own (``is_prefill``: its first token).

    ``admitted`` holds a :class:`RequestSpec` for each request the plan's work names for the first time (or the
    first time since a preemption); the work items themselves carry ids and per-step numbers only.
    """

    step: int
    prefills: tuple[PrefillWork, ...] = ()
    decodes: tuple[DecodeWork, ...] = ()
    released: tuple[SlotRelease, ...] = ()  # finished: their executor state must be dropped
    encodes: tuple[EncodeWork, ...] = ()
    preempted: tuple[SlotRelease, ...] = ()  # preempted: their KV cache must be freed
    forks: tuple[ForkWork, ...] = ()  # requests that copy the prompt of a prefill of this plan (its final chunk)
    admitted: tuple[RequestSpec, ...] = ()  # specs of the requests new to the runner (handled first)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes and not self.encodes

    @property
    def num_nodes(self) -> int:
        return sum(p.num_tokens for p in self.prefills) + sum(d.node_budget for d in self.decodes)

    def request_ids(self) -> list[str]:
        """Ids of the requests the plan's work names (encodes, prefills, forks, decodes), in that order, with
        repeats: what :func:`admissions` takes."""
        return ([rid for w in self.encodes for rid, _ in w.items] + [p.request_id for p in self.prefills]
                + [f.request_id for f in self.forks] + [d.request_id for d in self.decodes])


@dataclass(frozen=True)
class RequestStepResult:
    """What one step committed for one request.

    Attributes:
        new_tokens: committed tokens (accepted draft tokens + bonus, cut at EOS / max_new_tokens).
        num_accepted: draft tokens accepted (excluding the bonus); 0 for a prefill.
        finish_reason: ``"eos"``, ``"length"`` or None when the request goes on.
        error: ``{"code", "message"}`` when the request failed (it is finished).
        requested_nodes: the tree size the request's drafters ask for next step.
    """

    request_id: str
    new_tokens: tuple[int, ...] = ()
    num_accepted: int = 0
    is_prefill: bool = False
    finish_reason: str | None = None
    error: dict | None = None
    requested_nodes: int = 1
    draft_s: float = 0.0
    verify_s: float = 0.0
    visual_attention: tuple = ()  # per committed token: numpy [n_visual] mean attention over heads/layers
    logprobs: tuple[float, ...] = ()  # per committed token, when the request asked (Request.logprobs)
    prefill_done: bool = True  # False after a prefill chunk that is not the last one (no token yet)


@dataclass(frozen=True)
class EncodeResult:
    """One encoded item; ``error`` (``{"code", "message"}``) fails the request it belongs to."""

    request_id: str
    item_id: str
    error: dict | None = None


@dataclass(frozen=True)
class StepOutput:
    """The executor's answer to a :class:`StepPlan`."""

    step: int
    results: tuple[RequestStepResult, ...]
    target_forwards: int
    nodes_verified: int
    duration_s: float
    encoded: tuple[EncodeResult, ...] = ()


def book_step_result(req: Request, res: RequestStepResult, now: float | None = None) -> bool:
    """Apply one step's result to a request's state and stats (every scheduler's ``update`` does this).

    Returns True when the request finished in this step (EOS, length or error).
    """
    if res.is_prefill and not res.prefill_done and res.error is None:
        req.stats.target_steps += 1  # a prefill chunk: in the forward, nothing committed yet
        req.stats.prefill_steps += 1
        return False
    req.stats.prefill_steps += res.is_prefill
    req.output_ids.extend(res.new_tokens)
    req.output_logprobs.extend(res.logprobs)
    req.stats.committed += len(res.new_tokens)
    req.stats.target_steps += 1
    req.stats.draft_s += res.draft_s
    req.stats.verify_s += res.verify_s
    if now is not None and req.stats.first_token_s is None and res.new_tokens:
        req.stats.first_token_s = now
    if not res.is_prefill and res.error is None:
        req.stats.accepted_per_step.append(res.num_accepted)
    req.requested_nodes = res.requested_nodes
    if res.error is not None or res.finish_reason is not None:
        req.error = res.error
        req.finish_reason = res.finish_reason or "error"
        return True
    return False


@runtime_checkable
class Scheduler(Protocol):
    """What the device loop asks of a scheduler (FIFO and QoS both implement all of it; no feature probes).

    ``schedule() -> StepPlan`` plans a step, the executors run it, ``update(StepOutput)`` books the results
    (returns the requests that finished). The scheduler never touches tensors.
    """

    requests: Mapping[str, Request]  # read-only view of the scheduler's one registry (:class:`RequestsView`)
    metrics: object | None  # Prometheus metrics (``SchedulerMetrics``) or None
    multi_model: bool  # serves several runners (add_model, add_modality); FIFO: False

    def add(self, request: Request) -> None: ...

    def add_model(self, name: str, limits, memory_bytes: int = 0) -> None:
        """Serve one more model; raises ValueError when the policy serves one model only."""

    def add_modality(self, modality: str, batching=None) -> None:
        """Batch encodes of ``modality`` too; raises ValueError when the policy plans no encodes."""

    def cancel(self, request_id: str) -> Request | None:
        """Stop a request now (finished, reason ``cancelled``); None when unknown or already finished."""

    def has_work(self) -> bool: ...

    def schedule(self) -> StepPlan: ...

    def update(self, output: StepOutput) -> list[Request]: ...

    def observe(self, model: str, prefill_tokens: int, tokens: int, seconds: float) -> None:
        """One model's measured step time (a cost-aware policy learns from it; others ignore it)."""

    def next_event_s(self) -> float | None:
        """Clock time of the next timed event (an encode batch falling due), None for none."""

    def clock(self) -> float:
        """The scheduler's monotonic seconds (``arrival_s``/``deadline_s`` are on it)."""

    def pop_finished(self, request_id: str) -> Request: ...
