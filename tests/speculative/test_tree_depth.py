"""build_tree's depth and ancestor mask (computed by repeated squaring) on deep trees: chains of every length around
the powers of two, and long mostly-chain random trees, against a per-node walk."""

from __future__ import annotations

import pytest
import torch

from hyperdraft.speculative.verify.tree_buffers import build_tree


def _reference(parents: list[int]) -> tuple[list[int], list[set[int]]]:
    depth, anc = [], []
    for i in range(len(parents)):
        seen, v = set(), i
        while v >= 0:
            seen.add(v)
            v = parents[v]
        depth.append(len(seen) - 1)
        anc.append(seen)
    return depth, anc


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 65])
def test_chains(n):
    tree = build_tree(torch.zeros(1, n, dtype=torch.int64), torch.arange(-1, n - 1)[None], validate=True)
    assert tree.depth.tolist() == [list(range(n))]
    assert torch.equal(tree.mask[0], torch.ones(n, n, dtype=torch.bool).tril())


def test_deep_random_trees():
    g = torch.Generator().manual_seed(1)
    b, n = 8, 48
    parents = torch.full((b, n), -1)
    for i in range(1, n):
        chain = torch.rand(b, generator=g) < 0.85  # mostly extend the chain: depths up to ~40
        parents[:, i] = torch.where(chain, i - 1, (torch.rand(b, generator=g) * i).long())
    num_nodes = torch.randint(1, n + 1, (b,), generator=g)
    tree = build_tree(torch.zeros(b, n, dtype=torch.int64), parents, num_nodes=num_nodes, validate=True)
    assert tree.depth.max() > 20
    for r in range(b):
        m = int(num_nodes[r])
        depth, anc = _reference([int(p) if i < m else -1 for i, p in enumerate(parents[r])])
        assert tree.depth[r].tolist() == depth
        assert [set(torch.nonzero(row)[:, 0].tolist()) for row in tree.mask[r]] == anc
