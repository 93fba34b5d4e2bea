"""The schema-derived drafter: where the grammar allows exactly one continuation, propose it at zero draft cost.

JSON output under a schema is full of text no model needs to guess: keys, quotes, colons, commas, the fixed parts
of an enum value. :meth:`GrammarConstraint.forced_tokens` gives those tokens (xgrammar's jump-forward decoding,
Dong et al. 2024; SGLang's "compressed finite state machine" jump-forward is the same idea for plain decoding);
here they become a deterministic draft chain that the target verifies like any draft, merged (trie union) with
the other drafters' trees. A forced token can still be rejected: the target may tokenize the same text
differently, and then verification takes the target's own token, so output is unchanged either way.
"""

from __future__ import annotations

from specstream.stages.speculative.drafters.base import DraftInput, Drafter
from specstream.stages.speculative.tree import Proposal, ProposalKind, TokenTree


class GrammarDrafter(Drafter):
    """Proposes each constrained request's forced continuation (:attr:`DraftInput.forced`, computed by the
    executor) as one chain (no model, no device work).

    Attributes:
        proposed: forced tokens proposed so far (all requests).
        accepted: of those, tokens the target accepted (the drafter's share of accepted draft tokens).
    """

    name = "grammar"
    reads_forced = True

    def __init__(self):
        self.proposed = 0
        self.accepted = 0
        self._proposal = Proposal(ProposalKind.DETERMINISTIC, drafter=self.name)

    def propose(self, inputs: list[DraftInput]) -> list[TokenTree]:
        trees = []
        for inp in inputs:
            tree = TokenTree(inp.context[-1])
            chain = list(inp.forced[:min(inp.max_depth, inp.node_budget - 1)])
            tree.add_path(chain, self._proposal)
            self.proposed += len(chain)
            inp.state["nodes"] = len(tree) - 1
            trees.append(tree)
        return trees

    def observe(self, state: dict, slot: int, tree: TokenTree, accepted: list[int], committed: list[int]) -> None:
        """Count accepted tokens on nodes this drafter proposed (walking the verified tree along ``accepted``)."""
        if not state.get("nodes"):  # proposed nothing for this request this step
            return
        mine = {d.child for d in tree.draws if d.proposal.drafter == self.name}
        node = 0
        for tok in accepted:
            node = tree.child(node, tok)
            if node is None:
                break
            if node in mine:
                self.accepted += 1
