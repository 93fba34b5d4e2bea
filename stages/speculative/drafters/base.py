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

from specstream.types import SamplingParams
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
        constraint: the request's grammar (:class:`~specstream.stages.speculative.grammar.GrammarConstraint`),
            or None: model drafters mask their drafts by it.
        forced: the tokens the grammar forces after ``context`` (xgrammar's jump-forward tokens), computed once
            per step by the executor, or (): a drafter with :attr:`Drafter.reads_forced` starts its tree with them
            as one chain below the root (the grammar drafter proposes only them; a model drafter reads them with
            its catch-up and drafts its levels after them), and then ``node_budget`` and ``max_depth`` include
            them. Other drafters get () and the plan's tree.
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
    constraint: object | None = None
    forced: tuple[int, ...] = ()


class Drafter(abc.ABC):
    """A proposer of draft tokens for the target to verify."""

    #: short name used in stats, proposals and as the key of the request record's drafter state
    name: str = "drafter"
    #: whether :meth:`propose` puts :attr:`DraftInput.forced` in front of its tree; the executor gives the others
    #: the plan's tree (no forced tokens, the plan's budget and depth)
    reads_forced: bool = False

    @abc.abstractmethod
    def propose(self, inputs: list[DraftInput]) -> list[TokenTree]:
        """One tree per input, each rooted at ``context[-1]``; its draws must not exceed ``node_budget - 1``
        units (a sampled draw costs one, a deterministic one only when it adds a node)."""

    def observe(self, state: dict, slot: int, tree: TokenTree, accepted: list[int], committed: list[int]) -> None:
        """The outcome of one request's step: the verified (possibly merged) ``tree``, the ``accepted`` draft
        tokens and every ``committed`` token (accepted + bonus, cut at EOS / length)."""

    def end_step(self) -> None:
        """Called once after every request of the step was observed (batched KV commit)."""

    def release(self, slot: int, keep: bool = False) -> None:
        """The request in ``slot`` ended or was preempted: forget anything cached for the slot. ``keep``: a
        drafter with a KV cache may remember which tokens the slot's keys/values hold, so the slot's next request
        reads only what follows their common prefix (the executor passes False when the slot's request failed)."""

    def lag(self, slot: int, context_len: int, context: list[int] | None = None) -> int:
        """Committed tokens this drafter would read, beyond the newest one, before drafting for the request in
        ``slot`` whose context is ``context_len`` tokens long (its whole prompt the first time, less a prefix the
        slot's previous request left cached when ``context`` is given; the tokens of the steps it did not draft
        since). 0 for drafters without a cache."""
        return 0

    def catch_up_token_s(self) -> float | None:
        """Measured seconds per token of this drafter's catch-up reads (None: not measured yet, or no cache)."""
        return None

    def catch_up_was_one_off(self) -> bool:
        """Whether the last :meth:`propose` read mostly one-off committed tokens (a prompt): its time then says
        little about a steady step's, and the executor does not take it as its first draft-cost measurement.
        False for drafters without a cache."""
        return False

    def catch_up_excess_s(self) -> float:
        """Seconds of the last :meth:`propose` spent reading committed tokens beyond what a step that also
        drafted the step before reads (a prompt, or the tokens of steps without drafts); the executor leaves them
        out of the draft cost per level it measures. 0 for drafters without a cache."""
        return 0.0

