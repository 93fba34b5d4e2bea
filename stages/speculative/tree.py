"""Token trees: what drafters propose and what the target verifies in one forward (SpecInfer §3-4).

A :class:`TokenTree` is built node by node (token, parent). Node 0 is the *root*: the last committed token,
whose key/value is not in the target's cache yet. Every other node is a draft token; its parent is the token
before it. Each non-root node records how it was proposed (:class:`Proposal`): a token *sampled* from a draft
distribution ``q`` or proposed *deterministically* (top-k expansion, n-gram, temporal, merge duplicate). The
stochastic verifier needs that to stay exact.

:meth:`TokenTree.compile` turns the tree into tensors once per step (:class:`CompiledTree`), as Medusa compiles
its tree into a mask, position ids and retrieve indices; here the result is a frozen dataclass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch


class ProposalKind(enum.Enum):
    SAMPLED = "sampled"  # drawn from the draft distribution q (tested with min(1, p/q), residual (p - q)+)
    DETERMINISTIC = "deterministic"  # a point mass (tested with p(x), residual p with x zeroed)


@dataclass(frozen=True)
class Proposal:
    """One proposal of a child token by one drafter.

    Attributes:
        kind: sampled from ``q`` or deterministic.
        drafter: name of the drafter that proposed it.
        q: ``[vocab]`` draft distribution the token was sampled from (SAMPLED only), float32 on CPU.
    """

    kind: ProposalKind
    drafter: str = ""
    q: torch.Tensor | None = field(default=None, compare=False, repr=False)


DETERMINISTIC = Proposal(ProposalKind.DETERMINISTIC)


@dataclass(frozen=True)
class CompiledTree:
    """Tensors of a token tree for one verification step (``T`` nodes, node 0 the root).

    Attributes:
        tokens: ``[T]`` token ids.
        parents: ``[T]`` parent index (-1 for the root); parents precede children.
        depths: ``[T]`` depth (root 0); position id = prefix length + depth.
        ancestor_mask: ``[T, T]`` bool, ``[i, j]`` True when ``j`` is ``i`` or an ancestor of ``i``.
        leaf_paths: ``[num_leaves, max_depth + 1]`` node indices root-to-leaf, padded with -1.
        children: per node, its children's indices in proposal order.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestor_mask: torch.Tensor
    leaf_paths: torch.Tensor
    children: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])


class TokenTree:
    """Mutable token tree (a trie: a parent never has two children with the same token).

    Args:
        root_token: the last committed token (node 0).
    """

    def __init__(self, root_token: int):
        self.tokens: list[int] = [int(root_token)]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.proposals: list[list[Proposal]] = [[]]
        self.children: list[list[int]] = [[]]
        # proposals at each parent in the order they were made: (child, proposal). The verifier tests them
        # in this order (SpecInfer's multi-step speculative sampling).
        self.parent_proposals: list[list[tuple[int, Proposal]]] = [[]]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def child(self, parent: int, token: int) -> int | None:
        for c in self.children[parent]:
            if self.tokens[c] == token:
                return c
        return None

    def add(self, parent: int, token: int, proposal: Proposal = DETERMINISTIC) -> int:
        """Add ``token`` under ``parent`` (or record one more proposal of an existing child). Returns its index."""
        if not 0 <= parent < len(self.tokens):
            raise IndexError(f"parent {parent} not in tree of {len(self.tokens)} nodes")
        existing = self.child(parent, token)
        if existing is not None:
            self.proposals[existing].append(proposal)
            self.parent_proposals[parent].append((existing, proposal))
            return existing
        idx = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.proposals.append([proposal])
        self.children.append([])
        self.parent_proposals.append([])
        self.children[parent].append(idx)
        self.parent_proposals[parent].append((idx, proposal))
        return idx

    def add_path(self, tokens: list[int], proposal: Proposal = DETERMINISTIC, parent: int = 0,
                 max_nodes: int | None = None) -> list[int]:
        """Add a chain of tokens below ``parent``; returns the node indices.

        With ``max_nodes`` the chain stops where a new node would grow the tree past that size (a prefix already
        in the tree is still walked, and its nodes record the proposal)."""
        out = []
        for t in tokens:
            if max_nodes is not None and len(self.tokens) >= max_nodes and self.child(parent, t) is None:
                break
            parent = self.add(parent, t, proposal)
            out.append(parent)
        return out

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node`` inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def path_tokens(self, node: int) -> list[int]:
        """Draft tokens on the path root->node, the root excluded."""
        return [self.tokens[i] for i in self.path_to(node)[1:]]

    def truncated(self, max_nodes: int, max_depth: int | None = None) -> "TokenTree":
        """A copy keeping the first ``max_nodes`` nodes in insertion order (closed under parents) and depth bound."""
        keep = TokenTree(self.tokens[0])
        index = {0: 0}
        for i in range(1, len(self.tokens)):
            if len(keep) >= max_nodes:
                break
            if max_depth is not None and self.depths[i] > max_depth:
                continue
            p = self.parents[i]
            if p not in index:
                continue
            for prop in self.proposals[i]:
                index[i] = keep.add(index[p], self.tokens[i], prop)
        return keep

    @staticmethod
    def merge(trees: list["TokenTree"], max_nodes: int | None = None) -> "TokenTree":
        """Trie union of several drafters' trees with the same root (SpecInfer's merge-based speculation).

        Identical paths collapse into one node that keeps every proposal, in tree order. Nodes are inserted
        breadth-first, round-robin over the trees, so a node budget keeps the shallow nodes of every drafter.
        """
        if not trees:
            raise ValueError("merge needs at least one tree")
        root = trees[0].tokens[0]
        if any(t.tokens[0] != root for t in trees):
            raise ValueError("trees to merge must share the root token")
        merged = TokenTree(root)
        maps = [{0: 0} for _ in trees]
        order = [sorted(range(1, len(t)), key=lambda i, t=t: (t.depths[i], i)) for t in trees]
        depth = 1
        max_depth = max(t.max_depth for t in trees)
        while depth <= max_depth:
            for ti, t in enumerate(trees):
                for i in order[ti]:
                    if t.depths[i] != depth or t.parents[i] not in maps[ti]:
                        continue
                    if max_nodes is not None and len(merged) >= max_nodes and merged.child(
                        maps[ti][t.parents[i]], t.tokens[i]
                    ) is None:
                        continue
                    for prop in t.proposals[i]:
                        maps[ti][i] = merged.add(maps[ti][t.parents[i]], t.tokens[i], prop)
            depth += 1
        return merged

    def compile(self) -> CompiledTree:
        """Tensors for one verification step (see :class:`CompiledTree`)."""
        n = len(self.tokens)
        anc = np.zeros((n, n), dtype=bool)
        for i in range(n):
            p = self.parents[i]
            if p >= 0:
                anc[i] = anc[p]
            anc[i, i] = True
        leaves = [i for i in range(n) if not self.children[i]]
        width = max(self.depths) + 1
        paths = np.full((len(leaves), width), -1, dtype=np.int64)
        for r, leaf in enumerate(leaves):
            p = self.path_to(leaf)
            paths[r, : len(p)] = p
        return CompiledTree(
            tokens=torch.tensor(self.tokens, dtype=torch.long),
            parents=torch.tensor(self.parents, dtype=torch.long),
            depths=torch.tensor(self.depths, dtype=torch.long),
            ancestor_mask=torch.from_numpy(anc),
            leaf_paths=torch.from_numpy(paths),
            children=tuple(tuple(c) for c in self.children),
        )


def chain_tree(tokens: list[int]) -> TokenTree:
    """A tree that is a single chain: ``tokens[0]`` the root, each later token the child of the one before."""
    tree = TokenTree(tokens[0])
    tree.add_path(list(tokens[1:]))
    return tree
