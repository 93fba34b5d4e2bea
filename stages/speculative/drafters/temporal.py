"""Temporal drafter: draft from a previous hypothesis of the same content (the previous ASR hypothesis of an
overlapping audio window, the previous keyframe's caption).

Streaming speech re-decodes audio it has partly heard: the window extended by half a second mostly repeats the
last hypothesis. The drafter aligns the request's context with that hypothesis and proposes what followed:
the longest suffix of the context (``max_ngram`` tokens down to ``min_ngram``) is looked up in the hypothesis;
each match, nearest the alignment cursor first, yields a branch with the hypothesis tokens after it. The
cursor advances with the accepted tokens, so repeated words ("the ... the") continue from the right place.
Proposals are deterministic (point masses), so the stochastic verifier stays exact.
"""

from __future__ import annotations

from collections.abc import Sequence

from specstream.stages.speculative.drafters.base import DraftInput, Drafter
from specstream.stages.speculative.tree import Proposal, ProposalKind, TokenTree


class TemporalDrafter(Drafter):
    """Drafts a request's tokens from its previous hypothesis (``Request.draft_hypothesis``: generated tokens of
    the previous hypothesis, no prompt; keep or drop its end-of-text token as you want it drafted).

    Args:
        max_ngram, min_ngram: context suffix lengths looked up, longest first.
        max_branches: most distinct continuations (tree branches) per step.
        max_depth: longest continuation drafted per step.
    """

    name = "temporal"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_branches: int = 2, max_depth: int = 16):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_branches, self.max_depth = max_branches, max_depth
        self._proposal = Proposal(ProposalKind.DETERMINISTIC, drafter=self.name)

    def continuations(self, hypothesis: Sequence[int] | None, context: Sequence[int], depth: int,
                      cursor: int = 0) -> list[tuple[int, list[int]]]:
        """``(end index in the hypothesis, continuation)`` pairs, best first, each up to ``depth`` tokens."""
        hyp = list(hypothesis or ())
        if not hyp or depth <= 0:
            return []
        out: list[tuple[int, list[int]]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            suffix = list(context[len(context) - n:])
            ends = [j + n for j in range(len(hyp) - n) if hyp[j:j + n] == suffix]
            # matches at or after the cursor first (nearest first), then earlier ones (nearest first)
            ends.sort(key=lambda e: (e < cursor, abs(e - cursor)))
            for end in ends:
                cont = hyp[end:end + depth]
                if cont and tuple(cont) not in seen:
                    seen.add(tuple(cont))
                    out.append((end, cont))
                    if len(out) >= self.max_branches:
                        return out
            if out:
                return out  # a longer suffix matched: shorter ones would only add noise
        return out

    def propose(self, inputs: list[DraftInput]) -> list[TokenTree]:
        trees = []
        for inp in inputs:
            tree = TokenTree(inp.context[-1])
            depth = min(inp.max_depth, self.max_depth, inp.node_budget - 1)
            if inp.hypothesis:
                inp.state["hypothesis"] = inp.hypothesis
                for _, cont in self.continuations(inp.hypothesis, inp.context, depth, inp.state.get("cursor", 0)):
                    tree.add_path(cont, self._proposal, max_nodes=inp.node_budget)
            trees.append(tree)
        return trees

    def observe(self, state: dict, slot: int, tree: TokenTree, accepted: list[int], committed: list[int]) -> None:
        hyp = state.get("hypothesis")
        if not hyp or not committed:
            return
        # advance the cursor past the committed tokens when they continue the hypothesis from the cursor
        cursor = state.get("cursor", 0)
        n = len(committed)
        for start in range(cursor, len(hyp) - n + 1):
            if list(hyp[start:start + n]) == list(committed):
                state["cursor"] = start + n
                return
