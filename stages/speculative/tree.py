"""Token trees: what drafters propose and what the target verifies in one forward (SpecInfer §3-4).

A :class:`TokenTree` is an append-only **log of draws** in the order they were made: each draw is (parent node,
token, how it was proposed, ``q``). Node 0 is the *root*: the last committed token, whose key/value is not in the
target's cache yet. The tree is a trie: a draw whose token already is a child of its parent adds no node, only
one more proposal of that child, at its place in the draw order.

Why the log keeps draw order: stochastic verification (multi-step speculative sampling) tests each parent's
proposals one after the other against a residual distribution. It stays exact only if

- every sampled draw that was made is tested, in the order it was drawn, and
- whether a draw is made (its parent, its ``q``) is decided before its value is known: it may depend on
  earlier draws, never on its own value or on later ones.

So a node budget is spent in *draws* fixed before sampling (a sampled draw always costs one unit, even when it
duplicates a child), merging keeps each drafter's draws in order (drafter after drafter at each parent), and
truncation only ever drops whole draws by their position, never by their value.

:func:`compile_trees` turns the trees of one step into padded tensors once (Medusa compiles its tree into a
mask, position ids and retrieve indices the same way); :func:`ancestor_matrix` builds the ancestor mask on the
device from the parent pointers.
"""

from __future__ import annotations

import array
import enum
from dataclasses import dataclass, field

import torch

from specstream.kernels.trees import CompiledTrees


class ProposalKind(enum.IntEnum):
    DETERMINISTIC = 0  # a point mass: tested with r(x), residual r with x zeroed (top-k, n-gram, temporal, ...)
    SAMPLED = 1  # drawn from the draft distribution q: tested with min(1, r/q), residual (r - q)+


@dataclass(frozen=True)
class QRef:
    """Where a sampled draw's draft distribution lives: row ``row`` of ``table`` (``[N, V]`` on the device;
    several draws of one parent share one row)."""

    table: torch.Tensor = field(repr=False, compare=False)
    row: int


@dataclass(frozen=True)
class Proposal:
    """How one draw was proposed.

    Attributes:
        kind: sampled from ``q`` or deterministic.
        drafter: name of the drafter that proposed it.
        q: the draft distribution of a sampled draw: a :class:`QRef` (device row) or a ``[V]`` tensor.
    """

    kind: ProposalKind
    drafter: str = ""
    q: QRef | torch.Tensor | None = field(default=None, compare=False, repr=False)


DETERMINISTIC = Proposal(ProposalKind.DETERMINISTIC)


@dataclass(frozen=True)
class Draw:
    """One entry of a tree's draw log: ``child`` (a node index) proposed under ``parent`` by ``proposal``."""

    parent: int
    child: int
    proposal: Proposal


class TokenTree:
    """An append-only token tree (a trie over draws).

    Args:
        root_token: the last committed token (node 0).
    """

    def __init__(self, root_token: int):
        self.tokens: list[int] = [int(root_token)]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.draws: list[Draw] = []
        self._children: list[dict[int, int]] = [{}]
        # the draw log as flat int columns, kept as draws are added, so that :func:`compile_trees` copies whole
        # lists instead of walking Draw objects: parent, child, kind, and the draw's place among its parent's
        # draws (its column in the verifier's ``[T, K]`` draw table); ``_sampled``: indices of sampled draws
        self._d_parent: list[int] = []
        self._d_child: list[int] = []
        self._d_kind: list[int] = []
        self._d_slot: list[int] = []
        self._n_at: list[int] = [0]  # draws logged under each node
        self._sampled: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return self.depths[-1] if len(self.depths) == 1 else max(self.depths)

    def child(self, parent: int, token: int) -> int | None:
        """The child of ``parent`` holding ``token``, or None."""
        return self._children[parent].get(int(token))

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in creation order."""
        return list(self._children[node].values())

    def add(self, parent: int, token: int, proposal: Proposal = DETERMINISTIC) -> int:
        """Log one draw of ``token`` under ``parent``; returns the child's node index (new or existing).

        Raises:
            IndexError: ``parent`` is not a node.
        """
        if not 0 <= parent < len(self.tokens):
            raise IndexError(f"parent {parent} not in tree of {len(self.tokens)} nodes")
        token = int(token)
        idx = self._children[parent].get(token)
        if idx is None:
            idx = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self._children.append({})
            self._n_at.append(0)
            self._children[parent][token] = idx
        if proposal.kind is ProposalKind.SAMPLED:
            self._sampled.append(len(self.draws))
        self.draws.append(Draw(parent, idx, proposal))
        self._d_parent.append(parent)
        self._d_child.append(idx)
        self._d_kind.append(int(proposal.kind))
        self._d_slot.append(self._n_at[parent])
        self._n_at[parent] += 1
        return idx

    def add_path(self, tokens: list[int], proposal: Proposal = DETERMINISTIC, parent: int = 0,
                 max_nodes: int | None = None) -> list[int]:
        """Add a chain of deterministic draws below ``parent``; returns the node indices.

        With ``max_nodes`` the chain stops where a new node would grow the tree past that size (a prefix already
        in the tree is still walked and logged). Only for deterministic proposals: a sampled draw must never be
        kept or dropped by its own value.
        """
        if proposal.kind is ProposalKind.SAMPLED and max_nodes is not None:
            raise ValueError("add_path with max_nodes would drop sampled draws by their value")
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

    def compile(self) -> "TreeTensors":
        """This tree's tensors on the CPU (tests, benchmarks; the engine compiles a batch: :func:`compile_trees`)."""
        parents = torch.tensor([self.parents], dtype=torch.long)
        return TreeTensors(torch.tensor(self.tokens), parents[0], torch.tensor(self.depths),
                           ancestor_matrix(parents, self.max_depth)[0])

    def draws_at(self, parent: int) -> list[Draw]:
        """The draws under ``parent`` in draw order (what the verifier tests there, in that order)."""
        return [d for d in self.draws if d.parent == parent]

    def walk(self, tokens: list[int]) -> list[int]:
        """Nodes reached by following ``tokens`` from the root (stops at the first token that is no child)."""
        node, out = 0, []
        for t in tokens:
            nxt = self.child(node, t)
            if nxt is None:
                break
            out.append(nxt)
            node = nxt
        return out

    @staticmethod
    def merge(trees: list["TokenTree"], max_nodes: int | None = None) -> "TokenTree":
        """Trie union of several drafters' trees with the same root (SpecInfer's merge-based speculation).

        Draws are replayed depth by depth; within a depth, tree after tree; within a tree, in draw order. So at
        every parent the merged log holds the first drafter's draws in its order, then the second's, and so on.
        With ``max_nodes`` a draw is dropped when the budget is spent; a *sampled* draw always costs one unit
        (even when it duplicates a child), a deterministic draw costs one only when it adds a node — so a cut
        never depends on a sampled draw's own value. A dropped draw drops its subtree.

        Raises:
            ValueError: no trees, or roots differ.
        """
        if not trees:
            raise ValueError("merge needs at least one tree")
        root = trees[0].tokens[0]
        if any(t.tokens[0] != root for t in trees):
            raise ValueError("trees to merge must share the root token")
        if len(trees) == 1 and max_nodes is None:
            return trees[0]
        merged = TokenTree(root)
        maps = [{0: 0} for _ in trees]
        spent = 0
        limit = None if max_nodes is None else max_nodes - 1
        max_depth = max(t.max_depth for t in trees)
        by_depth = [[[] for _ in range(max_depth + 1)] for _ in trees]
        for ti, t in enumerate(trees):
            for d in t.draws:
                by_depth[ti][t.depths[d.child]].append(d)
        for depth in range(1, max_depth + 1):
            for ti, t in enumerate(trees):
                for d in by_depth[ti][depth]:
                    parent = maps[ti].get(d.parent)
                    if parent is None:
                        continue  # its parent's draw was dropped
                    token = t.tokens[d.child]
                    sampled = d.proposal.kind is ProposalKind.SAMPLED
                    cost = 1 if sampled or merged.child(parent, token) is None else 0
                    if limit is not None and spent + cost > limit:
                        continue
                    spent += cost
                    maps[ti][d.child] = merged.add(parent, token, d.proposal)
        return merged

    def truncated(self, max_nodes: int, max_depth: int | None = None) -> "TokenTree":
        """A copy keeping draws in log order while the budget allows (same cost rule as :meth:`merge`) and
        nodes no deeper than ``max_depth``."""
        keep = TokenTree(self.tokens[0])
        index = {0: 0}
        spent, limit = 0, max_nodes - 1
        for d in self.draws:
            if max_depth is not None and self.depths[d.child] > max_depth:
                continue
            parent = index.get(d.parent)
            if parent is None:
                continue
            token = self.tokens[d.child]
            cost = 1 if d.proposal.kind is ProposalKind.SAMPLED or keep.child(parent, token) is None else 0
            if spent + cost > limit:
                continue
            spent += cost
            index[d.child] = keep.add(parent, token, d.proposal)
        return keep


@dataclass(frozen=True)
class TreeTensors:
    """One tree as tensors: ``tokens``, ``parents``, ``depths`` ``[T]`` and ``ancestor_mask`` ``[T, T]``
    (``[i, j]`` True when ``j`` is ``i`` or an ancestor of ``i``)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestor_mask: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])


def chain_tree(tokens: list[int]) -> TokenTree:
    """A tree that is a single chain: ``tokens[0]`` the root, each later token the child of the one before."""
    tree = TokenTree(tokens[0])
    tree.add_path(list(tokens[1:]))
    return tree


# -- compilation ---------------------------------------------------------------------------------------------


def compile_trees(trees: list[TokenTree], device: torch.device | str, vocab_size: int | None = None,
                  pad_to: int | None = None) -> CompiledTrees:
    """Pad the trees of one step into :class:`CompiledTrees` (one host->device copy of every int field).

    The host work is a few list copies per tree (the trees keep their draw logs as flat int columns,
    :meth:`TokenTree.add`); the padded ``[B, T]`` and ``[B, T, K]`` tables are filled on the device by one scatter.
    Only sampled draws are visited one by one (to share their draft-distribution rows). Measured on 23-node
    trees ("2,2,2,1"), the same run: 32 trees 2.48 -> 0.79 ms, 8 trees 1.11 -> 0.43 ms, 1 tree 0.26 ms both
    ways, against the former nested per-node lists (``torch.tensor`` of ``[B, T, K]`` Python lists).

    Args:
        trees: one tree per decoding request.
        device: where the tensors go.
        vocab_size: length of the ``q`` rows (the target's vocabulary); rows are cut or zero-padded to it.
        pad_to: at least this many node columns ``T``.

    Raises:
        ValueError: a sampled draw without its draft distribution ``q``.
    """
    b = len(trees)
    sizes = [len(tr) for tr in trees]
    t = max(sizes + [pad_to or 1])
    n_draws = [len(tr.draws) for tr in trees]
    if t == 1 and not any(n_draws):
        return _compile_roots(trees, device, sizes)
    k = max([max(tr._n_at) for tr in trees] + [1])
    # one flat host list: per node (tokens, parents, depths, flat node index), then per draw (flat table index,
    # child, kind, order in its tree's log, q row)
    node_pos: list[int] = []
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    cell: list[int] = []  # (tree, parent) of each draw as tree * T + parent
    slot: list[int] = []
    child: list[int] = []
    kind: list[int] = []
    order: list[int] = []
    for i, tr in enumerate(trees):
        base = i * t
        node_pos += range(base, base + sizes[i])
        tokens += tr.tokens
        parents += tr.parents
        depths += tr.depths
        cell += map(base.__add__, tr._d_parent)
        slot += tr._d_slot
        child += tr._d_child
        kind += tr._d_kind
        order += range(n_draws[i])
    dq = [0] * len(child)
    q_rows: list[tuple[object, int]] = []  # (table or tensor, row)
    q_index: dict[tuple[int, int], int] = {}
    start = 0
    for i, tr in enumerate(trees):
        if not tr._sampled:
            start += n_draws[i]
            continue
        # q rows numbered parent after parent (in the order of each parent's first draw), then in draw order
        first = dict(zip(reversed(tr._d_parent), range(n_draws[i] - 1, -1, -1)))
        for j in sorted(tr._sampled, key=lambda j: (first[tr._d_parent[j]], j)):
            q = tr.draws[j].proposal.q
            if q is None:
                raise ValueError("a sampled draw needs its draft distribution q")
            key = (id(q.table), q.row) if isinstance(q, QRef) else (id(q), -1)
            if key not in q_index:
                q_index[key] = len(q_rows)
                q_rows.append((q.table, q.row) if isinstance(q, QRef) else (q, -1))
            dq[start + j] = q_index[key]
        start += n_draws[i]
    n, m = len(tokens), len(child)
    flat = array.array("q", node_pos + tokens + parents + depths + sizes + cell + slot + child + kind + order + dq)
    host = torch.frombuffer(flat, dtype=torch.long) if len(flat) else torch.zeros(0, dtype=torch.long)
    if torch.device(device).type != "cpu":
        host = host.to(device)  # the one host->device copy of the step's trees
    npos, ntok, npar, ndep, nnodes, dcell, dslot, dchild, dkind, dorder, ddq = host.split(
        [n, n, n, n, b, m, m, m, m, m, m])
    node = torch.zeros((3, b * t), dtype=torch.long, device=device)
    node[1] = -1
    node[:, npos] = torch.stack([ntok, npar, ndep])
    table = torch.zeros((4, b * t * k), dtype=torch.long, device=device)
    table[0] = -1
    table[:, dcell * k + dslot] = torch.stack([dchild, dkind, ddq, dorder])
    node, table = node.view(3, b, t), table.view(4, b, t, k)
    q = _gather_q(q_rows, device, vocab_size) if q_rows else None
    return CompiledTrees(
        tokens=node[0], parents=node[1], depths=node[2], num_nodes=nnodes, draw_child=table[0],
        draw_kind=table[1], draw_q=table[2], draw_uniform=table[3], q=q,
        max_depth=max(tr.max_depth for tr in trees) if trees else 0,
        host_sizes=sizes, host_draws=n_draws,
    )


def _compile_roots(trees: list[TokenTree], device: torch.device | str, sizes: list[int]) -> CompiledTrees:
    """:func:`compile_trees` of a step whose trees are each a root alone, without draws (no drafts this step): the
    same tensors (``T = K = 1``) from one host->device copy of the root tokens and a few fills, instead of the
    general path's flat host list, scatters and tables."""
    b = len(trees)
    tokens = torch.tensor([tr.tokens[:1] for tr in trees], dtype=torch.long, device=device)  # [B, 1]
    table = torch.zeros((3, b, 1, 1), dtype=torch.long, device=device)  # draw kind, q row, uniform: none
    return CompiledTrees(
        tokens=tokens, parents=torch.full((b, 1), -1, dtype=torch.long, device=device),
        depths=torch.zeros((b, 1), dtype=torch.long, device=device),
        num_nodes=torch.ones(b, dtype=torch.long, device=device),
        draw_child=torch.full((b, 1, 1), -1, dtype=torch.long, device=device),
        draw_kind=table[0], draw_q=table[1], draw_uniform=table[2], q=None, max_depth=0,
        host_sizes=sizes, host_draws=[0] * b,
    )


def _gather_q(rows: list[tuple[object, int]], device, vocab_size: int | None) -> torch.Tensor:
    """Stack the draft distributions of sampled draws into one ``[Nq, V]`` float32 tensor on ``device``:
    rows of the same table are taken with one index_select."""
    width = vocab_size or max((tab.shape[-1] for tab, _ in rows), default=1)
    out = torch.zeros((len(rows), width), dtype=torch.float32, device=device)
    by_table: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for j, (tab, row) in enumerate(rows):
        entry = by_table.setdefault(id(tab), (tab, [], []))
        entry[1].append(j)
        entry[2].append(row)
    for tab, dst, src in by_table.values():
        if src[0] == -1:  # a bare [V] tensor
            block = tab.reshape(1, -1)
        else:
            block = tab.index_select(0, torch.tensor(src, device=tab.device))
        block = block.float()
        if block.device != out.device:
            block = block.to(out.device)
        n = min(width, block.shape[-1])
        out[torch.tensor(dst, device=device), :n] = block[:, :n]
    return out


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Ancestor-or-self mask from parent pointers, on the tensors' device.

    Args:
        parents: ``[B, T]`` parent index per node (-1 for roots and padding).
        max_depth: the deepest node's depth (the number of doubling-free propagation rounds).

    Returns:
        ``[B, T, T]`` bool, ``[b, i, j]`` True when node ``j`` is ``i`` or an ancestor of ``i``.
    """
    b, t = parents.shape
    eye = torch.eye(t, dtype=torch.bool, device=parents.device).expand(b, t, t)
    anc = eye.clone()
    has_parent = (parents >= 0)[:, :, None]
    idx = parents.clamp(min=0)[:, :, None].expand(b, t, t)
    for _ in range(max_depth):
        anc = eye | (has_parent & torch.gather(anc, 1, idx))
    return anc
