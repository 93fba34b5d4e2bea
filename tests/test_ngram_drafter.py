"""The incremental n-gram drafter proposes exactly what the old whole-context scan proposed (issue 20 item 7).

The reference below is the drafter's matching code as it was before the index (a backwards scan of the whole
context each step), copied unchanged. Hypothesis grows token sequences over small vocabularies (so n-grams
repeat) step by step with random commits, and restarts them (a new context list, or the same list cut and
rewritten) in the middle; every step the drafter's continuations and its proposed tree must equal the
reference's.
"""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from specstream.stages.speculative.drafters.base import DraftInput
from specstream.stages.speculative.drafters.ngram import NgramDrafter
from specstream.stages.speculative.tree import Proposal, ProposalKind, TokenTree
from specstream.types import SamplingParams


def old_continuations(self, context: list[int], depth: int) -> list[list[int]]:
    """The pre-index NgramDrafter.continuations, verbatim."""
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


def old_tree(self, context: list[int], depth_limit: int, node_budget: int) -> TokenTree:
    """The pre-index NgramDrafter.propose for one input, verbatim."""
    proposal = Proposal(ProposalKind.DETERMINISTIC, drafter=self.name)
    tree = TokenTree(context[-1])
    depth = min(depth_limit, self.max_depth)
    if depth > 0 and node_budget > 1:
        for cont in old_continuations(self, context, depth):
            tree.add_path(cont, proposal, max_nodes=node_budget)
    return tree


def _shape(tree: TokenTree):
    return tree.tokens, tree.parents, tree.depths, [(d.parent, d.child, d.proposal.kind) for d in tree.draws]


drafters = st.builds(lambda mx, mn, b, d: NgramDrafter(max_ngram=mx, min_ngram=min(mn, mx), max_branches=b,
                                                       max_depth=d),
                     st.integers(1, 4), st.integers(1, 3), st.integers(1, 4), st.integers(1, 6))


@st.composite
def runs(draw):
    vocab = draw(st.integers(1, 4))
    tok = st.integers(0, vocab - 1)
    prompt = draw(st.lists(tok, min_size=1, max_size=30))
    steps = draw(st.lists(st.tuples(st.lists(tok, min_size=0, max_size=6),  # the tokens committed
                                    st.integers(0, 7),                       # the step's max_depth
                                    st.integers(1, 12)),                     # its node budget
                          min_size=1, max_size=25))
    restart_at = draw(st.integers(0, len(steps)))
    restart_kind = draw(st.sampled_from(["new", "cut", "same"]))
    restart_ctx = draw(st.lists(tok, min_size=1, max_size=30))
    return prompt, steps, restart_at, restart_kind, restart_ctx


@settings(max_examples=400, deadline=None)
@given(drafters, runs())
def test_incremental_index_drafts_what_the_whole_context_scan_drafted(d, run):
    prompt, steps, restart_at, restart_kind, restart_ctx = run
    context = list(prompt)
    state: dict = {}
    for i, (commit, max_depth, budget) in enumerate(steps):
        if i == restart_at:
            if restart_kind == "new":  # a resume: a new context list (the executor's restart)
                context = list(restart_ctx)
            elif restart_kind == "cut":  # the same list, cut and rewritten in place
                del context[max(1, len(context) // 2):]
                context.extend(restart_ctx)
            else:  # the same list and length, its tokens before the indexed end rewritten
                context[:] = [(t + 1) % 5 for t in context]
        depth = min(max_depth, d.max_depth)
        if depth > 0:
            want = old_continuations(d, context, depth)
            assert d.continuations(context, depth, state) == want, (context, depth)
        inp = DraftInput("r", 0, context, budget, max_depth, SamplingParams(), state=state)
        tree = d.propose([inp])[0]
        assert _shape(tree) == _shape(old_tree(d, context, max_depth, budget))
        context.extend(commit)  # the step commits its tokens (in place, as RequestState.commit does)


def test_index_keeps_one_occurrence_per_continuation_and_reads_only_new_tokens():
    d = NgramDrafter(max_ngram=2, min_ngram=1, max_branches=3, max_depth=2)
    context = [1, 2, 3] * 40  # a loop: every "1 2" is followed by "3 1"
    state: dict = {}
    assert d.continuations(context, 2, state) == [[1, 2]]  # after the last "2 3": "1 2"
    assert state["len"] == 120
    assert state["index"][2][(1, 2)] == ((3, 1), 114)  # 40 occurrences, one kept: the latest complete one
    context += [9, 1, 2]  # only these are read: the latest "1 2" (at 117) is now followed by "3 9"
    assert d.continuations(context, 2, state) == [[3, 9], [3, 1]]
    assert state["len"] == 123 and state["index"][2][(1, 2)] == {(3, 1): 114, (3, 9): 117}
    other = [1, 2, 3] * 40  # the same tokens in a new list (a restart): indexed again, the same drafts
    assert d.continuations(other, 2, state) == [[1, 2]] and state["ctx"] is other and state["len"] == 120


def test_depth_beyond_max_depth_is_refused():
    import pytest

    with pytest.raises(ValueError):
        NgramDrafter(max_depth=3).continuations([1, 2, 1, 2], 4)
    with pytest.raises(ValueError):
        NgramDrafter(max_depth=0)
