"""Model drafter: a small Llama-family LM (an SSM in SpecInfer's terms) expands a token tree.

Two expansion modes (SpecInfer §3, "expansion-based token tree construction"):

- **static widths** ``(w_1, ..., w_D)``: every node at depth ``d - 1`` gets ``w_d`` children — its top-``w_d``
  draft tokens in greedy mode (deterministic proposals), ``w_d`` independent samples from the draft distribution
  ``q`` in sample mode (sampled proposals). SpecInfer's default is ``1,1,3,1,1,1,1,1``.
- **dynamic** (``dynamic:NODES``): per depth, the children of the frontier with the highest cumulative draft
  probability are kept (a beam), and the final tree keeps the ``NODES`` best nodes overall (deterministic).

Draft forwards are batched across requests: one forward catches every request's draft KV cache up with the
committed tokens (and yields the root's children), then one forward per depth expands all frontiers. The
draft's cache uses the request's slot number; after verification the accepted nodes' draft keys/values are
compacted into place (KV commit), so nothing is recomputed for them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from specstream.kernels.sampling import SamplingParams, warp_logits
from specstream.stages.speculative.drafters.base import DraftInput, Drafter
from specstream.stages.speculative.models.llama import ForwardBatch, LlamaDecoder
from specstream.stages.speculative.tree import Proposal, ProposalKind, TokenTree

SPECINFER_WIDTHS = (1, 1, 3, 1, 1, 1, 1, 1)
_GREEDY = SamplingParams()


@dataclass(frozen=True)
class TreeSpec:
    """How a model drafter shapes its tree: static ``widths`` per depth, or ``dynamic_nodes`` (with a beam)."""

    widths: tuple[int, ...] = SPECINFER_WIDTHS
    dynamic_nodes: int | None = None
    beam: int = 4
    max_depth: int = 8

    @staticmethod
    def parse(text: str) -> "TreeSpec":
        """Parse ``"1,1,3,1"`` or ``"dynamic:NODES"`` (the CLI's ``--tree``).

        Raises:
            ValueError: not integers, a width < 1, or fewer than one node.
        """
        text = text.strip()
        try:
            if text.startswith("dynamic:"):
                nodes = int(text.split(":", 1)[1])
            else:
                widths = tuple(int(w) for w in text.split(",") if w.strip())
        except ValueError:
            raise ValueError(f"bad tree {text!r}: need widths like 1,1,3,1 or dynamic:NODES") from None
        if text.startswith("dynamic:"):
            if nodes < 1:
                raise ValueError("dynamic tree needs at least one node")
            return TreeSpec(widths=(), dynamic_nodes=nodes)
        if not widths or any(w < 1 for w in widths):
            raise ValueError(f"bad tree widths {text!r}: need positive integers like 1,1,3,1")
        return TreeSpec(widths=widths, max_depth=len(widths))

    @property
    def depth(self) -> int:
        return self.max_depth if self.dynamic_nodes else len(self.widths)

    def num_nodes(self) -> int:
        """Nodes of a full tree, root included."""
        if self.dynamic_nodes:
            return self.dynamic_nodes + 1
        total, level = 1, 1
        for w in self.widths:
            level *= w
            total += level
        return total


@dataclass
class _Node:
    tree_index: int
    column: int  # draft cache column; -1 when not fed yet
    cum_logprob: float


class ModelDrafter(Drafter):
    """Drafts with a small causal LM sharing the target's tokenizer.

    Args:
        model: the draft decoder.
        num_slots: KV slots (the engine's slot count).
        max_len: context length per slot.
        tree: tree shape.
        vocab_limit: drafts never propose ids >= this (the tokenizer's size; the draft's embedding table may be
            padded beyond it).
        target_vocab: length of ``q`` vectors handed to the verifier (the target's vocabulary size).
    """

    def __init__(
        self,
        model: LlamaDecoder,
        num_slots: int,
        max_len: int,
        tree: TreeSpec,
        vocab_limit: int,
        target_vocab: int,
        name: str = "draft",
    ):
        self.model = model
        self.tree_spec = tree
        self.name = name
        self.vocab_limit = min(vocab_limit, model.config.vocab_size)
        self.target_vocab = target_vocab
        self.max_len = max_len
        self.cache = model.new_cache(num_slots, max_len + tree.num_nodes() + 2)
        self._fed: dict[str, tuple[TokenTree, dict[int, int], int, int]] = {}
        self.forwards = 0

    # -- distributions -----------------------------------------------------------------------------------
    def _distributions(self, logits: torch.Tensor, sampling: list[SamplingParams]) -> list[np.ndarray]:
        """Per row, the draft's next-token distributions ``[t, V]`` as numpy: log-probabilities (greedy rows)
        or ``q`` over the target's vocabulary after the request's warpers (sample rows). Batched per
        distinct sampling parameters."""
        logits = logits[..., : self.vocab_limit].float()
        out: list[np.ndarray | None] = [None] * len(sampling)
        groups: dict[tuple, list[int]] = {}
        for i, sp in enumerate(sampling):
            key = ("greedy",) if sp.greedy else (sp.temperature, sp.top_k, sp.top_p)
            groups.setdefault(key, []).append(i)
        for key, idx in groups.items():
            sel = logits[idx]
            if key == ("greedy",):
                dist = torch.log_softmax(sel, -1)
            else:
                flat = sel.reshape(-1, sel.shape[-1])
                q = torch.softmax(warp_logits(flat, sampling[idx[0]]).double(), -1).reshape(sel.shape)
                n = min(self.target_vocab, q.shape[-1])
                dist = torch.zeros(sel.shape[:-1] + (self.target_vocab,), dtype=torch.float64)
                dist[..., :n] = q[..., :n]
                dist /= dist.sum(-1, keepdim=True)
            arr = dist.numpy()
            for j, i in enumerate(idx):
                out[i] = arr[j]
        return out

    def _children(self, dist: np.ndarray, width: int, sampling: SamplingParams, rng: random.Random):
        """Pick ``width`` children from one node's draft distribution: list of (token, proposal, logp)."""
        if sampling.greedy:
            k = min(width, dist.shape[0])
            idx = np.argsort(-dist, kind="stable")[:k]
            det = Proposal(ProposalKind.DETERMINISTIC, drafter=self.name)
            return [(int(i), det, float(dist[i])) for i in idx]
        prop = Proposal(ProposalKind.SAMPLED, drafter=self.name, q=dist)
        cdf = np.cumsum(dist)
        out = []
        for _ in range(width):
            tok = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), dist.shape[0] - 1)
            out.append((tok, prop, math.log(max(float(dist[tok]), 1e-300))))
        return out

    # -- forwards ------------------------------------------------------------------------------------------
    def _forward(self, rows: list[tuple[int, list[int], list[int], list[int], list[list[int]] | None, int]],
                 sampling: list[SamplingParams], last_only: bool = False) -> list[np.ndarray]:
        """rows: (slot, tokens, positions, columns, visible columns per token, prefix_len). ``visible`` None means
        a causal chain over contiguous ``columns`` (the catch-up with committed tokens).

        Returns per row the distributions ``[len(tokens), V]`` (``[1, V]`` of the last token with ``last_only``:
        the catch-up needs only the root's children, so the output head and softmax run on one row)."""
        device = self.model.device
        b = len(rows)
        t = max(len(r[1]) for r in rows)
        key_len = max(max(r[3]) + 1 for r in rows)
        ids = np.zeros((b, t), dtype=np.int64)
        pos = np.zeros((b, t), dtype=np.int64)
        cols = np.full((b, t), self.cache.scratch, dtype=np.int64)
        mask = np.zeros((b, t, key_len), dtype=bool)
        for i, (slot, toks, p, c, vis, prefix) in enumerate(rows):
            n = len(toks)
            ids[i, :n] = toks
            pos[i, :n] = p
            cols[i, :n] = c
            mask[i, :n, :prefix] = True
            if vis is None:
                mask[i, :n, c[0]:c[0] + n] = np.tri(n, dtype=bool)
            else:
                for j, v in enumerate(vis):
                    mask[i, j, v] = True
            mask[i, n:, 0] = True
        slots = torch.tensor([r[0] for r in rows], dtype=torch.long, device=device)
        logit_index = None
        if last_only:
            logit_index = torch.tensor([[len(r[1]) - 1] for r in rows], dtype=torch.long, device=device)
        batch = ForwardBatch(slots, torch.from_numpy(ids).to(device), torch.from_numpy(pos).to(device),
                             torch.from_numpy(cols).to(device), torch.from_numpy(mask).to(device),
                             logit_index=logit_index)
        logits, _ = self.model.forward_batch(self.cache, batch)
        self.forwards += 1
        dists = self._distributions(logits.cpu(), sampling)
        if last_only:
            return list(dists)
        return [d[: len(r[1])] for d, r in zip(dists, rows)]

    def propose(self, inputs: list[DraftInput]) -> list[TokenTree]:
        if not inputs:
            return []
        spec = self.tree_spec
        trees = [TokenTree(inp.context[-1]) for inp in inputs]
        # 1) catch up with the committed context; the last row yields the root's children
        rows = []
        for inp in inputs:
            length = self.cache.lengths[inp.slot]
            if length > len(inp.context) - 1:
                length = 0  # stale slot (reused or preempted): rebuild
            catch = inp.context[length:]
            columns = list(range(length, len(inp.context)))
            rows.append((inp.slot, catch, columns, columns, None, length))
        logits = self._forward(rows, [inp.sampling for inp in inputs], last_only=True)
        for inp in inputs:
            self.cache.lengths[inp.slot] = len(inp.context)
        frontier: list[list[tuple[_Node, np.ndarray]]] = [
            [(_Node(0, len(inp.context) - 1, 0.0), lg[-1])] for inp, lg in zip(inputs, logits)
        ]
        nodes: list[dict[int, _Node]] = [{0: fr[0][0]} for fr in frontier]
        next_col = [len(inp.context) for inp in inputs]
        depth_limit = [min(inp.max_depth, spec.depth) for inp in inputs]
        budget = [inp.node_budget if not spec.dynamic_nodes else min(inp.node_budget, spec.dynamic_nodes + 1)
                  for inp in inputs]
        depth = 0
        while True:
            depth += 1
            new_rows, new_nodes = [], []
            for i, inp in enumerate(inputs):
                created: list[_Node] = []
                if depth <= depth_limit[i] and frontier[i]:
                    created = self._expand(i, inp, trees[i], nodes[i], frontier[i], depth, budget[i])
                frontier[i] = []
                if created and depth < depth_limit[i]:
                    for node in created:
                        node.column = next_col[i]
                        next_col[i] += 1
                    new_nodes.append((i, created))
            if not new_nodes:
                break
            for i, created in new_nodes:
                inp = inputs[i]
                tree = trees[i]
                toks, pos, cols, vis = [], [], [], []
                for node in created:
                    path = tree.path_to(node.tree_index)[1:]
                    toks.append(tree.tokens[node.tree_index])
                    pos.append(len(inp.context) - 1 + tree.depths[node.tree_index])
                    cols.append(node.column)
                    vis.append([nodes[i][p].column for p in path])
                new_rows.append((inp.slot, toks, pos, cols, vis, len(inp.context)))
            out = self._forward(new_rows, [inputs[i].sampling for i, _ in new_nodes])
            for (i, created), lg in zip(new_nodes, out):
                frontier[i] = [(node, lg[j]) for j, node in enumerate(created)]
        for i, inp in enumerate(inputs):
            cols = {idx: n.column for idx, n in nodes[i].items() if n.column >= 0 and idx != 0}
            self._fed[inp.request_id] = (trees[i], cols, len(inp.context), inp.slot)
        return trees

    def _expand(self, i, inp, tree: TokenTree, nodes, frontier, depth, budget) -> list[_Node]:
        spec = self.tree_spec
        created: list[_Node] = []
        if spec.dynamic_nodes:
            cands = []
            for node, lg in frontier:
                logp = lg if inp.sampling.greedy else np.log(np.maximum(lg, 1e-300))
                for tok, prop, logp in self._children(logp, spec.beam, _GREEDY, inp.rng):
                    cands.append((node.cum_logprob + logp, node.tree_index, tok, prop))
            cands.sort(key=lambda c: -c[0])
            for cum, parent, tok, prop in cands[: spec.beam]:
                if len(tree) >= budget:
                    break
                idx = tree.add(parent, tok, prop)
                if idx not in nodes:
                    nodes[idx] = _Node(idx, -1, cum)
                    created.append(nodes[idx])
            return created
        width = spec.widths[depth - 1]
        for node, lg in frontier:
            for tok, prop, logp in self._children(lg, width, inp.sampling, inp.rng):
                if len(tree) >= budget and tree.child(node.tree_index, tok) is None:
                    continue
                idx = tree.add(node.tree_index, tok, prop)
                if idx not in nodes:
                    nodes[idx] = _Node(idx, -1, node.cum_logprob + logp)
                    created.append(nodes[idx])
        return created

    def observe(self, request_id: str, tree: TokenTree, path: tuple[int, ...], committed: list[int]) -> None:
        """KV commit for the draft cache: keep the accepted nodes' keys/values, contiguous after the context."""
        fed = self._fed.pop(request_id, None)
        if fed is None or fed[0] is not tree:
            return
        _, cols, base, slot = fed
        src = []
        for node in path[1:]:
            if node not in cols:
                break
            src.append(cols[node])
        self.cache.compact(slot, base, src)

    def release(self, request_id: str, slot: int) -> None:
        self._fed.pop(request_id, None)
        self.cache.reset(slot)
