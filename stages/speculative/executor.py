"""The executor: owns the device, the models and their KV caches; runs one :class:`StepPlan` per call.

Per step (SpecInfer §4): drafters propose a token tree per decoding request (draft forwards batched across
requests) -> the trees are merged per request and compiled once into padded tensors -> one target forward
verifies every tree of the batch and prefills the newly admitted prompts -> verification runs batched on the
device (greedy matching, or multi-step speculative sampling with residuals) -> one host copy brings back each
request's accepted path, bonus token, a finite flag and, when asked, log-probabilities -> KV commit: one
batched gather moves every request's accepted keys/values into place, so each slot holds exactly prompt +
committed tokens.

Host syncs per step: one per draft depth (the chosen draft token ids) and one for verification. Nothing of the
vocabulary ever crosses to the host. Everything the executor keeps about a request lives in one
:class:`RequestState`, created at admission (:meth:`SpeculativeExecutor.admit`, from the plan's
:class:`~specstream.schedulers.plan.RequestSpec`) and dropped in one place (:meth:`SpeculativeExecutor.drop`).
The executor never sees the scheduler's ``Request``: the plan's work items carry ids and per-step numbers, the
spec what does not change, and the committed tokens are the executor's own list (it commits them).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field

import torch

from specstream.kernels.sampling import target_probs
from specstream.kernels.tree_attention import tree_mask
from specstream.kernels.verification import (
    path_from_last,
    sample_inverse_cdf,
    verify_greedy_batch,
    verify_stochastic_batch,
)
from specstream.schedulers.plan import (
    DecodeWork,
    EncodeResult,
    EncodeWork,
    ForkWork,
    PrefillWork,
    RequestSpec,
    RequestStepResult,
    StepOutput,
    StepPlan,
)
from specstream.schedulers.costmodel import SpecGate, StepCostFit
from specstream.schedulers.budget import AdaptiveBudget
from specstream.stages.speculative.drafters.base import DraftInput, Drafter
from specstream.stages.speculative.drafters.grammar import GrammarDrafter
from specstream.stages.speculative.grammar import DraftView, grammar_constraint_of
from specstream.stages.speculative.logits import History, apply_logits_processors, apply_logits_processors_rows
from specstream.stages.speculative.models.llama import ForwardBatch, LlamaDecoder
from specstream.kernels.trees import CompiledTrees
from specstream.stages.speculative.tree import TokenTree, ancestor_matrix, compile_trees

#: a prefill joins the decode rows' forward only when it is at most this many times longer than the widest tree
#: (padding every tree row to a long prompt would multiply the step's work); otherwise it gets its own forward
MERGE_PREFILL_FACTOR = 2


@dataclass
class RequestState:
    """Everything the executor keeps about one request, from admission until it ends.

    Attributes:
        spec: what the plan told about the request when it was admitted (token ids, limits, sampling; immutable).
        rng: the request's own random stream (draft sampling and verification uniforms).
        budget: adaptive tree size.
        prefix_embeds: ``[n_prompt, hidden]`` prompt embeddings replacing the token embeddings at prefill (a
            VLM's visual tokens spliced in), or None.
        encoder_output: an encoder-decoder target's per-request encoder output (or its projected
            cross-attention keys/values), handed to the target at prefill; kept across preemption.
        drafters: per drafter name, that drafter's scratch for this request.
        mm_outputs: per multimodal input (``MMInput.item_id``), its encoder output, until the prefill hook turned
            them into ``prefix_embeds`` / ``encoder_output``.
        output: the tokens committed so far (the executor's own list: :meth:`commit` extends it in the step that
            commits them; the scheduler books the same tokens from the step's results).
        context: ``prompt_ids + output`` (grows in place with :attr:`output`; read-only for everyone else).
        draft_context: what drafters see: the draft prompt + :attr:`output` (:attr:`context` itself when the
            request has no draft prompt of its own).
    """

    spec: RequestSpec
    rng: random.Random
    budget: AdaptiveBudget
    prefix_embeds: torch.Tensor | None = None
    encoder_output: object | None = None
    drafters: dict[str, dict] = field(default_factory=dict)
    mm_outputs: dict[str, object] = field(default_factory=dict)
    output: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    draft_context: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.restart(self.spec)

    def restart(self, spec: RequestSpec) -> None:
        """Take ``spec`` (a new admission, or a resume after preemption) and its committed tokens: O(context),
        once per admission."""
        self.spec = spec
        self.output = list(spec.committed)
        self.context = list(spec.prompt_ids) + self.output
        self.draft_context = (self.context if spec.draft_prompt_ids is None
                              else list(spec.draft_prompt_ids) + self.output)

    def commit(self, tokens: list[int]) -> None:
        """Append the tokens a step committed (O(new tokens))."""
        self.output.extend(tokens)
        self.context.extend(tokens)
        if self.draft_context is not self.context:
            self.draft_context.extend(tokens)

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def remaining(self) -> int:
        return self.spec.max_new_tokens - len(self.output)


class _StateField(MutableMapping):
    """``request id -> RequestState.<field>`` as a mapping (stages store encoder outputs this way). A value stored
    for a request whose spec has not arrived yet (queued, not yet in a plan's ``admitted``) waits in the
    executor's ``pending`` until :meth:`SpeculativeExecutor.admit` moves it into the new record."""

    def __init__(self, executor: "SpeculativeExecutor", name: str):
        self._ex, self._name = executor, name

    def _get(self, rid):
        st = self._ex.states.get(rid)
        if st is None:
            return self._ex.pending.get(rid, {}).get(self._name)
        return getattr(st, self._name)

    def __getitem__(self, rid):
        value = self._get(rid)
        if value is None:
            raise KeyError(rid)
        return value

    def __setitem__(self, rid, value):
        st = self._ex.states.get(rid)
        if st is None:
            self._ex.pending.setdefault(rid, {})[self._name] = value
        else:
            setattr(st, self._name, value)

    def __delitem__(self, rid):
        self[rid]  # KeyError when absent
        st = self._ex.states.get(rid)
        if st is None:
            self._ex.pending[rid].pop(self._name)
        else:
            setattr(st, self._name, None)

    def _ids(self) -> list[str]:
        ids = set(self._ex.states) | set(self._ex.pending)
        return [rid for rid in ids if self._get(rid) is not None]

    def __iter__(self) -> Iterator[str]:
        return iter(self._ids())

    def __len__(self) -> int:
        return len(self._ids())


@dataclass
class _Row:
    """One row of the target forward: a prefill or a decode step of one request."""

    state: RequestState
    work: PrefillWork | DecodeWork
    slot: int
    prefix: int  # committed cache length before the row (0 for a prefill)
    tokens: list[int]
    tree: TokenTree | None = None  # None for a prefill
    tree_index: int = -1  # index into the step's compiled trees

    @property
    def is_prefill(self) -> bool:
        return self.tree is None

    @property
    def spec(self) -> RequestSpec:
        return self.state.spec


def _draft_constraint(req: RequestSpec) -> DraftView | None:
    """The request's grammar constraint as its drafters see it (their prompt may lack the image tokens), or
    None."""
    constraint = grammar_constraint_of(req.logits_processors) if req.logits_processors else None
    if constraint is None:
        return None
    shift = 0 if req.draft_prompt_ids is None else len(req.prompt_ids) - len(req.draft_prompt_ids)
    return DraftView(constraint, constraint.begin_index - shift)


class SpeculativeExecutor:
    """Runs step plans on one target decoder and its drafters.

    Args:
        target: the target decoder.
        drafters: drafters whose trees are merged (trie union) each step; empty = no speculation.
        num_slots: KV cache slots.
        max_len: tokens per slot (prompt + output).
        full_nodes: tree size a request asks for when its drafts are accepted well (root included).
        adaptive: shrink trees of requests whose recent acceptance is low.
        attention_layers: layers whose attention on visual tokens is exported (None: the second half).
        visual_aware: shrink trees where the target looks hard at the image (text-only drafts are weakest there).
        visual_mass_threshold: attention mass on the image above which trees shrink.
        grammar_drafter: also propose the forced tokens of requests with a grammar constraint
            (:class:`GrammarDrafter`, merged first; it proposes nothing for other requests).
    """

    def __init__(self, target: LlamaDecoder, drafters: list[Drafter], num_slots: int, max_len: int,
                 full_nodes: int = 21, adaptive: bool = True, attention_layers: tuple[int, ...] | None = None,
                 visual_aware: bool = False, visual_mass_threshold: float = 0.3, grammar_drafter: bool = True):
        self.target = target
        self.drafters = list(drafters)
        #: the schema-derived drafter (None: off); kept apart from :attr:`drafters`, see :attr:`proposers`
        self.grammar_drafter = GrammarDrafter() if grammar_drafter else None
        self._chains: dict[str, tuple[int, ...]] = {}  # this step's forced chain per request id
        self._ran: list[Drafter] = []  # this step's drafters with a cost that drafted (not the grammar drafter)
        self._drafted_levels = 0  # their deepest level below the forced chains
        names = [d.name for d in self.drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"drafter names must be unique, got {names}")
        self.max_len = max_len
        self.cache = target.new_cache(num_slots, max_len)
        self.full_nodes = full_nodes
        self.adaptive = adaptive
        self.states: dict[str, RequestState] = {}
        #: request id -> {field: value} stored before the request's spec arrived (see ``_StateField``)
        self.pending: dict[str, dict] = {}
        self.target_forwards = 0
        #: prompt (context) tokens run through the target by prefill rows, every chunk counted (a fork adds none)
        self.prefill_tokens = 0
        #: prompt tokens whose keys/values a prefill found still in its slot (the slot's previous request held the
        #: same prefix) and did not run through the target again (:meth:`_reused_prefix`); counted in
        #: :attr:`prefill_tokens` too, which is what the plans booked
        self.prefix_reused_tokens = 0
        #: reuse a slot's cached prompt prefix (:meth:`_reused_prefix`); off for targets whose prompt keys/values
        #: depend on more than the token ids (an encoder output, prompt embeddings, multimodal encoders)
        self.prefix_reuse = not hasattr(target, "set_encoder_output")
        #: requests started as a fork of another's prefill (:class:`~specstream.schedulers.plan.ForkWork`)
        self.forks = 0
        n_layers = len(target.model.layers) if hasattr(target, "model") and hasattr(target.model, "layers") else 0
        #: layers whose attention on visual tokens is exported (default: the second half of the decoder)
        self.attention_layers = tuple(attention_layers) if attention_layers is not None else tuple(
            range(n_layers // 2, n_layers))
        self.visual_aware = visual_aware
        #: measured draft time / verify time of steps with drafts (EMA); adaptivity weighs acceptance against it
        #: (``cost_aware`` False: acceptance alone decides, deterministic — what the simulator models)
        self.cost_ratio: float | None = None
        #: measured draft time per tree level / a plain step's time (EMA): the adaptive budget picks the depth by it
        self.depth_cost: float | None = None
        #: verify seconds per tree node x decoding rows / a plain step's time (0 until the fit has a slope)
        self.node_cost: float = 0.0
        #: the target forward's seconds against the tokens it verified (``StepCostFit``)
        self.verify_fit = StepCostFit()
        self._level_s: float | None = None
        #: the last usable (intercept, slope) of :attr:`verify_fit` (plain steps alone leave it without a slope)
        self._verify_line: tuple[float, float] | None = None
        self.cost_aware = True
        #: the step-level decision (speculation on or off for the whole batch, from measured costs) of adaptive,
        #: cost-aware executors; None: per-request budgets alone
        self.gate: SpecGate | None = SpecGate()
        #: nodes of the first static-tree model drafter's tree cut after each depth (the depth-by-cost budget)
        self.depth_nodes: tuple[int, ...] = next(
            (d.tree_spec.depth_nodes() for d in self.drafters if getattr(d, "tree_spec", None) is not None), ())
        self.visual_mass_threshold = visual_mass_threshold
        #: multimodal encoders: modality -> ``fn(items)`` over ``[(RequestState, MMInput), ...]`` of one encode
        #: batch, storing each output in ``state.mm_outputs[item_id]`` (:meth:`register_encoder`)
        self.mm_encoders: dict[str, Callable[[list], None]] = {}
        #: the one way multimodal inputs become prefill inputs: ``fn(state)`` called once before a request's
        #: first prefill chunk, turning ``state.mm_outputs`` into ``prefix_embeds`` / ``encoder_output``
        self.prefill_hook: Callable[[RequestState], None] | None = None
        #: legacy encoder registry: modality -> callable run on each :class:`EncodeWork` (finds media by item id)
        self.encoders: dict[str, Callable[[EncodeWork], None]] = {}
        #: request id -> prompt embeddings (a view of :attr:`states`)
        self.prefix_embeds: MutableMapping = _StateField(self, "prefix_embeds")
        #: request id -> encoder output (a view of :attr:`states`)
        self.encoder_outputs: MutableMapping = _StateField(self, "encoder_output")

    # -- per-request state: one record, created at admission, dropped in one place --------------------------
    def admit(self, spec: RequestSpec) -> RequestState:
        """Create the request's record from its spec (:attr:`StepPlan.admitted`), with the values stored for it
        before (:attr:`pending`). A request already known (a resume after preemption) keeps its record (random
        stream, tree budget, prompt embeddings) and takes the new spec's committed tokens."""
        st = self.states.get(spec.request_id)
        if st is None:
            budget = AdaptiveBudget(full_nodes=self.full_nodes, depth_nodes=self.depth_nodes)
            st = RequestState(spec, random.Random(spec.sampling.seed), budget)
            for name, value in self.pending.pop(spec.request_id, {}).items():
                setattr(st, name, value)
            self.states[spec.request_id] = st
        else:
            st.restart(spec)
        return st

    def drop(self, request_id: str) -> None:
        """Forget everything about a request (its slot must already be freed)."""
        self.states.pop(request_id, None)
        self.pending.pop(request_id, None)

    def _free_slot(self, slot: int, clear: bool = False) -> None:
        if clear:
            self.cache.clear(slot)  # and its record of held tokens
        else:
            self.cache.reset(slot)
        for d in self.proposers:
            d.release(slot, keep=self.prefix_reuse and not clear)

    def _keep(self, request_id: str, slot: int) -> None:
        """Remember which tokens the slot's keys/values hold (the request's first ``cache.lengths[slot]`` context
        tokens) before the slot is freed, for :meth:`_reused_prefix`; only for requests whose prompt keys/values
        are a function of their token ids alone."""
        st = self.states.get(request_id)
        if st is None:  # released already (a request that finished in its step is released again by the plan)
            return
        plain = (self.prefix_reuse and st.prefix_embeds is None and st.encoder_output is None
                 and not st.spec.mm_inputs and self.prefill_hook is None)
        self.cache.keep(slot, st.context[:self.cache.lengths[slot]] if plain else None)

    def _reused_prefix(self, st: RequestState, work: PrefillWork) -> int:
        """How many leading prompt tokens of a request's first prefill chunk (``work.start == 0``) already have
        their keys/values in ``work.slot`` (:meth:`KVCache.reusable` of what the slot's previous request left,
        :meth:`_keep`), at most the chunk's length - 1 (the chunk's last token runs, so the final chunk still
        gives its logits row). The slot's record is consumed either way: the prefill overwrites what follows.
        Reusing a cached prefix is what llama.cpp's server does per slot and vLLM's automatic prefix caching does
        per block; here it is exact because the target's keys and values of a token do not depend on the other
        rows of its forward (``row_invariant``), which the speculative exactness already requires."""
        n = self.cache.reusable(work.slot, st.context, work.num_tokens - 1)
        return 0 if st.prefix_embeds is not None or st.spec.mm_inputs else n

    def release(self, request_id: str, slot: int) -> None:
        """A finished request: free its slot (remembering the tokens its keys/values hold, for a later request
        with the same prompt prefix) and drop its record."""
        self._keep(request_id, slot)
        self._free_slot(slot)
        self.drop(request_id)

    def fail(self, request_id: str, slot: int) -> None:
        """A failed request: zero its slot's keys/values (nothing of it reaches the slot's next request) and
        drop its record."""
        self._free_slot(slot, clear=True)
        self.drop(request_id)

    def preempt(self, request_id: str, slot: int) -> None:
        """Free a preempted request's KV cache (target and drafters); keep its record (random stream, adaptive
        tree budget, prefix embeddings) and, for an encoder-decoder target, the slot's encoder output (its
        cross-attention keys/values, copied out before the slot is freed)."""
        st = self.states.get(request_id)
        saved = getattr(self.target, "saved_encoder_output", None)
        if st is not None and saved is not None and st.encoder_output is None:
            st.encoder_output = saved(self.cache, slot)
        if st is not None:
            st.drafters.clear()  # their caches are freed: nothing fed survives
        self._keep(request_id, slot)  # what the slot holds, for whichever request prefills there next
        self._free_slot(slot)

    def register_encoder(self, modality: str, fn: Callable[[list], None]) -> None:
        """Encode ``modality`` inputs with ``fn(items)``, ``items`` = ``[(RequestState, MMInput), ...]`` of one
        batch; ``fn`` stores each output in ``state.mm_outputs[mm.item_id]``."""
        self.mm_encoders[modality] = fn

    def handles(self, modality: str) -> bool:
        return modality in self.mm_encoders or modality in self.encoders

    def _encode(self, works: tuple[EncodeWork, ...]) -> tuple[EncodeResult, ...]:
        results = []
        for work in works:
            error = None
            try:
                if work.modality in self.mm_encoders:
                    items = []
                    for rid, item in work.items:
                        st = self.states[rid]
                        mm = next((m for m in st.spec.mm_inputs if m.item_id == item.item_id), None)
                        if mm is None:
                            raise KeyError(f"request {rid!r} has no input {item.item_id!r}")
                        items.append((st, mm))
                    self.mm_encoders[work.modality](items)
                elif work.modality in self.encoders:
                    self.encoders[work.modality](work)
                else:
                    error = {"code": "invalid_request", "message": f"no encoder registered for {work.modality!r}"}
            except Exception as exc:  # one failed batch fails its requests, not the engine
                error = {"code": "internal_error", "message": f"{work.modality} encoder failed: {exc}"}
            results.extend(EncodeResult(rid, item.item_id, error) for rid, item in work.items)
        return tuple(results)

    # -- drafting -------------------------------------------------------------------------------------------
    @property
    def proposers(self) -> list[Drafter]:
        """Every drafter whose trees are merged, in merge order: the grammar drafter (forced tokens are the
        surest draft, so a node budget never cuts them first), then :attr:`drafters`."""
        return ([self.grammar_drafter] if self.grammar_drafter is not None else []) + self.drafters

    def _speculates(self, req: RequestSpec) -> bool:
        """Whether ``req`` can get drafts: a drafter, or a grammar whose forced tokens the grammar drafter
        proposes."""
        return bool(self.drafters) or (self.grammar_drafter is not None and _draft_constraint(req) is not None)

    #: most forced (grammar-determined) tokens put in front of one request's tree per step: they come on top of
    #: the plan's tree (the scheduler's node and token budgets do not count them; they are accepted nearly always)
    MAX_FORCED = 16

    def _forced(self, st: "RequestState", work: DecodeWork) -> tuple[int, ...]:
        """The tokens the request's grammar forces after its context (xgrammar's jump-forward tokens), at most
        :data:`MAX_FORCED` and what its remaining tokens and cache columns allow (they come first: near that cap the
        plan's draft levels are cut to make room); () without a grammar drafter, a grammar, or speculation. They
        cost no draft forward: the drafters that read :attr:`DraftInput.forced` put them in front of their trees."""
        if self.grammar_drafter is None or not st.spec.speculate:
            return ()
        constraint = _draft_constraint(st.spec)
        if constraint is None:
            return ()
        limit = min(self.MAX_FORCED, self._depth_cap(st))
        return tuple(constraint.forced_tokens(st.draft_context, limit)) if limit > 0 else ()

    def _depth_cap(self, st: "RequestState") -> int:
        """The deepest draft token the request's remaining tokens and cache columns allow."""
        return min(st.remaining - 1, self.max_len - len(st.context))

    def _draft(self, decodes: tuple[DecodeWork, ...]) -> tuple[list[TokenTree], tuple[DecodeWork, ...], float]:
        """Draft every decode row: the grammar's forced tokens first (zero cost, also for rows the plan or the
        gate left without draft levels), then each drafter's tree after them, merged. Returns the trees, the
        decodes with their budgets and depths grown by the forced tokens, and the seconds spent."""
        t0 = time.perf_counter()
        trees: list[TokenTree | None] = [None] * len(decodes)
        works = list(decodes)
        drafting, forced = [], {}
        for j, work in enumerate(decodes):
            st = self.states[work.request_id]
            levels = work.node_budget > 1 and work.max_depth > 0 and self._speculates(st.spec)
            chain = self._forced(st, work)
            if chain:
                forced[j] = chain
                cap = self._depth_cap(st)  # forced tokens come first; draft levels get what is left
                works[j] = dataclasses.replace(work, node_budget=min(work.node_budget + len(chain), cap + 1),
                                               max_depth=min(work.max_depth + len(chain), cap))
            if levels or chain:
                drafting.append(j)
            else:
                trees[j] = TokenTree(st.context[-1])
        self._chains = {works[j].request_id: chain for j, chain in forced.items()}
        self._ran, self._drafted_levels = [], 0
        if drafting:
            proposals = []
            for d in self.proposers:
                # a drafter that reads the forced chain drafts below it, within the grown budget and depth; the
                # others draft from the root within the plan's tree, as without a grammar
                reads = d.reads_forced
                rows = [j for j in drafting if d is self.grammar_drafter or
                        (decodes[j].node_budget > 1 and decodes[j].max_depth > 0
                         and (not reads or works[j].max_depth > len(forced.get(j, ()))))]
                inputs = []
                for j in rows:
                    work = works[j] if reads else decodes[j]
                    st = self.states[work.request_id]
                    req = st.spec
                    inputs.append(DraftInput(req.request_id, work.slot, st.draft_context, work.node_budget,
                                             work.max_depth, req.sampling, st.rng,
                                             st.drafters.setdefault(d.name, {}), req.draft_hypothesis,
                                             _draft_constraint(req), forced.get(j, ()) if reads else ()))
                proposals.append(dict(zip(rows, d.propose(inputs))) if inputs else {})
                if inputs and d is not self.grammar_drafter:
                    self._ran.append(d)
                    for j, tree in zip(rows, proposals[-1].values()):
                        f = len(forced.get(j, ())) if reads else 0
                        self._drafted_levels = max(self._drafted_levels, tree.max_depth - f)
            for j in drafting:
                root = self.states[works[j].request_id].context[-1]
                mine = [p[j] for p in proposals if j in p]
                if self.grammar_drafter is not None and len(mine) > 1 and len(mine[0]) == 1:
                    mine = mine[1:]  # no forced tokens: the other drafters' trees as they were
                budget = works[j].node_budget
                tree = (TokenTree.merge(mine, max_nodes=budget) if len(mine) > 1
                        else mine[0] if mine else TokenTree(root))
                if len(tree) > budget or tree.max_depth > works[j].max_depth:
                    tree = tree.truncated(budget, works[j].max_depth)
                trees[j] = tree
        return trees, tuple(works), time.perf_counter() - t0

    # -- the step -------------------------------------------------------------------------------------------
    def _gate_step(self, plan: StepPlan) -> tuple[DecodeWork, ...]:
        """The plan's decodes with this step's trees cut or dropped for the whole batch when they are expected to
        lose (:class:`~specstream.schedulers.costmodel.SpecGate`: the target forward's fitted fixed + per-token
        seconds, the measured draft seconds per level, each request's per-level acceptance, and what each row's
        draft must read before it can draft, its catch-up). Decided before any draft is drawn. Until both costs
        have been measured: the gate's warm-up (one draft level for the one row whose draft has least to read)."""
        decodes = plan.decodes
        line = self._verify_line
        if self.gate is None or not (self.adaptive and self.cost_aware and self.drafters and decodes):
            return decodes
        states = [self.states[w.request_id] for w in decodes]
        # no deeper than the request's evidence supports (``AdaptiveBudget.ramp``)
        decodes = tuple(dataclasses.replace(w, max_depth=st.budget.ramp) if w.max_depth > st.budget.ramp else w
                        for w, st in zip(decodes, states))
        lags = [[d.lag(w.slot, len(st.draft_context), st.draft_context) for d in self.drafters]
                for w, st in zip(decodes, states)]
        alphas = self.gate.row_alphas([st.budget.measured_alpha for st in states])
        rows = [(w.node_budget, w.max_depth, a) for w, a in zip(decodes, alphas)]
        if line is None or self._level_s is None:
            choice = self.gate.warmup(rows, self.depth_nodes, [sum(row) for row in lags])
        else:
            # seconds per token read, per drafter; until a long read was timed, the target's (an upper bound)
            token_s = [t if (t := d.catch_up_token_s()) is not None else line[1] for d in self.drafters]
            catch_up = [(sum(n * t for n, t in zip(row, token_s)), max(0, st.spec.max_new_tokens - len(st.output)))
                        for row, st in zip(lags, states)]
            extra = sum(p.num_tokens for p in plan.prefills)
            choice = self.gate.decide(rows, line[0], line[1], self._level_s, self.depth_nodes, extra, catch_up)
        return self.gate.cut(decodes, choice, self.depth_nodes)

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run ``plan``: draft, target forward(s), batched verification on the device, one host copy, commit.
        ``plan.forks`` start from the prompt of a final prefill chunk of the plan: after that forward each copies
        the source slot's K/V and verifies the source's last logits row with its own random stream (its result
        follows the rows' results).

        Raises:
            ValueError: a fork whose source has no final prefill chunk in the plan, or whose context differs.
        """
        t_start = time.perf_counter()
        for rel in plan.released:
            self.release(rel.request_id, rel.slot)
        for rel in plan.preempted:
            self.preempt(rel.request_id, rel.slot)
        for spec in plan.admitted:
            self.admit(spec)
        forks: dict[str, list[ForkWork]] = {}
        for fw in plan.forks:
            forks.setdefault(fw.source, []).append(fw)
        encoded = self._encode(plan.encodes)
        if forks and not plan.prefills:
            raise ValueError(f"forks of {sorted(forks)} without their source's final prefill chunk in the plan")
        if not plan.prefills and not plan.decodes:
            return StepOutput(plan.step, (), 0, 0, time.perf_counter() - t_start, encoded)
        decodes = self._gate_step(plan)
        trees, decodes, draft_s = self._draft(decodes)
        drafted = bool(self._ran)  # a drafter with a cost ran (forced tokens alone cost no draft time)
        t_verify = time.perf_counter()
        rows: list[_Row] = []
        for work in plan.prefills:
            st = self.states[work.request_id]
            if len(st.context) != work.context_len:
                raise ValueError(f"prefill of {work.request_id!r}: the plan has a context of {work.context_len} "
                                 f"tokens, the executor's record {len(st.context)}")
            if work.start == 0:
                self.cache.reset(work.slot)
                if st.mm_outputs and self.prefill_hook is not None:
                    self.prefill_hook(st)  # multimodal inputs -> prefix embeddings / encoder output, once
                    st.mm_outputs.clear()
                if st.encoder_output is not None:
                    self.target.set_encoder_output(self.cache, work.slot, st.encoder_output)
                    st.encoder_output = None  # in the slot now (a preemption copies it out again)
            if work.final and st.prefix_embeds is not None:
                self._share_prefix_embeds(st)
            start = work.start
            if work.start == 0:
                start = self._reused_prefix(st, work)
                self.cache.lengths[work.slot] = start
                self.prefix_reused_tokens += start
            rows.append(_Row(st, work, work.slot, start, st.context[start: work.start + work.num_tokens]))
            self.prefill_tokens += work.num_tokens
        missing = set(forks) - {w.request_id for w in plan.prefills if w.final}
        if missing:
            raise ValueError(f"forks of {sorted(missing)} without their source's final prefill chunk in the plan")
        compiled = None
        if decodes:
            compiled = compile_trees(trees, self.target.device, self.target.config.vocab_size)
            for j, (work, tree) in enumerate(zip(decodes, trees)):
                st = self.states[work.request_id]
                if len(st.context) != work.context_len:
                    raise ValueError(f"decode of {work.request_id!r}: the plan has a context of {work.context_len} "
                                     f"tokens, the executor's record {len(st.context)}")
                rows.append(_Row(st, work, work.slot, self.cache.lengths[work.slot], tree.tokens, tree, j))
        results = self._run_rows(rows, compiled, forks)
        verify_s = time.perf_counter() - t_verify
        # a step whose draft read a prompt is a poor first measurement of a steady step's draft cost: the time of
        # a many-token forward does not split pro rata by tokens (the first level's cost came out at 4 ms or 74
        # ms, against 17 ms measured in steady steps); later such steps are averaged in with the rest
        first_one_off = self._level_s is None and any(d.catch_up_was_one_off() for d in self._ran)
        if drafted and verify_s > 0 and self.cost_aware and not first_one_off:
            ratio = draft_s / verify_s
            self.cost_ratio = ratio if self.cost_ratio is None else 0.8 * self.cost_ratio + 0.2 * ratio
            # one-off catch-up reads (a prompt, tokens of steps without drafts) are not a cost per level
            steady_s = max(0.0, draft_s - sum(d.catch_up_excess_s() for d in self._ran))
            level_s = steady_s / max(1, self._drafted_levels)  # draft levels, the forced chain left out
            self._level_s = level_s if self._level_s is None else 0.8 * self._level_s + 0.2 * level_s
        if verify_s > 0 and self.cost_aware:
            self.verify_fit.observe(sum(len(r.tokens) for r in rows), verify_s)
            line = self.verify_fit.line()
            if line is not None:
                self._verify_line = line
            elif self._verify_line is None:  # no slope yet (or none: a memory-bound forward): flat, the mean step
                self._verify_line = (self.verify_fit.mean_s(), 0.0)
            line = self._verify_line
            if self._level_s is not None:
                n_dec = len(decodes)
                plain = line[0] + line[1] * n_dec if line is not None and n_dec else None
                if plain:  # relative to a plain step of this batch: one root per decoding row
                    self.depth_cost, self.node_cost = self._level_s / plain, line[1] * n_dec / plain
                else:
                    self.depth_cost, self.node_cost = self._level_s / verify_s, 0.0
        n_dec = max(1, len(decodes))
        results = [
            dataclasses.replace(r, draft_s=0.0 if r.is_prefill else draft_s / n_dec, verify_s=verify_s / len(rows))
            for r in results
        ]
        self.forks += len(plan.forks)
        return StepOutput(plan.step, tuple(results), self._forwards_this_step, sum(len(r.tokens) for r in rows),
                          time.perf_counter() - t_start, encoded)

    # -- target forward -------------------------------------------------------------------------------------
    def _groups(self, rows: list[_Row]) -> list[list[int]]:
        """Rows per target forward: the decodes together, with prefills that are not much longer."""
        widest_tree = max((len(r.tokens) for r in rows if not r.is_prefill), default=0)
        if widest_tree == 0:
            return [list(range(len(rows)))]
        merged, alone = [], []
        for i, r in enumerate(rows):
            if r.is_prefill and len(r.tokens) > MERGE_PREFILL_FACTOR * max(widest_tree, 8):
                alone.append(i)
            else:
                merged.append(i)
        return ([alone] if alone else []) + [merged]

    def _share_prefix_embeds(self, source: RequestState) -> None:
        """A source's prompt embeddings go to every request forked from it (shared, read-only ``[n_prompt,
        hidden]``): a fork that found no slot, or is preempted later, prefills itself with them."""
        rid = source.request_id
        for st in self.states.values():
            if st.spec.fork_of == rid and st.prefix_embeds is None:
                st.prefix_embeds = source.prefix_embeds

    def _run_rows(self, rows: list[_Row], compiled: CompiledTrees | None,
                  forks: dict[str, list[ForkWork]] | None = None) -> list[RequestStepResult]:
        """Every row's result in row order, then one per fork (in the order of the forks' source rows)."""
        self._forwards_this_step = 0
        out: list[RequestStepResult | None] = [None] * len(rows)
        extra: list[RequestStepResult] = []
        for group in self._groups(rows):
            part = [rows[i] for i in group]
            mine = [fw for r in part if r.is_prefill for fw in (forks or {}).get(r.state.request_id, ())]
            res = self._forward_and_verify(part, compiled, mine)
            for i, r in zip(group, res):
                out[i] = r
            extra.extend(res[len(group):])
        return out + extra  # type: ignore[operator]

    def _fork_rows(self, rows: list[_Row], forks: list[ForkWork], logits: torch.Tensor,
                   attn: dict) -> tuple[list[_Row], torch.Tensor, dict]:
        """Rows for ``forks``: each copies its source row's slot (the prompt's K/V, columns ``[0, prompt)``) into
        its own slot and takes the source's logits row ``[R, V]`` (and attention rows), so verification samples its
        first token with its own random stream and its own logits processors. One device copy per fork."""
        at = {r.state.request_id: i for i, r in enumerate(rows)}
        src_idx, out = [], []
        for fw in forks:
            i = at[fw.source]
            src = rows[i]
            st = self.states[fw.request_id]
            if src.work.start + src.work.num_tokens != len(st.context) or fw.context_len != len(st.context):
                raise ValueError(f"fork {fw.request_id!r} has a context of {len(st.context)} "
                                 f"tokens; its source {fw.source!r} prefilled {src.prefix + len(src.tokens)}")
            self.cache.copy_prefix(src.slot, fw.slot, src.prefix + len(src.tokens))
            work = PrefillWork(fw.request_id, fw.slot, src.work.num_tokens, src.work.start, len(st.context),
                               fw.model)
            out.append(_Row(st, work, fw.slot, src.prefix, src.tokens))
            src_idx.append(i)
        idx = torch.tensor(src_idx, device=logits.device)
        logits = torch.cat([logits, logits.index_select(0, idx)])
        attn = {layer: torch.cat([a, a.index_select(0, idx.to(a.device))]) for layer, a in attn.items()}
        return out, logits, attn

    def _forward_and_verify(self, rows: list[_Row], compiled: CompiledTrees | None,
                            forks: list[ForkWork] = ()) -> list[RequestStepResult]:
        device = self.target.device
        b = len(rows)
        if compiled is not None and compiled.width == 1 and not forks and not any(r.is_prefill for r in rows):
            return self._forward_roots(rows, compiled)
        t = max(len(r.tokens) for r in rows)
        dec_idx = [i for i, r in enumerate(rows) if not r.is_prefill]
        pre_idx = [i for i, r in enumerate(rows) if r.is_prefill]
        # ids, positions, write columns, ancestors: prefill rows from host lists, tree rows from compiled tensors
        ids = torch.zeros((b, t), dtype=torch.long, device=device)
        pos = torch.zeros((b, t), dtype=torch.long, device=device)
        cols = torch.full((b, t), self.cache.scratch, dtype=torch.long, device=device)
        anc = torch.zeros((b, t, t), dtype=torch.bool, device=device)
        prefix = torch.tensor([r.prefix for r in rows], dtype=torch.long, device=device)
        sizes = torch.tensor([len(r.tokens) for r in rows], dtype=torch.long, device=device)
        arange_t = torch.arange(t, device=device)
        tree_anc = None
        sub = None
        if dec_idx:
            sub = self._subset(compiled, [rows[i].tree_index for i in dec_idx])
            tw = sub.width
            tree_anc = ancestor_matrix(sub.parents, sub.max_depth)
            d = torch.tensor(dec_idx, device=device)
            ids[d, :tw] = sub.tokens
            pos[d, :tw] = prefix[d, None] + sub.depths
            valid = arange_t[None, :tw] < sub.num_nodes[:, None]
            cols[d, :tw] = torch.where(valid, prefix[d, None] + arange_t[None, :tw],
                                       torch.full_like(sub.tokens, self.cache.scratch))
            anc[d, :tw, :tw] = tree_anc
        if pre_idx:
            p = torch.tensor(pre_idx, device=device)
            lens = sizes[p]
            valid = arange_t[None, :] < lens[:, None]
            ids[p] = torch.tensor([rows[i].tokens + [0] * (t - len(rows[i].tokens)) for i in pre_idx], device=device)
            pos[p] = prefix[p, None] + arange_t[None, :]  # a chunk continues after the chunks already cached
            cols[p] = torch.where(valid, pos[p], torch.full_like(pos[p], self.cache.scratch))
            anc[p] = torch.ones((t, t), dtype=torch.bool, device=device).tril_()
        key_len = max(r.prefix + len(r.tokens) for r in rows)
        mask = tree_mask(prefix, anc, sizes, key_len)
        r_max = max(1 if r.is_prefill else len(r.tokens) for r in rows)
        lidx = arange_t[None, :r_max].expand(b, r_max).clone() if r_max <= t else None
        if pre_idx:
            lidx[torch.tensor(pre_idx, device=device)] = 0
            lidx[torch.tensor(pre_idx, device=device), 0] = sizes[torch.tensor(pre_idx, device=device)] - 1
        embeds = None
        if any(r.is_prefill and r.state.prefix_embeds is not None for r in rows):
            embeds = self.target.embed(ids)
            for i, r in enumerate(rows):
                pe = r.state.prefix_embeds
                if r.is_prefill and pe is not None:
                    part = pe[r.prefix: r.prefix + len(r.tokens)]  # this chunk's slice of the prompt embeddings
                    if part.shape[0]:
                        embeds[i, : part.shape[0]] = part.to(device=embeds.device, dtype=embeds.dtype)
        want_attn = any(r.spec.visual_span for r in rows)
        batch = ForwardBatch(
            slots=torch.tensor([r.slot for r in rows], dtype=torch.long, device=device),
            input_ids=ids, position_ids=pos, write_index=cols, attn_mask=mask, logit_index=lidx,
            inputs_embeds=embeds, attention_layers=self.attention_layers if want_attn else (),
            slot_list=[r.slot for r in rows], max_position=max(r.prefix + len(r.tokens) for r in rows),
            row_invariant=True,  # the target's bits must not depend on the rows beside each token
            tree_rows=dec_idx if sub is not None and sub.width > 1 else None,  # one-node trees sit in place
            tree_width=sub.width if sub is not None else 0,
            row_lengths=[len(r.tokens) for r in rows],
            logit_index_host=None if lidx is None else [
                [len(r.tokens) - 1] + [0] * (r_max - 1) if r.is_prefill else list(range(r_max)) for r in rows],
        )
        logits, attn = self.target.forward_batch(self.cache, batch)  # [B, R, V] on the device
        self.target_forwards += 1
        self._forwards_this_step += 1
        if forks:  # after the forward: the source slots hold the prompt now
            extra, logits, attn = self._fork_rows(rows, forks, logits, attn or {})
            rows = rows + extra
        return self._verify_and_commit(rows, logits, attn, sub, tree_anc)

    def _forward_roots(self, rows: list[_Row], compiled: CompiledTrees) -> list[RequestStepResult]:
        """:meth:`_forward_and_verify` of decode rows whose trees are all roots alone (``compiled.width == 1``): one
        token per row, at its slot's next column, seeing its prefix and itself. The inputs are those the general
        path builds for such rows (ids, positions, write columns, mask, logit rows), from a fifth of its tensor
        operations (``tests/test_engine_hostwork.py``)."""
        device = self.target.device
        b = len(rows)
        sub = self._subset(compiled, [r.tree_index for r in rows])
        prefix = torch.tensor([r.prefix for r in rows], dtype=torch.long, device=device)[:, None]  # [B, 1]
        key_len = max(r.prefix for r in rows) + 1
        mask = torch.arange(key_len, device=device)[None, None, :] <= prefix[:, :, None]  # [B, 1, S]
        want_attn = any(r.spec.visual_span for r in rows)
        batch = ForwardBatch(
            slots=torch.tensor([r.slot for r in rows], dtype=torch.long, device=device),
            input_ids=sub.tokens, position_ids=prefix, write_index=prefix, attn_mask=mask,
            logit_index=torch.zeros((b, 1), dtype=torch.long, device=device), inputs_embeds=None,
            attention_layers=self.attention_layers if want_attn else (),
            slot_list=[r.slot for r in rows], max_position=key_len, row_invariant=True, tree_rows=None,
            tree_width=1, row_lengths=[1] * b, logit_index_host=[[0]] * b,
        )
        logits, attn = self.target.forward_batch(self.cache, batch)  # [B, 1, V]
        self.target_forwards += 1
        self._forwards_this_step += 1
        return self._verify_and_commit(rows, logits, attn, sub, torch.ones((b, 1, 1), dtype=torch.bool, device=device))

    @staticmethod
    def _subset(compiled: CompiledTrees, index: list[int]) -> CompiledTrees:
        if index == list(range(compiled.batch)):
            return compiled
        idx = torch.tensor(index, device=compiled.tokens.device)
        pick = lambda x: x.index_select(0, idx)  # noqa: E731
        return dataclasses.replace(
            compiled, tokens=pick(compiled.tokens), parents=pick(compiled.parents), depths=pick(compiled.depths),
            num_nodes=pick(compiled.num_nodes), draw_child=pick(compiled.draw_child),
            draw_kind=pick(compiled.draw_kind), draw_q=pick(compiled.draw_q),
            draw_uniform=pick(compiled.draw_uniform), host_sizes=[compiled.host_sizes[i] for i in index],
            host_draws=[compiled.host_draws[i] for i in index])

    # -- verification ---------------------------------------------------------------------------------------
    def _verify_and_commit(self, rows: list[_Row], logits: torch.Tensor, attn: dict, sub: CompiledTrees | None,
                           tree_anc: torch.Tensor | None) -> list[RequestStepResult]:
        device = logits.device
        b, r_max, v = logits.shape
        # [B, R] finite rows of the raw logits (before processors add their -inf); one reduction, padding ignored
        finite = torch.isfinite(logits.sum(-1))
        if r_max > 1:
            n_rows = torch.tensor([1 if r.is_prefill else len(r.tokens) for r in rows], device=device)
            finite |= torch.arange(r_max, device=device)[None, :] >= n_rows[:, None]
        if any(r.spec.logits_processors for r in rows):
            logits = self._process_logits(rows, logits)
        greedy = [r.spec.sampling.greedy for r in rows]
        dec_idx = [i for i, r in enumerate(rows) if not r.is_prefill]
        pre_idx = [i for i, r in enumerate(rows) if r.is_prefill]
        depth = sub.max_depth if sub is not None else 0
        argmax = logits.argmax(-1) if any(greedy) else None  # [B, R]
        if all(greedy) and (sub is None or sub.width == 1):
            # every row greedy and every tree its root alone (no drafts this step, or prefills): the token is the
            # argmax of logits row 0 and the path the root, as the general verification below gives them, in
            # a fraction of its small tensor operations (tests/test_engine_hostwork.py)
            return self._commit_roots(rows, logits, attn, finite, argmax)
        last = torch.zeros(b, dtype=torch.long, device=device)
        bonus = torch.zeros(b, dtype=torch.long, device=device)
        uniforms = self._uniforms(rows, sub)
        if dec_idx:
            w = sub.width
            pos_of = {i: k for k, i in enumerate(dec_idx)}
            for want_greedy in (True, False):
                part = [i for i in dec_idx if greedy[i] == want_greedy]
                if not part:
                    continue
                sel = self._subset(sub, [pos_of[i] for i in part])
                rows_sel = torch.tensor(part, device=device)
                anc_sel = tree_anc if len(part) == len(dec_idx) else tree_anc[
                    torch.tensor([pos_of[i] for i in part], device=device)]
                if want_greedy:
                    out = verify_greedy_batch(argmax[rows_sel, :w], sel, anc_sel)
                else:
                    probs = self._target_probs([rows[i] for i in part], logits[rows_sel, :w])
                    out = verify_stochastic_batch(probs, sel, uniforms[rows_sel])
                last[rows_sel] = out.last
                bonus[rows_sel] = out.bonus
        # prefill rows: the first token from the last prompt row (logits row 0)
        pg = [i for i in pre_idx if greedy[i]]
        ps = [i for i in pre_idx if not greedy[i]]
        if pg:
            gi = torch.tensor(pg, device=device)
            bonus[gi] = argmax[gi, 0]
        if ps:
            si = torch.tensor(ps, device=device)
            probs = self._target_probs([rows[i] for i in ps], logits[si, :1])
            bonus[si] = sample_inverse_cdf(probs[:, 0], uniforms[si, 0])
        # the committed path (root..last) and its finite check, per row
        width = depth + 1
        path = torch.zeros((b, width), dtype=torch.long, device=device)
        ok = finite[:, 0].clone()
        if dec_idx:
            d = torch.tensor(dec_idx, device=device)
            path[d] = path_from_last(last[d], tree_anc, sub.depths, depth)  # [Bd, D+1], -1 padded
            visited = torch.gather(tree_anc, 1, last[d][:, None, None].expand(-1, 1, tree_anc.shape[2]))[:, 0]
            ok[d] = ~(visited & ~finite[d, : sub.width]).any(-1)
        # a non-finite node off the committed path: its cache columns are zeroed after the commit
        stale_nan = ~finite.all(-1)
        want_lp = any(r.spec.logprobs for r in rows)
        payload = [ok.to(torch.float64)[:, None], stale_nan.double()[:, None], last.double()[:, None],
                   bonus.double()[:, None], path.double()]
        if want_lp:
            payload.append(self._committed_logprobs(rows, logits, path, last, bonus, sub, dec_idx).double())
        host = torch.cat(payload, 1).tolist()  # the one host copy of the verification
        visual = self._visual_attention(rows, attn)
        return self._commit(rows, host, width, want_lp, visual)

    def _commit_roots(self, rows: list[_Row], logits: torch.Tensor, attn: dict, finite: torch.Tensor,
                      argmax: torch.Tensor) -> list[RequestStepResult]:
        """:meth:`_verify_and_commit` of a step whose rows are all greedy and whose trees are all roots alone
        (``logits`` ``[B, R, V]`` processed, ``finite`` ``[B, R]``, ``argmax`` ``[B, R]``): each row commits the
        argmax of its logits row 0; the same host payload (one copy) and the same values as the general path."""
        b = logits.shape[0]
        ok = finite[:, 0]
        bonus = argmax[:, 0]
        zero = torch.zeros((b, 1), dtype=torch.float64, device=logits.device)
        payload = [ok.double()[:, None], (~finite.all(-1)).double()[:, None], zero, bonus.double()[:, None], zero]
        want_lp = any(r.spec.logprobs for r in rows)
        if want_lp:
            sel = logits[:, :1].float()  # [B, 1, V]: the committed token's row
            payload.append((sel.gather(2, bonus[:, None, None])[:, :, 0] - torch.logsumexp(sel, -1)).double())
        host = torch.cat(payload, 1).tolist()  # the one host copy of the verification
        return self._commit(rows, host, 1, want_lp, self._visual_attention(rows, attn))

    @staticmethod
    def _target_probs(rows: list[_Row], logits: torch.Tensor) -> torch.Tensor:
        """Target distributions ``[n, R, V]`` (float32) of ``logits`` ``[n, R, V]`` after each row's warpers,
        batched per distinct sampling parameters."""
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(rows):
            sp = r.spec.sampling
            groups.setdefault((sp.temperature, sp.top_k, sp.top_p), []).append(i)
        flat = lambda x: x.reshape(-1, x.shape[-1]).nan_to_num(neginf=-1e30, posinf=1e30)  # noqa: E731
        if len(groups) == 1:
            return target_probs(flat(logits), rows[0].spec.sampling, torch.float32).reshape(logits.shape)
        probs = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        for idx in groups.values():
            sel = torch.tensor(idx, device=logits.device)
            probs[sel] = target_probs(flat(logits[sel]), rows[idx[0]].spec.sampling, torch.float32).reshape(
                (len(idx),) + tuple(logits.shape[1:]))
        return probs

    def _uniforms(self, rows: list[_Row], sub: CompiledTrees | None) -> torch.Tensor:
        """Per row, uniforms from the request's own stream: one per draw of its tree, then the bonus's (a
        prefill: one). Greedy rows draw none. Shape ``[B, U]`` on the device."""
        draws = {}
        if sub is not None:
            k = 0
            for i, r in enumerate(rows):
                if not r.is_prefill:
                    draws[i] = sub.host_draws[k]
                    k += 1
        lists = []
        for i, r in enumerate(rows):
            if r.spec.sampling.greedy:
                lists.append([])
            else:
                n = 1 if r.is_prefill else draws[i] + 1
                lists.append([r.state.rng.random() for _ in range(n)])
        width = max(1, max(len(x) for x in lists))
        return torch.tensor([x + [0.0] * (width - len(x)) for x in lists], dtype=torch.float64,
                            device=self.target.device)

    def _committed_logprobs(self, rows, logits, path, last, bonus, sub, dec_idx) -> torch.Tensor:
        """Log-probability of every committed token at the row that verified it, ``[B, D+1]`` (device): the
        log-softmax of the processed logits (greedy rows) or the log of the warped target distribution (sampled
        rows).

        Committed token ``k`` is path node ``k+1``'s token for ``k < accepted``, the bonus at ``k = accepted``;
        it was predicted by path node ``k`` (a prefill: logits row 0)."""
        b, width = path.shape
        device = logits.device
        rows_idx = path.clamp(min=0)
        tok = torch.zeros((b, width), dtype=torch.long, device=device)
        depth_last = torch.zeros(b, dtype=torch.long, device=device)
        if dec_idx:
            d = torch.tensor(dec_idx, device=device)
            if width > 1:
                tok[d, :-1] = torch.gather(sub.tokens, 1, path[d, 1:].clamp(min=0))
            depth_last[d] = torch.gather(sub.depths, 1, last[d][:, None])[:, 0]
        ar = torch.arange(width, device=device)[None, :]
        tok = torch.where(ar == depth_last[:, None], bonus[:, None], tok)
        sel = torch.gather(logits, 1, rows_idx[:, :, None].expand(-1, -1, logits.shape[-1])).float()  # [B, D+1, V]
        lp = sel.gather(2, tok[:, :, None])[:, :, 0] - torch.logsumexp(sel, -1)
        sampled = [i for i, r in enumerate(rows) if not r.spec.sampling.greedy]
        if sampled:
            si = torch.tensor(sampled, device=device)
            probs = self._target_probs([rows[i] for i in sampled], sel[si])
            plp = torch.log(probs.gather(2, tok[si][:, :, None])[:, :, 0].double().clamp_min(1e-300)).float()
            lp[si] = plp
        return lp

    def _visual_attention(self, rows: list[_Row], attn: dict[int, torch.Tensor]) -> list[torch.Tensor | None]:
        """Per row with a visual span: the attention mass on its visual tokens for every query row,
        ``[T_b, n_visual]`` (mean over heads and :attr:`attention_layers`); None for other rows."""
        out: list[torch.Tensor | None] = [None] * len(rows)
        if not attn:
            return out
        have = [i for i, row in enumerate(rows) if row.spec.visual_span is not None]
        if not have:
            return out
        layers = [attn[layer] for layer in sorted(attn)]  # each [B, heads, T, S]
        spans = [rows[i].spec.visual_span for i in have]
        width = max(e - s for s, e in spans)
        dev = layers[0].device
        # every row's span gathered first (padded to the widest), then the means over layers and heads, then one
        # host copy for the whole step: the work is rows x span, not rows x context (the means of the whole
        # [B, T, S] before the gather cost 2.2 ms at 32 rows x 1100 keys, 0.56 ms this way; same values, bit
        # for bit: the means reduce the same elements in the same order)
        start = torch.tensor([s for s, _ in spans], device=dev)
        cols = (start[:, None] + torch.arange(width, device=dev)[None, :]).clamp(max=layers[0].shape[-1] - 1)
        hv = torch.tensor(have, device=dev)
        idx = cols[:, None, None, :].expand(-1, layers[0].shape[1], layers[0].shape[2], -1)  # [rows with a span, heads, T, W]
        block = torch.stack([a.index_select(0, hv).gather(3, idx) for a in layers]).mean(0).mean(1).float().cpu()
        for k, i in enumerate(have):
            s, e = spans[k]
            out[i] = block[k, : len(rows[i].tokens), : e - s]  # views of the one copy
        return out

    def _process_logits(self, rows: list[_Row], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[B, R, V]`` with every row's logits processors applied along its own token path: all rows
        of all requests gathered into one ``[M, V]`` block, processed by one call per processor class
        (:func:`~specstream.stages.speculative.logits.apply_logits_processors_rows`) and scattered back."""
        b_idx: list[int] = []
        r_idx: list[int] = []
        per_row: list = []
        seqs: list[list[int]] = []
        for i, r in enumerate(rows):
            procs = r.spec.logits_processors
            if procs:
                hist = self._histories(r)
                b_idx += [i] * len(hist)
                r_idx += range(len(hist))
                per_row += [procs] * len(hist)
                seqs += hist
        logits = logits.clone()  # an inference tensor cannot be edited in place
        bi = torch.tensor(b_idx, device=logits.device)
        ri = torch.tensor(r_idx, device=logits.device)
        logits[bi, ri] = apply_logits_processors_rows(per_row, seqs, logits[bi, ri]).to(logits.dtype)
        return logits

    def _histories(self, row: _Row) -> list[History]:
        """Per logits row, the tokens before the one it predicts: the prefilled tokens (prefill), or context +
        the draft tokens on the tree path root -> node (decode). Views (:class:`~.logits.History`), not copies:
        O(nodes x depth) per step whatever the context length."""
        st = row.state
        if row.tree is None:
            return [History(st.spec.prompt_ids, st.output, stop=row.prefix + len(row.tokens))]
        tree = row.tree
        paths: list[tuple[int, ...]] = [()]
        for i in range(1, len(tree)):  # parents precede children: each path is its parent's plus one token
            paths.append(paths[tree.parents[i]] + (tree.tokens[i],))
        return [History(st.spec.prompt_ids, st.output, p) for p in paths]

    # -- commit ---------------------------------------------------------------------------------------------
    def _commit(self, rows: list[_Row], host: list[list[float]], width: int, want_lp: bool,
                visual: list) -> list[RequestStepResult]:
        """Each row's result from the one host copy of the verification, then the step's KV moves.

        A loop over rows, and over each row's committed tokens, on purpose: a row is one request's result (its
        own finish rule, tree budget and drafter state), and it commits at most ``depth + 2`` tokens. What moves
        data is batched: one :meth:`~.kv_cache.KVCache.compact_batch` gather for the step's target rows and one
        per drafter (``end_step``). Measured (tiny models, tree "2,2,2,1", 32 rows, median of 15 steps): the
        whole method 1.0 ms at context 64 and 1.3 ms at 1024 of a 23 / 56 ms step; 0.5 / 0.7 ms of it is the
        batched KV gather and 0.3 ms the drafters' observe, leaving 0.2-0.3 ms (7-8 us per row, < 1 % of the
        step, independent of the context) for this loop: not worth moving to the device.
        """
        results = []
        compact_slots, compact_bases, compact_cols = [], [], []
        observes, nan_rows = [], []
        for i, row in enumerate(rows):
            h = host[i]
            req = row.spec
            ok, stale_nan, last, bonus = h[0] > 0.5, h[1] > 0.5, int(h[2]), int(h[3])
            path_nodes = [int(x) for x in h[4:4 + width] if x >= 0]
            if not ok:
                self.fail(req.request_id, row.slot)
                results.append(RequestStepResult(req.request_id, is_prefill=row.is_prefill, error={
                    "code": "numerical_error", "message": "the target produced NaN or infinite logits"}))
                continue
            if row.is_prefill and not row.work.final:  # a prefill chunk: cached, no token yet
                self.cache.lengths[row.slot] = row.prefix + len(row.tokens)
                results.append(RequestStepResult(req.request_id, is_prefill=True, prefill_done=False))
                continue
            if row.is_prefill:
                path_nodes = [0]
                accepted = []
            else:
                path_nodes = path_nodes[: row.tree.depths[last] + 1]
                accepted = [row.tree.tokens[n] for n in path_nodes[1:]]
            proposed = accepted + [bonus]
            limit = min(row.state.remaining, self.max_len - len(row.state.context))
            new, reason = [], None
            for tok in proposed:
                new.append(tok)
                if tok in req.eos_token_ids:
                    reason = "eos"
                    break
                if len(new) >= limit:
                    reason = "length"
                    break
            num_accepted = min(len(accepted), len(new))
            lps = tuple(h[4 + width: 4 + width + len(new)]) if want_lp and req.logprobs else ()
            vis: tuple = ()
            if visual[i] is not None:
                # the row that predicted committed token k: the prompt's last row (prefill) or path node k (tree)
                # (a chunked prompt's visual rows are those of its last chunk)
                src = [len(row.tokens) - 1] if row.is_prefill else path_nodes
                vis = tuple(visual[i][src[k]].numpy() for k in range(min(len(new), len(src))))
            if reason is not None:
                if row.is_prefill:  # the prompt's keys/values are in the slot: a later same-prefix prompt reuses them
                    self.cache.lengths[row.slot] = row.prefix + len(row.tokens)
                self.release(req.request_id, row.slot)  # finished (its cached prefix is remembered, not its state)
                results.append(RequestStepResult(req.request_id, tuple(new), num_accepted, row.is_prefill, reason,
                                                 None, 1, visual_attention=vis, logprobs=lps))
                continue
            row.state.commit(new)
            if row.is_prefill:
                self.cache.lengths[row.slot] = row.prefix + len(row.tokens)
            else:
                keep = 1 + num_accepted  # root + accepted draft tokens that were committed
                compact_slots.append(row.slot)
                compact_bases.append(row.prefix)
                compact_cols.append([row.prefix + n for n in path_nodes[:keep]])
                observes.append((row, accepted[:num_accepted], new))
                if stale_nan:
                    nan_rows.append((row.slot, row.prefix + keep, row.prefix + len(row.tokens)))
            requested = 1
            if req.speculate and self._speculates(req):
                budget = row.state.budget
                # what the draft levels did: the forced chain in front of them is left out (accepted nearly
                # always, at no draft cost); a step whose accepted path left the chain, or that had no levels
                # below it, says nothing
                chain = self._chains.get(req.request_id, ())
                f = len(chain)
                through = not f or (num_accepted >= f and list(accepted[:f]) == list(chain))
                if not row.is_prefill and through and row.tree.max_depth > f:
                    budget.observe(num_accepted - f, len(row.tree) - f, row.tree.max_depth - f)
                    if self.gate is not None:
                        self.gate.observe(num_accepted - f, row.tree.max_depth - f)
                requested = (budget.requested_nodes(self.cost_ratio or 0.0, self.depth_cost, self.node_cost)
                             if self.adaptive
                             else self.full_nodes)
                if self.visual_aware and vis:
                    # the node that predicted the last committed token is where the next tree starts: when the
                    # target looks hard at the image there, a text-only draft is weakest, so ask for a smaller tree
                    mass = float(vis[-1].sum())
                    if mass > self.visual_mass_threshold:
                        requested = max(2, int(round(requested * (1.0 - mass))))
            results.append(RequestStepResult(req.request_id, tuple(new), num_accepted, row.is_prefill, reason, None,
                                             requested, visual_attention=vis, logprobs=lps))
        if compact_slots:
            self.cache.compact_batch(compact_slots, compact_bases, compact_cols)
        for slot, start, end in nan_rows:
            self.cache.zero_columns(slot, start, end)
        for row, accepted, new in observes:
            for d in self.proposers:
                d.observe(row.state.drafters.setdefault(d.name, {}), row.slot, row.tree, accepted, new)
        for d in self.proposers:
            d.end_step()
        return results
