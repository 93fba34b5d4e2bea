"""Model drafter: a small Llama-family LM (an SSM in SpecInfer's terms) expands a token tree.

Two expansion modes (SpecInfer §3, "expansion-based token tree construction"):

- **static widths** ``(w_1, ..., w_D)``: every node at depth ``d - 1`` gets ``w_d`` children — its top-``w_d``
  draft tokens in greedy mode (deterministic proposals), ``w_d`` independent samples from the draft distribution
  ``q`` in sample mode (sampled proposals). SpecInfer's default is ``1,1,3,1,1,1,1,1``.
- **dynamic** (``dynamic:NODES``): per depth, the children of the frontier with the highest cumulative draft
  probability are kept (a beam), and the final tree keeps the ``NODES`` best nodes overall (deterministic).

Draft forwards are batched across requests: one forward catches every request's draft KV cache up with the
committed tokens (and yields the root's children), then one forward per depth expands all frontiers. Top-k,
sampling and beam selection run on the device; each depth brings back only the chosen token ids (one host copy
per depth). The draft's cache uses the request's slot number; after verification the accepted nodes' draft
keys/values are compacted into place for the whole batch at once (KV commit), whichever drafters' trees were
merged, so nothing is recomputed for them.

Exact sampling under any budget: the number of draws at each parent is fixed before sampling, as
``min(width, remaining budget)``, and a sampled draw spends one unit even when it duplicates a child, so a
budget cut never depends on the drawn values (:mod:`specstream.stages.speculative.tree`).
"""

from __future__ import annotations

import time

from dataclasses import dataclass

import torch

from specstream.kernels.sampling import warp_logits
from specstream.types import SamplingParams
from specstream.stages.speculative.drafters.base import DraftInput, Drafter
from specstream.stages.speculative.logits import History
from specstream.stages.speculative.models.llama import ForwardBatch, LlamaDecoder
from specstream.kernels.tree_attention import tree_mask
from specstream.kernels.verification import sample_inverse_cdf
from specstream.stages.speculative.tree import Proposal, ProposalKind, QRef, TokenTree, ancestor_matrix

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

    def depth_nodes(self) -> tuple[int, ...]:
        """Nodes of the full tree cut after depth ``d`` (root included), for ``d = 0..depth``; ``()`` for a
        dynamic tree (its shape changes every step)."""
        if self.dynamic_nodes:
            return ()
        out, total, level = [1], 1, 1
        for w in self.widths:
            level *= w
            total += level
            out.append(total)
        return tuple(out)

    def num_nodes(self) -> int:
        """Nodes of a full tree, root included."""
        if self.dynamic_nodes:
            return self.dynamic_nodes + 1
        total, level = 1, 1
        for w in self.widths:
            level *= w
            total += level
        return total


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
        name: the drafter's name (unique per engine).
    """

    reads_forced = True  # the forced chain is read by the catch-up forward; the levels grow from its end

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
        self.vocab_limit = min(vocab_limit, model.config.vocab_size, target_vocab)
        self.target_vocab = target_vocab
        self.max_len = max_len
        self.cache = model.new_cache(num_slots, max_len + tree.num_nodes() + 2)
        self.cache.sanitize = True  # a NaN draft node never poisons later drafts of the slot
        self.forwards = 0
        #: committed tokens re-read by catch-up forwards (the KV commit keeps this near one per step)
        self.catch_up_tokens = 0
        self._pending: list[tuple[int, int, list[int]]] = []  # KV commits of this step: (slot, base, columns)
        self._excess_s = 0.0  # the last catch-up's seconds spent on tokens beyond a steady step's
        self._one_off = False  # the last catch-up read mostly one-off tokens (a prompt)
        self._token_s: float | None = None  # seconds per token of long catch-up reads (EMA)
        self._fed: dict[int, list[int]] = {}  # slot -> the context list its cache was last caught up to

    # -- forwards ------------------------------------------------------------------------------------------
    def _forward(self, slots: list[int], ids: list[list[int]], positions: list[list[int]], columns: list[list[int]],
                 mask: torch.Tensor, last_only: bool) -> torch.Tensor:
        """One draft forward over ragged rows (padded here). ``mask`` is ``[B, T, S]`` on the device.
        Returns logits ``[B, T, V]`` (``[B, 1, V]`` of each row's last token with ``last_only``)."""
        dev = self.model.device
        t = mask.shape[1]
        pad = lambda rows, value: [r + [value] * (t - len(r)) for r in rows]  # noqa: E731
        lengths = [len(r) for r in ids]
        batch = ForwardBatch(
            torch.tensor(slots, device=dev), torch.tensor(pad(ids, 0), device=dev),
            torch.tensor(pad(positions, 0), device=dev), torch.tensor(pad(columns, self.cache.scratch), device=dev),
            mask, logit_index=torch.tensor([[n - 1] for n in lengths], device=dev) if last_only else None,
            slot_list=list(slots), max_position=max(max(p) for p in positions), row_lengths=lengths,
            logit_index_host=[[n - 1] for n in lengths] if last_only else None)
        logits, _ = self.model.forward_batch(self.cache, batch)
        self.forwards += 1
        return logits

    def _catch_up(self, inputs: list[DraftInput]) -> torch.Tensor:
        """Feed every request's committed tokens the draft has not seen, then its forced tokens
        (:attr:`DraftInput.forced`, tree nodes ``1..f`` in columns ``base + 1..f``); returns the logits ``[B, V]``
        of each request's last row (the root, or the forced chain's end)."""
        t0 = time.perf_counter()
        ids, pos, slots, starts = [], [], [], []
        # what a step that follows a drafted step reads: at most what that step's tree could commit (its depth
        # and the bonus token; one token before the request's first tree), forced tokens included. Not the
        # configured depth: a 20-level chain's first read of a 49-token prompt then counted 21 tokens as
        # steady, and 74 ms per level was measured for a draft level of about 17 ms
        steady = 0
        for inp in inputs:
            last = inp.state.get("tree")
            steady += (last.max_depth + 1 if last is not None else 1) + inp.state.get("forced", 0)
            inp.state["forced"] = len(inp.forced)
            cached = self._cached(inp.slot, inp.context, consume=True)
            self._fed[inp.slot] = inp.context
            ids.append(inp.context[cached:] + list(inp.forced))
            pos.append(list(range(cached, len(inp.context) + len(inp.forced))))
            slots.append(inp.slot)
            starts.append(cached)
        dev = self.model.device
        t = max(len(r) for r in ids)
        key_len = max(len(inp.context) + len(inp.forced) for inp in inputs)
        start = torch.tensor(starts, device=dev)
        n = torch.tensor([len(r) for r in ids], device=dev)
        q_pos = start[:, None] + torch.arange(t, device=dev)[None, :]  # [B, T]
        cols = torch.arange(key_len, device=dev)
        mask = cols[None, None, :] <= q_pos[:, :, None]
        valid = torch.arange(t, device=dev)[None, :] < n[:, None]
        mask &= valid[:, :, None]
        mask[:, :, 0] |= ~valid
        logits = self._forward(slots, ids, pos, pos, mask, last_only=True)[:, 0]
        n_forced = sum(len(inp.forced) for inp in inputs)
        fed = sum(len(r) for r in ids) - n_forced  # committed tokens read
        self.catch_up_tokens += fed
        for inp in inputs:
            self.cache.lengths[inp.slot] = len(inp.context)
        # a steady step feeds at most the last step's committed tokens (forced + depth + 1 per request); the rest
        # is a one-off (a prompt, tokens committed while drafting was off), charged pro rata
        elapsed = (time.perf_counter() - t0) * fed / max(1, fed + n_forced)  # the committed tokens' share
        self._excess_s = elapsed * max(0, fed - steady) / fed if fed else 0.0
        self._one_off = fed >= max(16, 2 * steady)
        if self._one_off:  # a read of mostly one-off tokens: its seconds per token
            token_s = elapsed / fed
            self._token_s = token_s if self._token_s is None else 0.7 * self._token_s + 0.3 * token_s
        return logits

    def _cached(self, slot: int, context: list[int] | None, consume: bool = False, context_len: int = 0) -> int:
        """Leading tokens of ``context`` whose keys/values the slot holds: its cached length, or for a slot the
        previous request left (length 0), what :meth:`KVCache.reusable` finds of ``context`` in it (at most
        ``len(context) - 1``; :meth:`release` with ``keep``); 0 for a stale slot (reused or preempted), which
        :meth:`_catch_up` rebuilds. ``consume``: the catch-up writes after that prefix, so the record goes."""
        n_ctx = len(context) if context is not None else context_len
        cached = self.cache.lengths[slot]
        if cached == 0 and context is not None:  # (a slot in use has no record: release made it, catch-up took it)
            cached = self.cache.reusable(slot, context, n_ctx - 1, consume)
        return 0 if cached > n_ctx - 1 else cached

    def lag(self, slot: int, context_len: int, context: list[int] | None = None) -> int:
        return max(0, context_len - 1 - self._cached(slot, context, context_len=context_len))

    def catch_up_token_s(self) -> float | None:
        return self._token_s

    def catch_up_excess_s(self) -> float:
        return self._excess_s

    def catch_up_was_one_off(self) -> bool:
        return self._one_off

    # -- choosing children on the device -------------------------------------------------------------------
    def _q(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Draft distributions ``[N, vocab_limit]`` (float32) after each row's warpers, batched per distinct
        sampling parameters."""
        logits = logits[:, : self.vocab_limit].float()
        groups: dict[tuple, list[int]] = {}
        for i, sp in enumerate(params):
            groups.setdefault((sp.temperature, sp.top_k, sp.top_p), []).append(i)
        if len(groups) == 1:
            return torch.softmax(warp_logits(logits, params[0]), -1)
        out = torch.empty_like(logits)
        for idx in groups.values():
            sel = torch.tensor(idx, device=logits.device)
            out[sel] = torch.softmax(warp_logits(logits[sel], params[idx[0]]), -1)
        return out

    def propose(self, inputs: list[DraftInput]) -> list[TokenTree]:
        if not inputs:
            return []
        spec = self.tree_spec
        trees = [TokenTree(inp.context[-1]) for inp in inputs]
        # the grammar's forced tokens: one chain below the root (nodes 1..f, columns base + 1..f, contiguous with
        # the context), read by the catch-up forward; the draft levels grow from the chain's end
        forced_prop = Proposal(ProposalKind.DETERMINISTIC, drafter=self.name)
        starts = [(trees[i].add_path(list(inp.forced), forced_prop) or [0])[-1] for i, inp in enumerate(inputs)]
        cap = spec.dynamic_nodes + 1 if spec.dynamic_nodes else spec.num_nodes()
        # draws left, root and forced chain excluded
        units = [max(0, min(inp.node_budget - len(inp.forced), cap) - 1) for inp in inputs]
        depth_limit = [min(inp.max_depth - len(inp.forced), spec.depth) for inp in inputs]
        fed = [set(range(len(inp.forced) + 1)) for inp in inputs]  # nodes whose draft K/V are in the cache
        logits = self._catch_up(inputs)
        rows = [(i, starts[i]) for i in range(len(inputs))]  # (request, node) of each row of ``logits``
        cum = torch.zeros(len(inputs), device=logits.device)  # dynamic: cumulative log-probability per row
        depth = 0
        while rows:
            depth += 1
            active = [r for r in range(len(rows)) if depth <= depth_limit[rows[r][0]] and units[rows[r][0]] > 0]
            if not active:
                break
            if len(active) != len(rows):
                sel = torch.tensor(active, device=logits.device)
                logits, cum = logits[sel], cum[sel]
                rows = [rows[r] for r in active]
            logits = self._mask_drafts(inputs, trees, rows, logits)
            if spec.dynamic_nodes:
                created, new_cum = self._expand_dynamic(inputs, trees, units, rows, logits, cum)
            else:
                created = self._expand_static(inputs, trees, units, rows, logits, spec.widths[depth - 1])
                new_cum = None
            feed = [(i, node) for i, node in created if depth < depth_limit[i]]
            if not feed:
                break
            logits = self._feed(inputs, trees, feed)
            for i, node in feed:
                fed[i].add(node)
            rows = feed
            if new_cum is not None:
                keep = {key: j for j, key in enumerate(created)}
                cum = new_cum[torch.tensor([keep[key] for key in feed], device=logits.device)]
            else:
                cum = torch.zeros(len(rows), device=logits.device)
        for i, inp in enumerate(inputs):
            inp.state["tree"] = trees[i]
            inp.state["fed"] = fed[i]
            inp.state["base"] = len(inp.context) - 1
        return trees

    @staticmethod
    def _mask_drafts(inputs: list[DraftInput], trees: list[TokenTree], rows: list[tuple[int, int]],
                     logits: torch.Tensor) -> torch.Tensor:
        """Forbid in ``logits`` ``[len(rows), V]`` the tokens the request's grammar forbids after each row's
        node (``DraftInput.constraint``): a draft never proposes a token the target could not accept. The
        packed masks of a request's rows are applied on the device in one call."""
        by_req: dict[int, list[int]] = {}
        for r, (i, _) in enumerate(rows):
            if inputs[i].constraint is not None:
                by_req.setdefault(i, []).append(r)
        if not by_req:
            return logits
        logits = logits.float().clone()  # the forward's output may be an inference tensor
        for i, rs in by_req.items():
            hist = [History(inputs[i].context, trees[i].path_tokens(rows[r][1])) for r in rs]  # views, no copy
            idx = torch.tensor(rs, device=logits.device)
            logits[idx] = inputs[i].constraint.apply(hist, logits[idx], len(inputs[i].context))
        return logits

    def _expand_static(self, inputs, trees, units, rows, logits, width) -> list[tuple[int, int]]:
        """Children of every row's node: ``min(width, units left)`` draws each, counted before drawing; greedy
        rows take the top-k (deterministic), sample rows draw from ``q`` (sampled). One host copy of the ids."""
        n_rows = len(rows)
        counts = []
        for i, _ in rows:
            n = min(width, units[i])
            counts.append(n)
            units[i] -= n
        sample = [r for r, (i, _) in enumerate(rows) if not inputs[i].sampling.greedy]
        greedy = [r for r, (i, _) in enumerate(rows) if inputs[i].sampling.greedy]
        dev = logits.device
        k = max(counts) if counts else 0
        if k == 0:
            return []
        chosen = torch.zeros((n_rows, k), dtype=torch.long, device=dev)
        q_table = None
        if greedy:
            g = torch.tensor(greedy, device=dev) if len(greedy) != n_rows else None
            sel = logits if g is None else logits[g]
            vals, top = torch.topk(sel[:, : self.vocab_limit], k, dim=-1)
            top = torch.where(vals > float("-inf"), top, -1)  # a grammar-forbidden token: no draw
            if g is None:
                chosen = top
            else:
                chosen[g] = top
        if sample:
            s = torch.tensor(sample, device=dev)
            q_table = self._q(logits[s], [inputs[rows[r][0]].sampling for r in sample])
            uniforms = []
            for r in sample:  # the request's own stream, in draw order
                rng = inputs[rows[r][0]].rng
                uniforms.append([rng.random() for _ in range(counts[r])] + [0.0] * (k - counts[r]))
            drawn = sample_inverse_cdf(q_table, torch.tensor(uniforms, dtype=torch.float32, device=dev))
            chosen[s] = drawn
        ids = chosen.tolist()  # the one host copy of this depth
        created = []
        sample_row = {r: j for j, r in enumerate(sample)}
        det = Proposal(ProposalKind.DETERMINISTIC, drafter=self.name)
        for r, (i, node) in enumerate(rows):
            tree = trees[i]
            if r in sample_row:
                prop = Proposal(ProposalKind.SAMPLED, drafter=self.name, q=QRef(q_table, sample_row[r]))
            else:
                prop = det
            for j in range(counts[r]):
                if ids[r][j] < 0:
                    break
                before = len(tree)
                child = tree.add(node, ids[r][j], prop)
                if len(tree) > before:
                    created.append((i, child))
        return created

    def _expand_dynamic(self, inputs, trees, units, rows, logits, cum) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """Dynamic expansion: per request, the ``beam`` best children of its frontier by cumulative draft
        log-probability (deterministic proposals). One host copy of (row, token, score)."""
        beam = self.tree_spec.beam
        dev = logits.device
        params = [inputs[i].sampling for i, _ in rows]
        if all(p.greedy for p in params):
            logp = torch.log_softmax(logits[:, : self.vocab_limit].float(), -1)
        else:
            logp = torch.log(self._q(logits, params).clamp_min(1e-30))
        vals, toks = torch.topk(logp, min(beam, logp.shape[-1]), dim=-1)  # [N, beam]
        scores = cum[:, None] + vals
        # per request: its rows' candidates side by side, padded with -inf
        by_req: dict[int, list[int]] = {}
        for r, (i, _) in enumerate(rows):
            by_req.setdefault(i, []).append(r)
        reqs = list(by_req)
        width = max(len(v) for v in by_req.values()) * vals.shape[1]
        index = torch.tensor([sum(([r * vals.shape[1] + c for c in range(vals.shape[1])] for r in by_req[i]), [])
                              + [0] * (width - len(by_req[i]) * vals.shape[1]) for i in reqs], device=dev)
        valid = torch.tensor([[True] * (len(by_req[i]) * vals.shape[1]) + [False] * (width - len(by_req[i])
                                                                                      * vals.shape[1])
                              for i in reqs], device=dev)
        flat_scores = torch.where(valid, scores.reshape(-1)[index], torch.full_like(index, float("-inf"),
                                                                                    dtype=scores.dtype))
        best, where = torch.topk(flat_scores, min(beam, width), dim=-1)  # [R, beam]
        flat = torch.gather(index, 1, where)
        picked = torch.stack([flat.double(), toks.reshape(-1)[flat].double(), best.double()], -1)
        host = picked.tolist()  # the one host copy of this depth
        created, new_scores = [], []
        det = Proposal(ProposalKind.DETERMINISTIC, drafter=self.name)
        for ri, i in enumerate(reqs):
            tree = trees[i]
            for flat_idx, tok, score in host[ri]:
                if units[i] <= 0 or score == float("-inf"):
                    break
                r = int(flat_idx) // vals.shape[1]
                parent = rows[r][1]
                before = len(tree)
                child = tree.add(parent, int(tok), det)
                if len(tree) > before:
                    units[i] -= 1
                    created.append((i, child))
                    new_scores.append(score)
        return created, torch.tensor(new_scores, dtype=torch.float32, device=dev)

    def _feed(self, inputs, trees, feed: list[tuple[int, int]]) -> torch.Tensor:
        """One draft forward over the new nodes of every request; returns their logits ``[N, V]`` in ``feed``
        order. Each node sits in column ``base + node`` and sees the prefix and its ancestors only."""
        dev = self.model.device
        by_req: dict[int, list[int]] = {}
        for i, node in feed:
            by_req.setdefault(i, []).append(node)
        reqs = list(by_req)
        t_nodes = max(len(trees[i]) for i in reqs)
        parents = torch.tensor([trees[i].parents + [-1] * (t_nodes - len(trees[i])) for i in reqs], device=dev)
        anc = ancestor_matrix(parents, max(trees[i].max_depth for i in reqs))
        base = [len(inputs[i].context) - 1 for i in reqs]
        key_len = max(b + len(trees[i]) for b, i in zip(base, reqs))
        full = tree_mask(torch.tensor(base, device=dev), anc, torch.tensor([len(trees[i]) for i in reqs], device=dev),
                         key_len)  # [R, T_nodes, S]
        width = max(len(v) for v in by_req.values())
        pick = torch.tensor([by_req[i] + [0] * (width - len(by_req[i])) for i in reqs], device=dev)
        mask = torch.gather(full, 1, pick[:, :, None].expand(-1, -1, key_len))
        valid = torch.tensor([[True] * len(by_req[i]) + [False] * (width - len(by_req[i])) for i in reqs], device=dev)
        mask &= valid[:, :, None]
        mask[:, :, 0] |= ~valid
        ids = [[trees[i].tokens[n] for n in by_req[i]] for i in reqs]
        pos = [[b + trees[i].depths[n] for n in by_req[i]] for b, i in zip(base, reqs)]
        cols = [[b + n for n in by_req[i]] for b, i in zip(base, reqs)]
        logits = self._forward([inputs[i].slot for i in reqs], ids, pos, cols, mask, last_only=False)
        # back to ``feed`` order
        order = {}
        for ri, i in enumerate(reqs):
            for j, node in enumerate(by_req[i]):
                order[(i, node)] = ri * width + j
        flat = logits.reshape(-1, logits.shape[-1])
        return flat[torch.tensor([order[key] for key in feed], device=dev)]

    # -- KV commit ------------------------------------------------------------------------------------------
    def observe(self, state: dict, slot: int, tree: TokenTree, accepted: list[int], committed: list[int]) -> None:
        """Queue the KV commit: the accepted tokens found in this drafter's own tree (whatever was merged into
        the verified tree) whose keys/values were fed, moved right after the context."""
        own: TokenTree | None = state.pop("tree", None)
        fed: set[int] = state.pop("fed", set())
        base = state.pop("base", None)
        if own is None or base is None:
            return
        src = []
        for node in own.walk(list(accepted)):
            if node not in fed:
                break
            src.append(base + node)
        self._pending.append((slot, base + 1, src))

    def end_step(self) -> None:
        if self._pending:
            slots, bases, cols = zip(*self._pending)
            self._pending = []
            self.cache.compact_batch(list(slots), list(bases), list(cols))

    def release(self, slot: int, keep: bool = False) -> None:
        fed = self._fed.pop(slot, None)
        if not keep or fed is not None:  # (keep, nothing fed since the last release: the record stands)
            self.cache.keep(slot, fed[:self.cache.lengths[slot]] if keep else None)
        self.cache.reset(slot)
