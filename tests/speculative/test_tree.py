"""build_tree / positions: hand-made trees against hand-written depth, sibling links and ancestor masks."""

from __future__ import annotations

import pytest
import torch

from hyperdraft.speculative.verify.tree_buffers import build_tree, positions

# Tree A:        0
#              /   \
#             1     2
#             |     |
#             3     4
#             |
#             5
PARENTS_A = [-1, 0, 0, 1, 2, 3]
DEPTH_A = [0, 1, 1, 2, 2, 3]
FIRST_CHILD_A = [1, 3, 4, 5, -1, -1]
NEXT_SIBLING_A = [-1, 2, -1, -1, -1, -1]
ANCESTORS_A = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 1, 3, 5]]

# Tree B: a root with three children (1, 2, 5: siblings need not be adjacent), node 3 and 4 children of 1,
# node 5 a child of the root after them.
PARENTS_B = [-1, 0, 0, 1, 1, 0]
DEPTH_B = [0, 1, 1, 2, 2, 1]
FIRST_CHILD_B = [1, 3, -1, -1, -1, -1]
NEXT_SIBLING_B = [-1, 2, 5, 4, -1, -1]
ANCESTORS_B = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 1, 4], [0, 5]]


def _mask(ancestors, n):
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, anc in enumerate(ancestors):
        m[i, anc] = True
    return m


def _tokens(b, n):
    return torch.arange(b * n, dtype=torch.int64).view(b, n) + 100


@pytest.mark.parametrize("case", ["A", "B"])
def test_single_tree(case):
    parents, depth, fc, ns, anc = {
        "A": (PARENTS_A, DEPTH_A, FIRST_CHILD_A, NEXT_SIBLING_A, ANCESTORS_A),
        "B": (PARENTS_B, DEPTH_B, FIRST_CHILD_B, NEXT_SIBLING_B, ANCESTORS_B),
    }[case]
    n = len(parents)
    tree = build_tree(_tokens(1, n), torch.tensor([parents]), validate=True)
    assert tree.depth.tolist() == [depth]
    assert tree.first_child.tolist() == [fc]
    assert tree.next_sibling.tolist() == [ns]
    assert torch.equal(tree.mask[0], _mask(anc, n))
    assert tree.parents.tolist() == [parents]
    assert torch.equal(positions(tree, torch.tensor([40])), torch.tensor([depth]) + 40)


def test_batch_of_two_different_trees():
    n = len(PARENTS_A)
    tokens = _tokens(2, n)
    tree = build_tree(tokens, torch.tensor([PARENTS_A, PARENTS_B]), validate=True)
    assert tree.depth.tolist() == [DEPTH_A, DEPTH_B]
    assert tree.first_child.tolist() == [FIRST_CHILD_A, FIRST_CHILD_B]
    assert tree.next_sibling.tolist() == [NEXT_SIBLING_A, NEXT_SIBLING_B]
    assert torch.equal(tree.mask, torch.stack([_mask(ANCESTORS_A, n), _mask(ANCESTORS_B, n)]))
    assert torch.equal(tree.tokens, tokens)
    assert tree.num_children().tolist() == [[2, 1, 1, 1, 0, 0], [3, 2, 0, 0, 0, 0]]
    pos = positions(tree, torch.tensor([7, 1000]))
    assert pos.tolist() == [[7 + d for d in DEPTH_A], [1000 + d for d in DEPTH_B]]


def test_padding_nodes_via_num_nodes():
    """Nodes >= num_nodes are ignored whatever their parent entries say: parent -1, depth 0, no links, only the
    diagonal in the mask; they are never anyone's child or sibling."""
    n = 8
    # Request 0: tree A in slots 0..5, slots 6, 7 padding with junk parents (pointing at real nodes).
    # Request 1: root + children 1, 2 (3 real nodes), junk beyond.
    parents = torch.tensor([PARENTS_A + [0, 2], [-1, 0, 0, 1, 1, 0, 2, 6]])
    tree = build_tree(_tokens(2, n), parents, num_nodes=torch.tensor([6, 3]), validate=True)
    assert tree.parents.tolist() == [PARENTS_A + [-1, -1], [-1, 0, 0, -1, -1, -1, -1, -1]]
    assert tree.depth.tolist() == [DEPTH_A + [0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]
    assert tree.first_child.tolist() == [FIRST_CHILD_A + [-1, -1], [1, -1, -1, -1, -1, -1, -1, -1]]
    assert tree.next_sibling.tolist() == [NEXT_SIBLING_A + [-1, -1], [-1, 2, -1, -1, -1, -1, -1, -1]]
    expected = torch.stack([_mask(ANCESTORS_A + [[6], [7]], n),
                            _mask([[0], [0, 1], [0, 2]] + [[i] for i in range(3, n)], n)])
    assert torch.equal(tree.mask, expected)
    assert tree.real().tolist() == [[True] * 6 + [False] * 2, [True] * 3 + [False] * 5]
    assert tree.num_children().tolist() == [[2, 1, 1, 1, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0, 0]]


def test_chain_gives_causal_mask_and_root_only_tree():
    n = 5
    tree = build_tree(_tokens(1, n), torch.tensor([[-1, 0, 1, 2, 3]]), validate=True)
    assert torch.equal(tree.mask[0], torch.ones(n, n, dtype=torch.bool).tril())
    assert tree.depth.tolist() == [[0, 1, 2, 3, 4]]
    assert tree.first_child.tolist() == [[1, 2, 3, 4, -1]]
    assert tree.next_sibling.tolist() == [[-1] * n]
    root_only = build_tree(_tokens(3, 1), torch.full((3, 1), -1), validate=True)
    assert root_only.depth.tolist() == [[0]] * 3 and root_only.mask.all()


def test_random_trees_match_a_reference_walk():
    """Random valid parent arrays (batch 16, N 24) against a per-node Python reference."""
    g = torch.Generator().manual_seed(0)
    b, n = 16, 24
    parents = torch.full((b, n), -1)
    for i in range(1, n):
        parents[:, i] = (torch.rand(b, generator=g) * i).long()
    num_nodes = torch.randint(1, n + 1, (b,), generator=g)
    tree = build_tree(_tokens(b, n), parents, num_nodes=num_nodes, validate=True)
    for r in range(b):
        m = int(num_nodes[r])
        par = [int(x) if i < m else -1 for i, x in enumerate(parents[r])]
        for i in range(n):
            anc, v = [], i
            while v >= 0:
                anc.append(v)
                v = par[v]
            assert tree.depth[r, i] == len(anc) - 1
            assert set(torch.nonzero(tree.mask[r, i])[:, 0].tolist()) == set(anc)
            kids = [j for j in range(n) if par[j] == i]
            assert tree.first_child[r, i] == (kids[0] if kids else -1)
            sibs = [j for j in range(i + 1, n) if par[i] >= 0 and par[j] == par[i]]
            assert tree.next_sibling[r, i] == (sibs[0] if sibs else -1)


def test_validate_rejects_bad_parents():
    with pytest.raises(AssertionError):
        build_tree(_tokens(1, 3), torch.tensor([[-1, 2, 0]]), validate=True)  # parent after child
    with pytest.raises(AssertionError):
        build_tree(_tokens(1, 3), torch.tensor([[0, 0, 1]]), validate=True)  # root with a parent
    with pytest.raises(AssertionError):
        build_tree(_tokens(1, 3), torch.tensor([[-1, 0, -1]]), validate=True)  # orphan real node
