"""Exact sampling, proven by enumeration: every draw sequence of the real drafting code, weighted exactly.

The target and the drafts are real Llama checkpoints (one layer, a 4-token vocabulary) whose next-token
distribution is the same in every context: ``p`` for the target, ``q`` for each draft (every token embeds to one
vector, attention and MLP write nothing, the output head reads ``log p``). So each draw is one uniform pushed
through the draft's inverse CDF, and the draws of one step can be enumerated exactly: the uniforms range over
the elementary intervals between the drafts' CDF breakpoints, each with probability its length.

For every draw sequence the test runs the engine's own drafting step — :class:`ModelDrafter` expansion with its
budget rule, the executor's merge of several drafters and truncation to the granted node budget — then compiles
the tree with :func:`compile_trees` (the verifier's draw tables) and computes, in float64, the exact
distribution of the first two emitted tokens under multi-step speculative sampling over those tables (SpecInfer
§4.3). Summed over draw sequences it must equal ``p x p`` to floating-point precision. The device kernel's
agreement with that reference, draw for draw, is checked on random trees and uniforms at the end.

On the parent of this module's commit (value-dependent budget cuts, merges regrouped by value) the same
enumeration gives errors of 0.04-0.1.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict

import numpy as np
import pytest
import torch

from specstream.types import SamplingParams
from specstream.kernels.verification import path_from_last, verify_stochastic_batch
from specstream.schedulers.plan import DecodeWork, RequestSpec
from specstream.stages.speculative.drafters.model import ModelDrafter, TreeSpec
from specstream.stages.speculative.drafters.ngram import NgramDrafter
from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
from specstream.stages.speculative.models.loader import load_decoder
from specstream.stages.speculative.models.tiny import TinyDecoderSpec, random_decoder_state, save_checkpoint
from specstream.stages.speculative.tree import ProposalKind, TokenTree, ancestor_matrix, compile_trees

V = 4
P = [0.1, 0.3, 0.35, 0.25]
Q_A = [0.5, 0.2, 0.1, 0.2]
Q_B = [0.2, 0.3, 0.3, 0.2]  # CDF breakpoints .2 .5 .8 shared in part with Q_A's .5 .7 .8
PROMPT = [1, 2, 3, 1, 2]


def constant_lm(path, probs) -> str:
    """A real checkpoint whose next-token distribution is ``probs`` in every context."""
    spec = TinyDecoderSpec(vocab_size=V, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    state = random_decoder_state(spec, seed=0)
    state["model.embed_tokens.weight"][:] = 1.0
    for key in state:
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            state[key][:] = 0.0
    state["model.norm.weight"][:] = 1.0
    state["lm_head.weight"][:] = (np.log(np.asarray(probs, np.float64)) / spec.hidden_size)[:, None]
    return str(save_checkpoint(path, spec.config_dict(), state))


@pytest.fixture(scope="module")
def lms(tmp_path_factory):
    root = tmp_path_factory.mktemp("constant")
    return {name: constant_lm(root / name, probs) for name, probs in (("p", P), ("a", Q_A), ("b", Q_B))}


class ScriptedUniforms(random.Random):
    """Answers ``random()`` with chosen uniforms; past the script it answers ``default`` and counts."""

    def __init__(self, script: list[float], default: float):
        super().__init__(0)
        self.script, self.default, self.calls = list(script), default, 0

    def random(self):
        self.calls += 1
        return self.script[self.calls - 1] if self.calls <= len(self.script) else self.default


def intervals(*qs) -> list[tuple[float, float]]:
    """(midpoint, length) of the elementary intervals of [0, 1) between all CDF breakpoints of ``qs``."""
    cuts = sorted({0.0, 1.0, *(float(c) for q in qs for c in np.cumsum(q)[:-1])})
    return [((a + b) / 2, b - a) for a, b in zip(cuts, cuts[1:]) if b - a > 1e-12]


def build_engine(lms, drafts: list[tuple[str, str]], ngram: bool = False, dtype: str = "float32"
                 ) -> SpeculativeEngine:
    target = load_decoder(lms["p"], dtype)
    drafters = [ModelDrafter(load_decoder(lms[model], dtype), 1, 32, TreeSpec.parse(tree), V, V, name=f"draft-{i}")
                for i, (model, tree) in enumerate(drafts)]
    if ngram:
        drafters.append(NgramDrafter(max_ngram=2, max_branches=1, max_depth=2))
    return SpeculativeEngine(target, drafters, EngineConfig(num_slots=1, max_len=32, adaptive=False))


def draft_once(engine, script, default, budget, depth, processors=lambda: ()) -> tuple[TokenTree, int]:
    """The engine's drafting step for one sampled request, its uniforms scripted; returns the (merged,
    truncated) tree and how many uniforms the drafters asked for. ``processors()``: the request's logits
    processors (a fresh grammar constraint per run)."""
    ex = engine.executor
    req = engine.make_request(PROMPT, 8, SamplingParams("sample", seed=0), request_id="r",
                              logits_processors=tuple(processors()))
    st = ex.admit(RequestSpec.of(req))
    st.rng = ScriptedUniforms(script, default)
    for d in ex.drafters:
        d.release(0)
    (tree,), _, _ = ex._draft((DecodeWork.of(req, 0, budget, depth),))
    ex.drop("r")
    return tree, st.rng.calls


def exact_mss(tree: TokenTree, p: np.ndarray, m: int = 2) -> dict[tuple[int, ...], float]:
    """The distribution of the first ``m`` emitted tokens (float64) of multi-step speculative sampling over the
    compiled tree's draw tables; after the bonus token the target continues alone (:func:`exact_mss_paths` with the
    same target distribution at every node)."""
    return exact_mss_paths(tree, lambda path: p, m)


def enumerate_step(engine, qs, budget, depth, processors=lambda: ()):
    """Every draw sequence of one drafting step: yields (tree, probability)."""
    cells = intervals(*qs)

    def runs(prefix):
        script = [cells[i][0] for i in prefix]
        tree, calls = draft_once(engine, script, cells[0][0], budget, depth, processors)
        if calls <= len(prefix):
            yield tree, float(np.prod([cells[i][1] for i in prefix]))
        else:
            for i in range(len(cells)):
                yield from runs(prefix + [i])

    yield from runs([])


def target_p(engine) -> np.ndarray:
    return model_p(engine.target)


def model_p(model) -> np.ndarray:
    """The next-token distribution (float64) of a constant LM after :data:`PROMPT`, from its own logits."""
    from specstream.stages.speculative.models.llama import ForwardBatch

    cache = model.new_cache(1, 16)
    n = len(PROMPT)
    batch = ForwardBatch(torch.tensor([0]), torch.tensor([PROMPT]), torch.arange(n)[None], torch.arange(n)[None],
                         torch.ones(1, n, n, dtype=torch.bool).tril())
    logits, _ = model.forward_batch(cache, batch)
    return torch.softmax(logits[0, -1].double(), -1).numpy()


CASES = {
    # name: (drafts [(model, widths)], ngram, node budget, depth, drafts' q)
    "width1": ([("a", "1,1")], False, 3, 2, [Q_A]),
    "width2-cut": ([("a", "2,2")], False, 4, 2, [Q_A]),
    "width3-cut": ([("a", "3")], False, 3, 1, [Q_A]),
    "width3-budget2": ([("a", "3")], False, 2, 1, [Q_A]),
    "width4": ([("a", "4")], False, 5, 1, [Q_A]),
    "width4-cut": ([("a", "4")], False, 3, 1, [Q_A]),
    "width3-level2-cut": ([("a", "3,2")], False, 5, 2, [Q_A]),
    "merge-sampled": ([("a", "1"), ("b", "2")], False, 4, 1, [Q_A, Q_B]),
    "merge-sampled-cut": ([("a", "2"), ("b", "2")], False, 4, 1, [Q_A, Q_B]),
    "merge-sampled-ngram": ([("a", "2"), ("b", "1")], True, 4, 2, [Q_A, Q_B]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_enumerated_first_tokens_equal_the_target(lms, name):
    drafts, ngram, budget, depth, qs = CASES[name]
    engine = build_engine(lms, drafts, ngram)
    p = target_p(engine)
    assert np.allclose(p, P, atol=1e-5)
    total = defaultdict(float)
    mass, sizes = 0.0, set()
    for tree, prob in enumerate_step(engine, qs, budget, depth):
        assert len(tree) <= budget
        sizes.add(len(tree))
        mass += prob
        for seq, pr in exact_mss(tree, p).items():
            total[seq] += prob * pr
    assert mass == pytest.approx(1.0, abs=1e-12)
    want = {s: p[s[0]] * p[s[1]] for s in itertools.product(range(V), repeat=2)}
    err = max(abs(total.get(s, 0.0) - w) for s, w in want.items())
    assert err < 2e-6, f"{name}: max error {err:.2e} over the first two tokens"
    assert len(sizes) > 1 or name in ("width1", "width3-budget2")  # duplicates happened: trees of several sizes


def test_the_enumeration_detects_value_dependent_cuts_and_regrouping(lms):
    """Power: the same enumeration on trees built with the two rules that broke exactness (a cut that keeps a
    later draw only when it duplicates a kept child; draws regrouped by value) shows errors far above rounding."""
    p = np.asarray(P)
    q = np.asarray(Q_A)
    cells = intervals(Q_A)
    cdf = np.cumsum(q)

    def token(u):
        return int(np.searchsorted(cdf, u, side="right"))

    errs = {}
    for rule in ("cut-by-value", "regroup"):
        total = defaultdict(float)
        for seq in itertools.product(range(len(cells)), repeat=3):
            draws = [token(cells[i][0]) for i in seq]
            prob = float(np.prod([cells[i][1] for i in seq]))
            tree = TokenTree(0)
            from specstream.stages.speculative.tree import Proposal

            prop = Proposal(ProposalKind.SAMPLED, "a", torch.tensor(q))
            if rule == "cut-by-value":  # budget 2 nodes: later draws survive only as duplicates
                for x in draws:
                    if len(tree) < 2 or tree.child(0, x) is not None:
                        tree.add(0, x, prop)
            else:  # [a, b, a] tested as [a, a, b]
                for x in sorted(draws, key=draws.index):
                    tree.add(0, x, prop)
            for s, pr in exact_mss(tree, p).items():
                total[s] += prob * pr
        want = {s: p[s[0]] * p[s[1]] for s in itertools.product(range(V), repeat=2)}
        errs[rule] = max(abs(total.get(s, 0.0) - w) for s, w in want.items())
    assert errs["cut-by-value"] > 0.02 and errs["regroup"] > 0.01, errs


def test_device_kernel_matches_the_reference_draw_for_draw():
    """The batched device kernel takes the same decisions as the float64 reference walk for random trees,
    distributions and uniforms (both read the same compiled draw tables)."""
    rng = np.random.default_rng(7)
    trees, uniforms, probs = [], [], []
    for _ in range(300):
        t = TokenTree(0)
        q = torch.tensor(rng.dirichlet(np.ones(V)), dtype=torch.float32)
        from specstream.stages.speculative.tree import Proposal

        for _ in range(rng.integers(1, 7)):
            parent = int(rng.integers(0, len(t)))
            kind = ProposalKind.SAMPLED if rng.random() < 0.7 else ProposalKind.DETERMINISTIC
            x = int(torch.multinomial(q, 1)) if kind is ProposalKind.SAMPLED else int(rng.integers(0, V))
            t.add(parent, x, Proposal(kind, "d", q if kind is ProposalKind.SAMPLED else None))
        trees.append(t)
        uniforms.append(rng.random(len(t.draws) + 1).tolist())
        probs.append(torch.tensor(rng.dirichlet(np.ones(V), size=len(t)), dtype=torch.float32))
    ct = compile_trees(trees, "cpu", vocab_size=V)
    width = max(len(u) for u in uniforms)
    u = torch.tensor([x + [0.0] * (width - len(x)) for x in uniforms], dtype=torch.float64)
    pp = torch.zeros(len(trees), ct.width, V)
    for i, pr in enumerate(probs):
        pp[i, : pr.shape[0]] = pr
    out = verify_stochastic_batch(pp, ct, u)
    anc = ancestor_matrix(ct.parents, ct.max_depth)
    paths = path_from_last(out.last, anc, ct.depths, ct.max_depth).tolist()
    for i, t in enumerate(trees):
        want = reference_walk(t, probs[i].double().numpy(), uniforms[i])
        got = ([n for n in paths[i] if n >= 0], int(out.bonus[i]))
        assert got == want, i


def reference_walk(tree: TokenTree, p: np.ndarray, u: list[float]) -> tuple[list[int], int]:
    """Sequential MSS with given uniforms (one per draw by log index, the bonus's last), float64."""
    index = {id(d): j for j, d in enumerate(tree.draws)}
    node, path = 0, [0]
    while True:
        r = p[node].copy()
        accepted = None
        for d in tree.draws_at(node):
            x = tree.tokens[d.child]
            uu = u[index[id(d)]]
            if d.proposal.kind is ProposalKind.SAMPLED:
                q = d.proposal.q.double().numpy()
                if q[x] > 0 and uu < min(1.0, r[x] / q[x]):
                    accepted = d.child
                    break
                res = np.maximum(r - q, 0.0)
            else:
                if uu < r[x]:
                    accepted = d.child
                    break
                res = r.copy()
                res[x] = 0.0
            r = res / res.sum() if res.sum() > 0 else p[node].copy()
        if accepted is None:
            cdf = np.cumsum(r)
            bonus = min(int(np.searchsorted(cdf, u[-1] * cdf[-1], side="right")), len(r) - 1)
            return path, bonus
        path.append(accepted)
        node = accepted


# -- with a grammar (issue 21): the target's distribution at each node is p masked by the grammar state after
# the node's path, renormalised; the drafts' q are masked too. Exactness means the first two tokens follow the
# constrained target: P(x) P(y | x), each masked after its own history.

GRAMMARS = {
    # no token forced at the start; what may follow depends on the path ("b" forces "b")
    "paths": 'root ::= ("a" [bcd] | "b" "b" | "c" [ab]) [abcd]*',
    # "a" is forced first: the grammar drafter proposes it, merged with the model draft's sampled draws
    "forced": 'root ::= "a" ([bc] "d" | "d" [abcd]) [abcd]*',
}


def masked(q, allowed: str) -> list[float]:
    """``q`` restricted to the tokens named in ``allowed`` (letters of "abcd"), renormalised."""
    q = np.asarray(q, np.float64) * np.isin(np.arange(V), ["abcd".index(c) for c in allowed])
    return (q / q.sum()).tolist()


GRAMMAR_CASES = {
    # name: (grammar, drafts, node budget, depth, the masked q the drafts sample from)
    "paths-chain": ("paths", [("a", "1,1")], 3, 2,
                    [masked(Q_A, s) for s in ("abc", "bcd", "b", "ab")]),
    "paths-width2": ("paths", [("a", "2,1")], 4, 2,
                     [masked(Q_A, s) for s in ("abc", "bcd", "b", "ab")]),
    "paths-merge-sampled": ("paths", [("a", "1"), ("b", "2")], 4, 1, [masked(Q_A, "abc"), masked(Q_B, "abc")]),
    # the forced "a" goes in front of the model draft's levels (budget and depth grow by it), which then draw
    # after "a" (q masked to "bcd") and after "ab" / "ac" (only "d") or "ad" (any token)
    "forced-merged": ("forced", [("a", "1,1")], 3, 2, [masked(Q_A, "bcd"), masked(Q_A, "d"), Q_A]),
}


def grammar_of(name):
    from specstream.stages.speculative.grammar import Grammar, raw_vocab_info

    return Grammar.from_ebnf(GRAMMARS[name], raw_vocab_info(["a", "b", "c", "d"]))


def constrained_p_of(grammar, p):
    """``path -> p`` masked after ``path`` (the output so far) and renormalised, float64."""
    import xgrammar as xgr

    def p_of(path):
        m = xgr.GrammarMatcher(grammar.compiled)
        for t in path:
            assert m.accept_token(t)
        bm = xgr.allocate_token_bitmask(1, V)
        m.fill_next_token_bitmask(bm, 0)
        allowed = ((int(bm[0, 0]) >> np.arange(V)) & 1).astype(bool)
        out = np.where(allowed, p, 0.0)
        return out / out.sum()

    return p_of


def exact_mss_paths(tree: TokenTree, p_of, m: int = 2) -> dict[tuple[int, ...], float]:
    """The distribution of the first ``m`` emitted tokens (float64) of multi-step speculative sampling over the
    compiled tree's draw tables, with a target distribution per node, ``p_of(path tokens)`` (a grammar masks it
    after each path); after the bonus token the target continues alone."""
    ct = compile_trees([tree], "cpu", vocab_size=V)
    tokens = ct.tokens[0].tolist()
    child, kind, qi = ct.draw_child[0].tolist(), ct.draw_kind[0].tolist(), ct.draw_q[0].tolist()
    q_rows = ct.q.double().numpy() if ct.q is not None else None

    def alone(path, n):
        if n == 0:
            return {(): 1.0}
        p = p_of(path)
        return {(y,) + s: p[y] * pr for y in range(V) if p[y] > 0 for s, pr in alone(path + [y], n - 1).items()}

    def at(node, path, n):
        if n == 0:
            return {(): 1.0}
        p = p_of(path)
        out = defaultdict(float)
        r, reach = p.copy(), 1.0
        for k in range(len(child[node])):
            c = child[node][k]
            if c < 0:
                break
            x = tokens[c]
            if kind[node][k] == ProposalKind.SAMPLED:
                q = q_rows[qi[node][k]]
                a = min(1.0, r[x] / q[x]) if q[x] > 0 else 0.0
                res = np.maximum(r - q, 0.0)
            else:
                a = r[x]
                res = r.copy()
                res[x] = 0.0
            if a > 0:
                for seq, pr in at(c, path + [x], n - 1).items():
                    out[(x,) + seq] += reach * a * pr
            reach *= 1.0 - a
            r = res / res.sum() if res.sum() > 0 else p.copy()
        for y in range(V):
            if r[y] > 0:
                for seq, pr in alone(path + [y], n - 1).items():
                    out[(y,) + seq] += reach * r[y] * pr
        return out

    return dict(at(0, [], m))


@pytest.mark.parametrize("name", sorted(GRAMMAR_CASES))
def test_enumerated_first_tokens_follow_the_constrained_target(lms, name):
    gname, drafts, budget, depth, qs = GRAMMAR_CASES[name]
    grammar = grammar_of(gname)
    engine = build_engine(lms, drafts)
    p = target_p(engine)
    p_of = constrained_p_of(grammar, p)
    total = defaultdict(float)
    mass, forced = 0.0, 0
    for tree, prob in enumerate_step(engine, qs, budget, depth, lambda: [grammar.constraint(len(PROMPT))]):
        n_forced = len({d.child for d in tree.draws if d.proposal.drafter == "grammar"})
        assert len(tree) <= budget + n_forced
        mass += prob
        for node in range(1, len(tree)):  # drafts are masked: every node is allowed after its parent's path
            assert p_of(tree.path_tokens(tree.parents[node]))[tree.tokens[node]] > 0, tree.path_tokens(node)
        forced += any(d.proposal.drafter == "grammar" for d in tree.draws)
        for seq, pr in exact_mss_paths(tree, p_of).items():
            total[seq] += prob * pr
    assert mass == pytest.approx(1.0, abs=1e-12)
    want = {}
    for x in range(V):
        for y in range(V):
            want[(x, y)] = p_of([])[x] * (p_of([x])[y] if p_of([])[x] > 0 else 0.0)
    err = max(abs(total.get(s, 0.0) - w) for s, w in want.items())
    assert err < 2e-6, f"{name}: max error {err:.2e} over the first two tokens"
    assert sum(want.values()) == pytest.approx(1.0)
    assert (forced > 0) == (gname == "forced")  # the grammar drafter's forced "a" was merged in


BF16_CASES = ["width2-cut", "width3-level2-cut", "merge-sampled-ngram"]


@pytest.mark.parametrize("name", BF16_CASES)
def test_enumerated_first_tokens_equal_the_target_at_bf16_logits(lms, name):
    """The same enumeration with the models at bfloat16 (bf16 activations and logits rounded to bf16 before the
    float32 cast): sampling follows the distribution of the model as it runs, whatever its precision. The
    draws' intervals come from the drafts' own bf16 distributions."""
    drafts, ngram, budget, depth, _ = CASES[name]
    engine = build_engine(lms, drafts, ngram, dtype="bfloat16")
    assert engine.target.dtype == torch.bfloat16
    p = target_p(engine)
    assert np.allclose(p, P, atol=2e-2) and not np.allclose(p, P, atol=1e-7)  # really another distribution
    qs = [model_p(d.model) for d in engine.executor.drafters if isinstance(d, ModelDrafter)]
    total = defaultdict(float)
    mass = 0.0
    for tree, prob in enumerate_step(engine, qs, budget, depth):
        mass += prob
        for seq, pr in exact_mss(tree, p).items():
            total[seq] += prob * pr
    assert mass == pytest.approx(1.0, abs=1e-12)
    want = {s: p[s[0]] * p[s[1]] for s in itertools.product(range(V), repeat=2)}
    err = max(abs(total.get(s, 0.0) - w) for s, w in want.items())
    assert err < 2e-6, f"{name} at bf16: max error {err:.2e} over the first two tokens"
