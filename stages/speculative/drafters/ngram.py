"""N-gram drafter (prompt lookup decoding, Saxena 2023): continue the context the way it continued before.

No model: the last ``n`` tokens of the context (``n`` from ``max_ngram`` down to ``min_ngram``) are looked up in
the earlier context; the tokens that followed each match, most recent match first, become branches of the
tree. Proposals are deterministic (point masses for the stochastic verifier).
"""

from __future__ import annotations

from specstream.stages.speculative.drafters.base import DraftInput, Drafter
from specstream.stages.speculative.tree import Proposal, ProposalKind, TokenTree


class NgramDrafter(Drafter):
    """Prompt-lookup drafter.

    Args:
        max_ngram, min_ngram: lengths of the suffix looked up, longest first.
        max_branches: most distinct continuations (tree branches) per step.
        max_depth: longest continuation.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_branches: int = 3, max_depth: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_branches, self.max_depth = max_branches, max_depth
        self._proposal = Proposal(ProposalKind.DETERMINISTIC, drafter=self.name)

    def continuations(self, context: list[int], depth: int) -> list[list[int]]:
        """Distinct continuations (longest-ngram matches first, most recent first), each up to ``depth`` long."""
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        n_ctx = len(context)
        for n in range(min(self.max_ngram, n_ctx - 1), self.min_ngram - 1, -1):
            suffix = context[n_ctx - n:]
            first = suffix[0]
            # scan backwards; a match ending at position e-1 (exclusive of the suffix itself)
            for start in range(n_ctx - n - 1, -1, -1):
                if context[start] != first or context[start:start + n] != suffix:
                    continue
                cont = context[start + n:start + n + depth]
                key = tuple(cont)
                if cont and key not in seen:
                    seen.add(key)
                    out.append(cont)
                    if len(out) >= self.max_branches:
                        return out
        return out

    def propose(self, inputs: list[DraftInput]) -> list[TokenTree]:
        trees = []
        for inp in inputs:
            tree = TokenTree(inp.context[-1])
            depth = min(inp.max_depth, self.max_depth)
            if depth > 0 and inp.node_budget > 1:
                for cont in self.continuations(inp.context, depth):
                    tree.add_path(cont, self._proposal, max_nodes=inp.node_budget)
            trees.append(tree)
        return trees
