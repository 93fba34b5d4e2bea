"""N-gram drafter (prompt lookup decoding, Saxena 2023): continue the context the way it continued before.

No model: the last ``n`` tokens of the context (``n`` from ``max_ngram`` down to ``min_ngram``) are looked up in
the earlier context; the tokens that followed each match, most recent match first, become branches of the
tree. Proposals are deterministic (point masses for the stochastic verifier).

The lookup is incremental, after the idea of llama.cpp's n-gram cache (``common/ngram-cache``: an n-gram ->
following tokens table updated with the tokens each step adds): each request's drafter state keeps, per
n-gram, its earlier occurrences, indexed once per token as the context grows, so a step's host work depends on
the tokens committed since the last step and on the matches, not on the context length. The drafts are the
same as a backwards scan of the whole context each step (what the drafter did before the index;
``tests/test_ngram_drafter.py`` keeps that scan as its reference).
"""

from __future__ import annotations

from specstream.stages.speculative.drafters.base import DraftInput, Drafter
from specstream.stages.speculative.tree import Proposal, ProposalKind, TokenTree

#: tokens before the indexed length compared each step to detect a context that was replaced (a restart)
_TAIL = 8


class NgramDrafter(Drafter):
    """Prompt-lookup drafter.

    Args:
        max_ngram, min_ngram: lengths of the suffix looked up, longest first.
        max_branches: most distinct continuations (tree branches) per step.
        max_depth: longest continuation.

    Per-request state (``DraftInput.state``, dropped with the request): ``ctx`` (the context list indexed),
    ``len`` (how many of its tokens are indexed), ``tail`` (its last tokens then, to detect a replaced or
    rewritten context, which is indexed again from scratch), ``index`` (per ``n``: n-gram tuple -> {the
    ``max_depth`` tokens after an occurrence: the position of the latest occurrence followed by them}, in
    increasing position order; a ``(continuation, position)`` pair while there is only one). Only occurrences whose ``max_depth`` followers are all in the context are in
    the index; the newer ones (fewer than ``max_depth`` positions) are compared directly each step. Keeping
    only the latest occurrence per continuation loses nothing: an older one would give a draft already taken.
    """

    name = "ngram"
    reads_forced = True  # the forced chain first; the lookup continues after it

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_branches: int = 3, max_depth: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if max_depth < 1:
            raise ValueError("need max_depth >= 1")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_branches, self.max_depth = max_branches, max_depth
        self._proposal = Proposal(ProposalKind.DETERMINISTIC, drafter=self.name)

    # -- the index ---------------------------------------------------------------------------------------------
    def _index(self, state: dict, context: list[int]) -> dict[int, dict]:
        """Bring ``state``'s index up to ``context`` (O(new tokens); O(context) when it was replaced)."""
        done = state.get("len", 0)
        n_ctx = len(context)
        if (state.get("ctx") is not context or n_ctx < done
                or state["tail"] != tuple(context[max(0, done - _TAIL):done])):
            state.clear()  # a new list (a restart), or one cut or rewritten: index it again
            done = 0
            state["index"] = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        index = state["index"]
        big_d = self.max_depth
        # continuation starts c whose max_depth followers became complete: c + D <= n_ctx, not before
        for c in range(max(0, done - big_d + 1), n_ctx - big_d + 1):
            full = tuple(context[c:c + big_d])
            for n, table in index.items():
                p = c - n
                if p < 0:
                    continue
                key = tuple(context[p:c])
                reps = table.get(key)
                if reps is None or (type(reps) is tuple and reps[0] == full):
                    table[key] = (full, p)  # one continuation so far: a pair, not a dict (most n-grams)
                elif type(reps) is tuple:
                    table[key] = {reps[0]: reps[1], full: p}
                else:
                    reps.pop(full, None)  # re-inserted last: the dict stays in increasing position order
                    reps[full] = p
        state["ctx"], state["len"] = context, n_ctx
        state["tail"] = tuple(context[max(0, n_ctx - _TAIL):n_ctx])
        return index

    def continuations(self, context: list[int], depth: int, state: dict | None = None,
                      tail: tuple[int, ...] | list[int] = ()) -> list[list[int]]:
        """Distinct continuations (longest-ngram matches first, most recent first), each up to ``depth`` long
        (``depth <= max_depth``), as a backwards scan of the whole context would find them. ``state``: the request's drafter
        state (None: a throwaway one, O(context)). ``tail``: tokens that follow ``context`` this step only (the
        grammar's forced chain): the lookup continues ``context + tail``, and only ``context`` is indexed."""
        if depth > self.max_depth:
            raise ValueError(f"depth {depth} > max_depth {self.max_depth}")
        index = self._index({} if state is None else state, context)
        out: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        n_ctx, big_d = len(context), self.max_depth
        full_ctx = context + list(tail) if tail else context
        n_all = len(full_ctx)
        for n in range(min(self.max_ngram, n_all - 1), self.min_ngram - 1, -1):
            suffix = full_ctx[n_all - n:]
            # the newest occurrences (their followers run into the indexed context's end, or into the tail):
            # compared directly
            for start in range(n_all - n - 1, max(n_ctx - n - big_d, -1), -1):
                if full_ctx[start:start + n] != suffix:
                    continue
                cont = full_ctx[start + n:start + n + depth]
                key = tuple(cont)
                if key not in seen:  # never empty: start + n < n_ctx
                    seen.add(key)
                    out.append(cont)
                    if len(out) >= self.max_branches:
                        return out
            # the indexed ones, latest first, one per distinct max_depth continuation
            reps = index[n].get(tuple(suffix))
            if reps is None:
                continue
            for full in ((reps[0],) if type(reps) is tuple else reversed(reps)):
                key = full[:depth]
                if key not in seen:
                    seen.add(key)
                    out.append(list(key))
                    if len(out) >= self.max_branches:
                        return out
        return out

    def propose(self, inputs: list[DraftInput]) -> list[TokenTree]:
        """Per input: the grammar's forced chain (:attr:`DraftInput.forced`) below the root, then the
        continuations of ``context + forced`` below its end. Under a grammar each continuation is cut before its
        first token the grammar forbids (``constraint.allowed_prefix``): the target, masked by the same grammar,
        could never accept it, so it would only cost verify rows."""
        trees = []
        for inp in inputs:
            tree = TokenTree(inp.context[-1])
            forced = list(inp.forced)
            end = (tree.add_path(forced, self._proposal) or [0])[-1]
            depth = min(inp.max_depth - len(forced), self.max_depth)
            if depth > 0 and inp.node_budget > len(tree):
                for cont in self.continuations(inp.context, depth, inp.state, tail=forced):
                    if inp.constraint is not None:
                        cont = cont[:max(0, inp.constraint.allowed_prefix(inp.context, forced + cont) - len(forced))]
                    tree.add_path(cont, self._proposal, parent=end, max_nodes=inp.node_budget)
            trees.append(tree)
        return trees
