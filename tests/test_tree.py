"""Token trees: hand-worked masks and depths, the draw log, trie merge in draw order, budgets, batch compilation."""

import torch

from specstream.stages.speculative.tree import (
    Proposal,
    ProposalKind,
    QRef,
    TokenTree,
    ancestor_matrix,
    chain_tree,
    compile_trees,
)

Q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]])


def sampled(row=0, name="a"):
    return Proposal(ProposalKind.SAMPLED, name, QRef(Q, row))


def small_tree() -> TokenTree:
    #        0(10)
    #       /     \
    #    1(11)    2(12)
    #      |      /   \
    #    3(13) 4(14)  5(15)
    t = TokenTree(10)
    t.add(0, 11)
    t.add(0, 12)
    t.add(1, 13)
    t.add(2, 14)
    t.add(2, 15)
    return t


def test_ancestor_mask_and_depths_by_hand():
    ct = small_tree().compile()
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(ct.ancestor_mask, expected)
    assert ct.depths.tolist() == [0, 1, 1, 2, 2, 2]
    assert ct.parents.tolist() == [-1, 0, 0, 1, 2, 2]
    assert ct.tokens.tolist() == [10, 11, 12, 13, 14, 15]
    assert small_tree().children(2) == [4, 5]


def test_adding_an_existing_child_logs_another_draw_in_order():
    t = TokenTree(1)
    a = t.add(0, 7, sampled())
    b = t.add(0, 8, sampled())
    c = t.add(0, 7, sampled())
    assert (a, b, c) == (1, 2, 1) and len(t) == 3
    # the draw log keeps [7, 8, 7]: the verifier tests them in this order
    assert [(d.parent, t.tokens[d.child]) for d in t.draws] == [(0, 7), (0, 8), (0, 7)]
    assert [d.child for d in t.draws_at(0)] == [1, 2, 1]


def test_merge_is_a_trie_union_keeping_each_drafters_draw_order():
    a = TokenTree(10)
    a.add(0, 11, sampled(0, "a"))
    a.add(0, 12, sampled(0, "a"))
    a.add(0, 11, sampled(0, "a"))  # [11, 12, 11] drawn in this order
    b = TokenTree(10)
    b.add_path([12, 14], Proposal(ProposalKind.DETERMINISTIC, "b"))
    b.add_path([13], Proposal(ProposalKind.DETERMINISTIC, "b"))
    m = TokenTree.merge([a, b])
    at_root = [(m.tokens[d.child], d.proposal.drafter) for d in m.draws_at(0)]
    assert at_root == [(11, "a"), (12, "a"), (11, "a"), (12, "b"), (13, "b")]  # never regrouped by value
    assert len(m) == 5  # root, 11, 12, 13, 14: the shared 12 appears once
    assert m.path_tokens(m.walk([12, 14])[-1]) == [12, 14]


def test_merge_budget_charges_sampled_draws_even_when_they_duplicate():
    a = TokenTree(0)
    for tok in (1, 1, 2):
        a.add(0, tok, sampled())
    b = chain_tree([0, 1, 5])
    # budget 4 nodes = 3 units: a's three sampled draws spend all of it (the duplicate 1 too), so b's
    # deterministic 1 (already a child: free) is kept and its new child 5 is dropped
    m = TokenTree.merge([a, b], max_nodes=4)
    assert [m.tokens[d.child] for d in m.draws] == [1, 1, 2, 1]
    assert len(m) == 3
    # a budget that cuts inside the sampled draws keeps the first ones by position, whatever their values
    for toks in ((1, 1, 2), (2, 1, 1), (3, 2, 1)):
        a = TokenTree(0)
        for tok in toks:
            a.add(0, tok, sampled())
        cut = TokenTree.merge([a, chain_tree([0, 9])], max_nodes=3)
        assert [cut.tokens[d.child] for d in cut.draws if d.proposal.kind is ProposalKind.SAMPLED] == list(toks[:2])


def test_deterministic_budget_by_nodes_breadth_first():
    a = chain_tree([0, 1, 2, 3, 4])
    b = chain_tree([0, 5, 6, 7, 8])
    m = TokenTree.merge([a, b], max_nodes=5)
    assert len(m) == 5
    assert sorted(m.depths) == [0, 1, 1, 2, 2]


def test_truncated_keeps_parents_order_and_depth():
    t = small_tree().truncated(max_nodes=10, max_depth=1)
    assert t.tokens == [10, 11, 12]
    t = small_tree().truncated(max_nodes=4)
    assert t.tokens == [10, 11, 12, 13]


def test_compile_trees_pads_a_batch_and_tables_the_draws():
    a = TokenTree(10)
    a.add(0, 11, sampled(1))
    a.add(0, 12, sampled(1))
    a.add(0, 11, sampled(1))
    a.add(1, 13)
    b = chain_tree([20, 21])
    ct = compile_trees([a, b], "cpu", vocab_size=6)
    assert ct.tokens.tolist() == [[10, 11, 12, 13], [20, 21, 0, 0]]
    assert ct.parents.tolist() == [[-1, 0, 0, 1], [-1, 0, -1, -1]]
    assert ct.num_nodes.tolist() == [4, 2] and ct.host_draws == [4, 1]
    assert ct.draw_child[0, 0].tolist() == [1, 2, 1]
    assert ct.draw_uniform[0, 0].tolist() == [0, 1, 2] and ct.draw_uniform[0, 1, 0].item() == 3
    assert ct.draw_kind[0, 0].tolist() == [1, 1, 1] and ct.draw_kind[0, 1, 0].item() == 0
    assert ct.draw_child[1, 0].tolist() == [1, -1, -1]
    # one q row shared by the three draws, zero-padded to the target vocabulary
    assert ct.q.shape == (1, 6) and torch.allclose(ct.q[0], torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0, 0.0]))
    anc = ancestor_matrix(ct.parents, ct.max_depth)
    assert anc[0, 3].tolist() == [True, True, False, True]
    assert anc[1, 2].tolist() == [False, False, True, False]  # padding sees itself only


def _compile_reference(trees, vocab_size, pad_to):
    """The draw tables walked draw by draw from the Draw objects (what compile_trees did before it copied the
    trees' flat draw columns): tokens, parents, depths, num_nodes, draw_child, draw_kind, draw_q, draw_uniform, q."""
    b, t = len(trees), max([len(tr) for tr in trees] + [pad_to or 1])
    groups = [{} for _ in trees]
    for g, tr in zip(groups, trees):
        for d in tr.draws:
            g.setdefault(d.parent, []).append(d)
    k = max([len(x) for g in groups for x in g.values()] + [1])
    nodes = torch.zeros((3, b, t), dtype=torch.long)
    nodes[1] = -1
    table = torch.zeros((4, b, t, k), dtype=torch.long)
    table[0] = -1
    q_rows, q_index = [], {}
    for i, tr in enumerate(trees):
        n = len(tr)
        nodes[:, i, :n] = torch.tensor([tr.tokens, tr.parents, tr.depths])
        order = {id(d): j for j, d in enumerate(tr.draws)}
        for parent, group in groups[i].items():  # parents in the order of their first draw
            for j, d in enumerate(group):
                q = 0
                if d.proposal.kind is ProposalKind.SAMPLED:
                    ref = d.proposal.q
                    key = (id(ref.table), ref.row) if isinstance(ref, QRef) else (id(ref), -1)
                    if key not in q_index:
                        q_index[key] = len(q_rows)
                        q_rows.append(ref.table[ref.row] if isinstance(ref, QRef) else ref)
                    q = q_index[key]
                table[:, i, parent, j] = torch.tensor([d.child, int(d.proposal.kind), q, order[id(d)]])
    q = None
    if q_rows:
        width = vocab_size or max(r.shape[-1] for r in q_rows)
        q = torch.zeros((len(q_rows), width))
        for j, r in enumerate(q_rows):
            q[j, : min(width, r.shape[-1])] = r[:width].float()
    return (*nodes, torch.tensor([len(tr) for tr in trees]), *table, q)


def test_compile_trees_equals_the_draw_by_draw_tables_on_random_batches():
    """The batched compilation (flat draw columns, one scatter) gives the same tensors as walking every Draw:
    random trees with deterministic and sampled draws (shared q rows, bare q tensors), merged and cut."""
    import random

    rng = random.Random(0)
    fields = ("tokens", "parents", "depths", "num_nodes", "draw_child", "draw_kind", "draw_q", "draw_uniform", "q")
    for _ in range(150):
        tables = [torch.rand(3, rng.choice([6, 8, 10])) for _ in range(2)]
        frac = rng.choice([0.0, 0.5, 1.0])
        trees = []
        for _ in range(rng.randrange(1, 9)):
            tr = TokenTree(rng.randrange(20))
            for _ in range(rng.randrange(0, 30)):
                parent, token = rng.randrange(len(tr)), rng.randrange(6)
                if rng.random() < frac:
                    q = QRef(rng.choice(tables), rng.randrange(3)) if rng.random() < 0.7 else torch.rand(8)
                    tr.add(parent, token, Proposal(ProposalKind.SAMPLED, "d", q))
                else:
                    tr.add(parent, token)
            if rng.random() < 0.3:
                tr = tr.truncated(rng.randrange(1, 12), rng.randrange(0, 4))
            if rng.random() < 0.3:
                tr = TokenTree.merge([tr, tr.truncated(5)], max_nodes=rng.randrange(2, 20))
            trees.append(tr)
        vocab, pad_to = rng.choice([None, 8]), rng.choice([None, 3, 40])
        ct = compile_trees(trees, "cpu", vocab_size=vocab, pad_to=pad_to)
        for name, want in zip(fields, _compile_reference(trees, vocab, pad_to)):
            got = getattr(ct, name)
            if want is None:
                assert got is None, name
            else:
                assert got.dtype == want.dtype and torch.equal(got, want), name
        assert ct.host_sizes == [len(tr) for tr in trees] and ct.host_draws == [len(tr.draws) for tr in trees]
        assert ct.max_depth == max(tr.max_depth for tr in trees)


def test_roots_alone_compile_to_the_general_tables_in_few_operations():
    """A step without drafts (every tree its root alone): the tables are those of the general path (checked here
    against the same batch padded to two columns, whose first column they must equal) from a third of its tensor
    operations (9 against 24 for three roots; the general path's flat host list and scatters cost 0.16 ms a step,
    this 0.04 ms: AMD EPYC Zen 4, one thread, both interleaved in one process while another job ran)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    roots = [TokenTree(7), TokenTree(8), TokenTree(9)]
    with Count():
        ct = compile_trees(roots, "cpu", vocab_size=6)
    assert Count.n <= 10, Count.n
    assert ct.tokens.tolist() == [[7], [8], [9]] and ct.parents.tolist() == [[-1]] * 3
    assert ct.depths.tolist() == [[0]] * 3 and ct.num_nodes.tolist() == [1, 1, 1]
    assert ct.draw_child.tolist() == [[[-1]]] * 3 and ct.q is None and ct.max_depth == 0
    assert ct.host_sizes == [1, 1, 1] and ct.host_draws == [0, 0, 0] and ct.width == 1
    wide = compile_trees(roots, "cpu", vocab_size=6, pad_to=2)  # the general path (two node columns)
    for name in ("tokens", "parents", "depths", "num_nodes"):
        a, b = getattr(ct, name), getattr(wide, name)
        assert a.dtype == b.dtype and torch.equal(a, b[:, :1] if a.dim() == 2 else b), name
    for name in ("draw_child", "draw_kind", "draw_q", "draw_uniform"):
        a, b = getattr(ct, name), getattr(wide, name)
        assert a.dtype == b.dtype and torch.equal(a, b[:, :1, :1]), name
