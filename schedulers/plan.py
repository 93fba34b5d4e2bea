"""Typed messages of the engine loop: requests (scheduler state), step plans and step outputs.

``Scheduler.schedule() -> StepPlan`` decides; ``Executor.execute(plan) -> StepOutput`` runs tensors;
``Scheduler.update(output)`` books the results (vLLM's ``EngineCore.step``). Nothing here holds a tensor.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specstream.kernels.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestStats:
    """Per-request speculation statistics.

    ``target_steps`` counts target forwards that included the request, prefill included;
    ``accepted_per_step`` counts draft tokens accepted per verification step (bonus token excluded);
    ``tau`` = committed tokens / target steps.
    """

    target_steps: int = 0
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
        prefix_embeds_key: opaque key of precomputed input embeddings (VLM visual tokens) held by the executor.
        logits_processors: per-request rules applied to every verified logits row along that row's own token
            path, before argmax / sampling (:mod:`specstream.stages.speculative.logits`; objects, no tensors).
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
    prefix_embeds_key: str | None = None
    logits_processors: tuple = ()
    # state
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: dict | None = None
    requested_nodes: int = 1
    stats: RequestStats = field(default_factory=RequestStats)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class PrefillWork:
    """Prefill ``request`` into ``slot``: one forward over the prompt yields the first token."""

    request: Request
    slot: int


@dataclass(frozen=True)
class DecodeWork:
    """One speculative step for ``request``: a tree of at most ``node_budget`` nodes (root included) and
    draft depth at most ``max_depth``; ``node_budget == 1`` means plain decoding (root only)."""

    request: Request
    slot: int
    node_budget: int
    max_depth: int


@dataclass(frozen=True)
class StepPlan:
    """What the executor runs this step: prefills and decode steps, all in one target forward."""

    step: int
    prefills: tuple[PrefillWork, ...] = ()
    decodes: tuple[DecodeWork, ...] = ()
    released: tuple[tuple[str, int], ...] = ()  # (request id, slot) whose executor state must be dropped

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_nodes(self) -> int:
        return sum(len(p.request.prompt_ids) for p in self.prefills) + sum(d.node_budget for d in self.decodes)


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


@dataclass(frozen=True)
class StepOutput:
    """The executor's answer to a :class:`StepPlan`."""

    step: int
    results: tuple[RequestStepResult, ...]
    target_forwards: int
    nodes_verified: int
    duration_s: float
