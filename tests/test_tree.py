"""Token trees: hand-worked masks, depths, leaf paths, trie merge, truncation."""

import torch

from specstream.stages.speculative.tree import Proposal, ProposalKind, TokenTree, chain_tree


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


def test_ancestor_mask_depths_and_leaf_paths_by_hand():
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
    assert ct.leaf_paths.tolist() == [[0, 1, 3], [0, 2, 4], [0, 2, 5]]
    assert ct.children == ((1, 2), (3,), (4, 5), (), (), ())


def test_adding_an_existing_child_records_another_proposal():
    t = TokenTree(1)
    sampled = Proposal(ProposalKind.SAMPLED, "a", torch.tensor([0.5, 0.5]))
    a = t.add(0, 7, sampled)
    b = t.add(0, 7)
    assert a == b == 1 and len(t) == 2
    assert [p.kind for p in t.proposals[1]] == [ProposalKind.SAMPLED, ProposalKind.DETERMINISTIC]
    assert [c for c, _ in t.parent_proposals[0]] == [1, 1]


def test_merge_is_a_trie_union_without_duplicates():
    a = chain_tree([10, 11, 13])
    b = TokenTree(10)
    b.add_path([11, 14])
    b.add_path([12])
    m = TokenTree.merge([a, b])
    paths = sorted(tuple(m.path_tokens(i)) for i in range(len(m)) if not m.children[i])
    assert paths == [(11, 13), (11, 14), (12,)]
    assert len(m) == 5  # root, 11, 12, 13, 14: the shared 11 appears once
    assert len(m.proposals[m.child(0, 11)]) == 2


def test_merge_respects_node_budget_breadth_first():
    a = chain_tree([0, 1, 2, 3, 4])
    b = chain_tree([0, 5, 6, 7, 8])
    m = TokenTree.merge([a, b], max_nodes=5)
    assert len(m) == 5
    assert sorted(m.depths) == [0, 1, 1, 2, 2]


def test_truncated_keeps_parents_and_depth():
    t = small_tree().truncated(max_nodes=10, max_depth=1)
    assert t.tokens == [10, 11, 12]
    t = small_tree().truncated(max_nodes=4)
    assert t.tokens == [10, 11, 12, 13]
