"""The drafter interface: propose a token tree under a node budget; observe what was committed.

Modelled on transformers' ``CandidateGenerator`` (one call proposes, one call receives the outcome), batched:
:meth:`Drafter.propose` takes every decoding request of the step at once so model drafters run one draft
forward per tree depth for the whole batch. A drafter keeps no per-request dictionaries of its own: what it
remembers about a request lives in ``DraftInput.state`` — a dict owned by the executor's per-request record,
created at admission and dropped with the record.
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
        context: prompt + committed tokens as drafters see them (a VLM prompt without its image tokens);
            ``context[-1]`` is the tree root (not yet in the target's cache).
        node_budget: most nodes the tree may have, root included (granted by the scheduler's plan).
        max_depth: deepest draft token allowed (remaining new tokens - 1, tree depth limits).
        sampling: the request's sampling parameters (sample mode drafts sample from q).
        rng: the request's random stream (draws of sampled drafts; the verifier's uniforms come from it too).
        state: this drafter's scratch for this request (kept across steps, dropped when the request ends).
        hypothesis: a previous hypothesis of the same content (the temporal drafter's source), or None.
    """

    request_id: str
    slot: int
    context: list[int]
    node_budget: int
    max_depth: int
    sampling: SamplingParams
    rng: random.Random = field(default_factory=random.Random)
    state: dict = field(default_factory=dict)
    hypothesis: tuple[int, ...] | None = None


class Drafter(abc.ABC):
    """A proposer of draft tokens for the target to verify."""

    #: short name used in stats, proposals and as the key of the request record's drafter state
    name: str = "drafter"

    @abc.abstractmethod
    def propose(self, inputs: list[DraftInput]) -> list[TokenTree]:
        """One tree per input, each rooted at ``context[-1]``; its draws must not exceed ``node_budget - 1``
        units (a sampled draw costs one, a deterministic one only when it adds a node)."""

    def observe(self, state: dict, slot: int, tree: TokenTree, accepted: list[int], committed: list[int]) -> None:
        """The outcome of one request's step: the verified (possibly merged) ``tree``, the ``accepted`` draft
        tokens and every ``committed`` token (accepted + bonus, cut at EOS / length)."""

    def end_step(self) -> None:
        """Called once after every request of the step was observed (batched KV commit)."""

    def release(self, slot: int) -> None:
        """The request in ``slot`` ended or was preempted: forget anything cached for the slot."""


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
