"""The executor: owns the device, the models and their KV caches; runs one :class:`StepPlan` per call.

Per step (SpecInfer §4): drafters propose a token tree per decoding request (draft forwards batched across
requests) -> one target forward verifies every tree of the batch and prefills the newly admitted prompts ->
each request's accepted path (+ bonus token) is committed -> KV commit: the accepted nodes' keys/values are
compacted so each slot holds exactly prompt + committed tokens.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specstream.kernels.sampling import target_probs
from specstream.kernels.tree_attention import build_tree_mask
from specstream.kernels.verification import VerifyResult, sample_from, verify_greedy, verify_stochastic
from specstream.schedulers.plan import (
    DecodeWork,
    EncodeResult,
    EncodeWork,
    RequestStepResult,
    StepOutput,
    StepPlan,
)
from specstream.stages.speculative.drafters.base import AdaptiveBudget, DraftInput, Drafter
from specstream.stages.speculative.logits import apply_logits_processors
from specstream.stages.speculative.models.llama import ForwardBatch, LlamaDecoder
from specstream.stages.speculative.tree import TokenTree


@dataclass
class _Row:
    request_id: str
    slot: int
    tokens: list[int]
    positions: list[int]
    columns: list[int]
    ancestor: torch.Tensor  # [T_b, T_b]
    prefix: int
    logit_rows: list[int]
    tree: TokenTree | None  # None for a prefill
    work: object


class SpeculativeExecutor:
    """Runs step plans on one target decoder and its drafters.

    Args:
        target: the target decoder.
        drafters: drafters whose trees are merged (trie union) each step; empty = no speculation.
        num_slots: KV cache slots.
        max_len: tokens per slot (prompt + output).
        full_nodes: tree size a request asks for when its drafts are accepted well (root included).
        adaptive: shrink trees of requests whose recent acceptance is low.
    """

    def __init__(self, target: LlamaDecoder, drafters: list[Drafter], num_slots: int, max_len: int,
                 full_nodes: int = 21, adaptive: bool = True, attention_layers: tuple[int, ...] | None = None,
                 visual_aware: bool = False, visual_mass_threshold: float = 0.3):
        self.target = target
        self.drafters = list(drafters)
        self.max_len = max_len
        self.cache = target.new_cache(num_slots, max_len)
        self.full_nodes = full_nodes
        self.adaptive = adaptive
        self._rngs: dict[str, random.Random] = {}
        self._budgets: dict[str, AdaptiveBudget] = {}
        self.target_forwards = 0
        self.prefix_embeds: dict[str, torch.Tensor] = {}
        n_layers = len(target.model.layers) if hasattr(target, "model") and hasattr(target.model, "layers") else 0
        #: layers whose attention on visual tokens is exported (default: the second half of the decoder)
        self.attention_layers = tuple(attention_layers) if attention_layers is not None else tuple(
            range(n_layers // 2, n_layers))
        #: shrink the tree where the target looks hard at the image (text-only drafts are weakest there)
        self.visual_aware = visual_aware
        #: measured draft time / verify time of steps with drafts (EMA); adaptivity weighs acceptance against it
        #: (``cost_aware`` False: acceptance alone decides, deterministic — what the simulator models)
        self.cost_ratio: float | None = None
        self.cost_aware = True
        self.visual_mass_threshold = visual_mass_threshold
        #: encoder registry: modality -> callable run on each :class:`EncodeWork` of that modality. It encodes
        #: the items (found by ``item_id``) and may store ``prefix_embeds`` for their requests.
        self.encoders: dict[str, Callable[[EncodeWork], None]] = {}
        # request id -> encoder output [S_enc, d] (encoder-decoder targets), handed to the target at prefill
        self.encoder_outputs: dict[str, torch.Tensor] = {}

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def release(self, request_id: str, slot: int) -> None:
        self.cache.reset(slot)
        for d in self.drafters:
            d.release(request_id, slot)
        self._rngs.pop(request_id, None)
        self._budgets.pop(request_id, None)
        self.prefix_embeds.pop(request_id, None)
        self.encoder_outputs.pop(request_id, None)

    def preempt(self, request_id: str, slot: int) -> None:
        """Free a preempted request's KV cache (target and drafters); keep what its resume needs: the random
        stream, the adaptive tree budget, the prefix embeddings and, for an encoder-decoder target, the slot's
        encoder output (its cross-attention keys/values, copied out before the slot is freed)."""
        saved = getattr(self.target, "saved_encoder_output", None)
        if saved is not None and request_id not in self.encoder_outputs:
            kv = saved(self.cache, slot)
            if kv is not None:
                self.encoder_outputs[request_id] = kv
        self.cache.reset(slot)
        for d in self.drafters:
            d.release(request_id, slot)

    def _encode(self, works: tuple[EncodeWork, ...]) -> tuple[EncodeResult, ...]:
        results = []
        for work in works:
            encoder = self.encoders.get(work.modality)
            error = None
            if encoder is None:
                error = {"code": "invalid_request", "message": f"no encoder registered for {work.modality!r}"}
            else:
                try:
                    encoder(work)
                except Exception as exc:  # one failed batch fails its requests, not the engine
                    error = {"code": "internal_error", "message": f"{work.modality} encoder failed: {exc}"}
            results.extend(EncodeResult(rid, item.item_id, error) for rid, item in work.items)
        return tuple(results)

    def _rng(self, request_id: str, seed: int) -> random.Random:
        if request_id not in self._rngs:
            self._rngs[request_id] = random.Random(seed)
        return self._rngs[request_id]

    def _budget(self, request_id: str) -> AdaptiveBudget:
        if request_id not in self._budgets:
            self._budgets[request_id] = AdaptiveBudget(full_nodes=self.full_nodes)
        return self._budgets[request_id]

    # -- drafting -------------------------------------------------------------------------------------------
    def _draft(self, decodes: tuple[DecodeWork, ...]) -> tuple[dict[str, TokenTree], float]:
        t0 = time.perf_counter()
        trees: dict[str, TokenTree] = {}
        inputs = []
        for work in decodes:
            req = work.request
            if work.node_budget > 1 and work.max_depth > 0 and self.drafters:
                inputs.append(DraftInput(req.request_id, work.slot, req.draft_context, work.node_budget, work.max_depth,
                                         req.sampling, self._rng(req.request_id, req.sampling.seed)))
            else:
                trees[req.request_id] = TokenTree(req.context[-1])
        if inputs:
            proposals = [d.propose(inputs) for d in self.drafters]
            for i, inp in enumerate(inputs):
                mine = [p[i] for p in proposals]
                tree = mine[0] if len(mine) == 1 else TokenTree.merge(mine, max_nodes=inp.node_budget)
                if len(tree) > inp.node_budget or tree.max_depth > inp.max_depth:
                    tree = tree.truncated(inp.node_budget, inp.max_depth)
                trees[inp.request_id] = tree
        return trees, time.perf_counter() - t0

    # -- the step -------------------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run ``plan``: draft, one target forward for the whole batch, verify, commit."""
        t_start = time.perf_counter()
        for request_id, slot in plan.released:
            self.release(request_id, slot)
        for request_id, slot in plan.preempted:
            self.preempt(request_id, slot)
        encoded = self._encode(plan.encodes)
        if not plan.prefills and not plan.decodes:
            return StepOutput(plan.step, (), 0, 0, time.perf_counter() - t_start, encoded)
        trees, draft_s = self._draft(plan.decodes)
        drafted = any(len(t) > 1 for t in trees.values())
        rows: list[_Row] = []
        for work in plan.prefills:
            req = work.request
            tokens = work.tokens  # prompt, + committed output when resuming after preemption
            n = len(tokens)
            self.cache.reset(work.slot)
            enc = self.encoder_outputs.pop(req.request_id, None)
            if enc is not None:
                self.target.set_encoder_output(self.cache, work.slot, enc)
            rows.append(_Row(req.request_id, work.slot, list(tokens), list(range(n)), list(range(n)),
                             torch.ones((n, n), dtype=torch.bool).tril_(), 0, [n - 1], None, work))
        for work in plan.decodes:
            req = work.request
            tree = trees[req.request_id]
            ct = tree.compile()
            base = self.cache.lengths[work.slot]
            t = ct.num_nodes
            rows.append(_Row(req.request_id, work.slot, ct.tokens.tolist(), (base + ct.depths).tolist(),
                             list(range(base, base + t)), ct.ancestor_mask, base, list(range(t)), tree, work))
        t_verify = time.perf_counter()
        logits, attn = self._target_forward(rows)
        visual = self._visual_attention(rows, attn)
        finite = torch.isfinite(logits).all(-1)  # [B, R], before processors add their -inf
        if any(row.work.request.logits_processors for row in rows):
            logits = logits.clone()  # an inference tensor cannot be edited in place
        for i, row in enumerate(rows):
            procs = row.work.request.logits_processors
            if procs and bool(finite[i, : len(row.logit_rows)].all()):
                r = len(row.logit_rows)
                logits[i, :r] = apply_logits_processors(procs, self._histories(row), logits[i, :r])
        dists = self._target_distributions(rows, logits, finite)
        results = []
        for i, row in enumerate(rows):
            results.append(self._commit(row, logits[i, : len(row.logit_rows)], dists[i], visual[i]))
        verify_s = time.perf_counter() - t_verify
        if drafted and verify_s > 0 and self.cost_aware:
            ratio = draft_s / verify_s
            self.cost_ratio = ratio if self.cost_ratio is None else 0.8 * self.cost_ratio + 0.2 * ratio
        n_dec = max(1, len(plan.decodes))
        results = [
            dataclasses.replace(r, draft_s=0.0 if r.is_prefill else draft_s / n_dec, verify_s=verify_s / len(rows))
            for r in results
        ]
        return StepOutput(plan.step, tuple(results), 1, sum(len(r.tokens) for r in rows),
                          time.perf_counter() - t_start, encoded)

    def _target_forward(self, rows: list[_Row]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """One target forward over every row; returns (logits ``[B, R, V]`` on CPU, attention probs of
        :attr:`attention_layers` ``{layer: [B, Hq, T, S]}`` when a row has a visual span, else ``{}``)."""
        device = self.target.device
        b = len(rows)
        t = max(len(r.tokens) for r in rows)
        r_max = max(len(r.logit_rows) for r in rows)
        key_len = max(r.prefix + len(r.tokens) for r in rows)
        ids = np.zeros((b, t), dtype=np.int64)
        pos = np.zeros((b, t), dtype=np.int64)
        cols = np.full((b, t), self.cache.scratch, dtype=np.int64)
        lidx = np.zeros((b, r_max), dtype=np.int64)
        for i, r in enumerate(rows):
            n = len(r.tokens)
            ids[i, :n] = r.tokens
            pos[i, :n] = r.positions
            cols[i, :n] = r.columns
            lidx[i, : len(r.logit_rows)] = r.logit_rows
        ids, pos, cols, lidx = (torch.from_numpy(a) for a in (ids, pos, cols, lidx))
        mask = build_tree_mask(torch.tensor([r.prefix for r in rows]), [r.ancestor for r in rows], key_len, t)
        embeds = None
        if any(r.tree is None and r.request_id in self.prefix_embeds for r in rows):
            embeds = self.target.embed(ids.to(device))
            for i, r in enumerate(rows):
                pe = self.prefix_embeds.get(r.request_id)
                if r.tree is None and pe is not None:
                    embeds[i, : pe.shape[0]] = pe.to(embeds.dtype)
        batch = ForwardBatch(
            slots=torch.tensor([r.slot for r in rows], dtype=torch.long, device=device),
            input_ids=ids.to(device), position_ids=pos.to(device), write_index=cols.to(device),
            attn_mask=mask.to(device), logit_index=lidx.to(device), inputs_embeds=embeds,
            attention_layers=self.attention_layers if any(r.work.request.visual_span for r in rows) else (),
        )
        logits, attn = self.target.forward_batch(self.cache, batch)
        self.target_forwards += 1
        return logits.cpu(), attn

    def _visual_attention(self, rows: list[_Row], attn: dict[int, torch.Tensor]) -> list[np.ndarray | None]:
        """Per row with a visual span: the attention mass on its visual tokens for every query row,
        ``[T_b, n_visual]`` (mean over heads and :attr:`attention_layers`); None for other rows."""
        out: list[np.ndarray | None] = [None] * len(rows)
        if not attn:
            return out
        stacked = torch.stack([attn[layer] for layer in sorted(attn)]).mean(0).mean(1)  # [B, T, S]
        for i, row in enumerate(rows):
            span = row.work.request.visual_span
            if span is not None:
                out[i] = stacked[i, : len(row.tokens), span[0]:span[1]].float().cpu().numpy()
        return out

    @staticmethod
    def _target_distributions(rows: list[_Row], logits: torch.Tensor, finite: torch.Tensor) -> list:
        """Per row: argmax ids ``[R]`` (greedy rows) or target distributions ``[R, V]`` float64 (sample rows),
        computed batched per distinct sampling parameters; rows whose raw logits were not finite
        (``finite [B, R]`` False) get None."""
        out: list = [None] * len(rows)
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(rows):
            if not bool(finite[i, : len(row.logit_rows)].all()):
                continue
            sp = row.work.request.sampling
            groups.setdefault(("greedy",) if sp.greedy else (sp.temperature, sp.top_k, sp.top_p), []).append(i)
        for key, idx in groups.items():
            sel = logits[idx]
            if key == ("greedy",):
                dist = sel.argmax(-1)
            else:
                flat = sel.reshape(-1, sel.shape[-1]).nan_to_num(neginf=-1e30, posinf=1e30)
                dist = target_probs(flat, rows[idx[0]].work.request.sampling).reshape(sel.shape)
            for j, i in enumerate(idx):
                out[i] = dist[j, : len(rows[i].logit_rows)]
        return out

    @staticmethod
    def _histories(row: _Row) -> list[list[int]]:
        """Per logits row, the tokens before the one it predicts: the prefilled tokens (prefill), or context +
        the draft tokens on the tree path root -> node (decode)."""
        if row.tree is None:
            return [list(row.tokens)]
        context = row.work.request.context
        return [context + row.tree.path_tokens(i) for i in range(len(row.logit_rows))]

    def _commit(self, row: _Row, logits: torch.Tensor, dist: torch.Tensor | None,
                visual: np.ndarray | None = None) -> RequestStepResult:
        """Verify one row (``dist``: argmax ids or target distributions of its ``R`` logit rows) and commit."""
        req = row.work.request
        is_prefill = row.tree is None
        if dist is None:
            self.release(req.request_id, row.slot)
            return RequestStepResult(req.request_id, is_prefill=is_prefill, error={
                "code": "numerical_error", "message": "the target produced NaN or infinite logits"})
        params = req.sampling
        if is_prefill:
            if params.greedy:
                first = int(dist[-1])
            else:
                first = sample_from(dist[-1].numpy(), self._rng(req.request_id, params.seed))
            result = VerifyResult((), (), first)
        elif params.greedy:
            result = verify_greedy(dist.tolist(), row.tree)
        else:
            result = verify_stochastic(dist, row.tree, self._rng(req.request_id, params.seed))
        proposed = list(result.accepted_tokens) + [result.bonus_token]
        limit = min(req.remaining, self.max_len - len(req.context))
        new, reason = [], None
        for tok in proposed:
            new.append(tok)
            if tok in req.eos_token_ids:
                reason = "eos"
                break
            if len(new) >= limit:
                reason = "length"
                break
        num_accepted = min(result.num_accepted, len(new))
        if is_prefill:
            self.cache.lengths[row.slot] = len(row.tokens)
        else:
            keep = 1 + num_accepted  # root + accepted draft tokens that were committed
            self.cache.compact(row.slot, row.prefix, [row.prefix + i for i in result.path[:keep]])
            for d in self.drafters:
                d.observe(req.request_id, row.tree, result.path[:keep], new)
        vis: tuple = ()
        if visual is not None:
            # the row that predicted committed token k: the prompt's last row (prefill) or path node k (tree)
            src = [len(row.tokens) - 1] if is_prefill else list(result.path)
            vis = tuple(visual[src[k]] for k in range(min(len(new), len(src))))
        lps = ()
        if req.logprobs:  # logits rows are the row's logit_rows: a prefill has only its last
            lrows = [len(row.logit_rows) - 1] if is_prefill else list(result.path)
            lps = self._logprobs(logits, dist, lrows[:len(new)], new)
        if reason is not None:
            self.release(req.request_id, row.slot)  # finished: nothing of it stays cached
            return RequestStepResult(req.request_id, tuple(new), num_accepted, is_prefill, reason, None, 1,
                                     visual_attention=vis, logprobs=lps)
        requested = 1
        if req.speculate and self.drafters:
            budget = self._budget(req.request_id)
            if not is_prefill:
                budget.observe(num_accepted, len(row.tree))
            requested = budget.requested_nodes(self.cost_ratio or 0.0) if self.adaptive else self.full_nodes
            if self.visual_aware and visual is not None and vis:
                # the node that predicted the last committed token is where the next tree starts: when the
                # target looks hard at the image there, a text-only draft is weakest, so ask for a smaller tree
                mass = float(vis[-1].sum())
                if mass > self.visual_mass_threshold:
                    requested = max(2, int(round(requested * (1.0 - mass))))
        return RequestStepResult(req.request_id, tuple(new), num_accepted, is_prefill, reason, None, requested,
                                 visual_attention=vis, logprobs=lps)

    @staticmethod
    def _logprobs(logits: torch.Tensor, dist: torch.Tensor, rows: list[int], tokens: list[int]) -> tuple[float, ...]:
        """Log-probability of ``tokens[k]`` at logits row ``rows[k]``: log-softmax of the processed logits
        ``[R, V]`` (greedy: ``dist`` holds argmax ids), or the log of the target distribution ``dist [R, V]``
        (sampled)."""
        idx = torch.tensor(rows, dtype=torch.long)
        tok = torch.tensor(tokens, dtype=torch.long)
        if dist.ndim == 2:  # sampled: the warped target distribution
            return tuple(float(x) for x in torch.log(dist[idx, tok].clamp_min(1e-300)))
        sel = logits[idx].float()
        return tuple(float(x) for x in (sel.gather(1, tok[:, None])[:, 0] - torch.logsumexp(sel, -1)))
