"""Replay drafter (benchmarks only): proposes a recorded target continuation, corrupted at a chosen rate.

A random draft model accepts nothing, which says little about a real draft. To chart speed-up against
acceptance, this drafter replays the target's own greedy continuation (recorded from the engine's verify path
in a previous run) and replaces each proposed token, independently with probability ``corruption``, by a
random other token. Proposals are deterministic.
"""

from __future__ import annotations

import random

from specstream.stages.speculative.drafters.base import DraftInput, Drafter
from specstream.stages.speculative.tree import Proposal, ProposalKind, TokenTree


class ReplayDrafter(Drafter):
    """Args:
        recordings: prompt (as a tuple) -> the target's greedy continuation.
        corruption: probability that a proposed token is replaced by a wrong one.
        depth: chain length proposed per step.
        vocab_size: range of corrupted tokens.
        seed: seed of the corruption stream.
    """

    name = "replay"

    def __init__(self, recordings: dict[tuple[int, ...], list[int]], corruption: float, depth: int,
                 vocab_size: int, seed: int = 0):
        if not 0 <= corruption <= 1:
            raise ValueError("corruption must be in [0, 1]")
        self.recordings = recordings
        self.corruption = corruption
        self.depth = depth
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)
        self._proposal = Proposal(ProposalKind.DETERMINISTIC, drafter=self.name)

    def _find(self, context: list[int]) -> tuple[list[int], int] | None:
        for prompt, cont in self.recordings.items():
            n = len(prompt)
            if tuple(context[:n]) == prompt and context[n:] == cont[: len(context) - n]:
                return cont, len(context) - n
        return None

    def propose(self, inputs: list[DraftInput]) -> list[TokenTree]:
        trees = []
        for inp in inputs:
            tree = TokenTree(inp.context[-1])
            found = self._find(inp.context)
            if found is not None:
                cont, pos = found
                chain = []
                for tok in cont[pos: pos + min(self.depth, inp.max_depth, inp.node_budget - 1)]:
                    if self._rng.random() < self.corruption:
                        tok = (tok + 1 + self._rng.randrange(self.vocab_size - 1)) % self.vocab_size
                    chain.append(tok)
                tree.add_path(chain, self._proposal)
            trees.append(tree)
        return trees
