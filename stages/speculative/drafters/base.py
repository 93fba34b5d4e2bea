"""The drafter interface: propose a token tree under a node budget; observe how much was accepted.

Modelled on transformers' ``CandidateGenerator`` (one call proposes, one call receives the outcome), batched:
:meth:`Drafter.propose` takes every decoding request of the step at once so model drafters run one draft
forward per tree depth for the whole batch.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field

from specstream.kernels.sampling import SamplingParams
from specstream.stages.speculative.tree import TokenTree


@dataclass
class DraftInput:
    """What a drafter sees of one request for one step.

    Attributes:
        request_id: the request.
        slot: its KV cache slot (model drafters keep their own cache in the same slot number).
        context: prompt + committed tokens; ``context[-1]`` is the tree root (not yet in the target's cache).
        node_budget: most nodes the tree may have, root included (granted by the scheduler's plan).
        max_depth: deepest draft token allowed (remaining new tokens - 1, tree depth limits).
        sampling: the request's sampling parameters (sample mode drafts sample from q).
        rng: the request's random stream for draft sampling.
    """

    request_id: str
    slot: int
    context: list[int]
    node_budget: int
    max_depth: int
    sampling: SamplingParams
    rng: random.Random = field(default_factory=random.Random)


class Drafter(abc.ABC):
    """A proposer of draft tokens for the target to verify."""

    #: short name used in stats and proposals
    name: str = "drafter"

    @abc.abstractmethod
    def propose(self, inputs: list[DraftInput]) -> list[TokenTree]:
        """One tree per input, each rooted at ``context[-1]`` with at most ``node_budget`` nodes."""

    def observe(self, request_id: str, tree: TokenTree, path: tuple[int, ...], committed: list[int]) -> None:
        """Receive the verification outcome: accepted node ``path`` of ``tree`` and the ``committed`` tokens."""

    def release(self, request_id: str, slot: int) -> None:
        """Forget a finished or preempted request."""


@dataclass
class AdaptiveBudget:
    """Per-request tree size from recent acceptance and measured draft cost (never slower than no drafts).

    An exponential moving average of accepted draft tokens per step (``ema``) decides the node budget the
    request *asks* for; the scheduler grants it or less. A step with drafts commits about ``1 + ema`` tokens
    and costs about ``1 + cost_ratio`` plain steps (``cost_ratio`` = measured draft time / verify time), so
    speculation is switched off when ``(1 + ema) / (1 + cost_ratio) < 1`` or ``ema < off_below``, except for a
    small probe tree every ``probe_every`` steps, so a request whose drafts become good again gets them back.
    """

    full_nodes: int
    min_nodes: int = 4
    ema: float = 1.0
    decay: float = 0.7
    off_below: float = 0.2
    probe_every: int = 8
    steps_off: int = 0

    def observe(self, num_accepted: int, proposed: int) -> None:
        """Book one verification step: ``num_accepted`` draft tokens accepted out of a ``proposed``-node tree."""
        if proposed <= 1:
            self.steps_off += 1
            return
        self.ema = self.decay * self.ema + (1 - self.decay) * num_accepted
        self.steps_off = 0

    def pays(self, cost_ratio: float = 0.0) -> bool:
        return self.ema >= self.off_below and (1.0 + self.ema) / (1.0 + max(0.0, cost_ratio)) >= 1.0

    def requested_nodes(self, cost_ratio: float = 0.0) -> int:
        """Tree size (root included) to ask for next step; 1 = no drafts."""
        if not self.pays(cost_ratio):
            return self.min_nodes if self.steps_off + 1 >= self.probe_every else 1
        if self.ema >= 1.0:
            return self.full_nodes
        return max(self.min_nodes, min(self.full_nodes, int(round(self.full_nodes * self.ema))))
