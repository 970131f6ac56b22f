"""A tree round's kernels (kernels/tree_round.py) against the torch code they replace, element for element: the tree's
parents, depths and ancestor mask (build_tree), and the accept walk with the commit's index lists (verify_greedy_tree
or simulate_tree, then compaction.accept_plan). Run on a GPU machine: `python3 -m pytest tests/gpu/test_tree_round.py`
(with TRITON_INTERPRET=1 and triton installed, also on the CPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from hyperdraft.kernels.tree_round import accept_tree, tree_plan
from hyperdraft.options import RuntimeOptions, activated
from hyperdraft.sample.rng import DOMAIN_ACCEPT
from hyperdraft.speculative.verify.compaction import accept_plan
from hyperdraft.speculative.verify.simulated import simulate_tree
from hyperdraft.speculative.verify.tree_buffers import build_tree
from hyperdraft.speculative.verify.tree_rejection import verify_greedy_tree
from tests.gpu.test_draft_plan import _page_table, _poison_int

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA device")
TORCH = RuntimeOptions.from_env(fused_kernels=False)


def _tree_case(bsz: int, n: int, seed: int, beam: int = 0):
    """Random trees (beam > 0: beam-shaped, k nodes per depth with parents in the depth above; 1: a chain) with ragged sizes, few
    distinct tokens (so siblings repeat tokens), targets that match one of the node's children most of the time,
    and fed offsets with gaps."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.arange(n)
    if beam:
        depth_of = (idx - 1).clamp_min(0) // beam + (idx > 0).long()
        first_of_depth = (depth_of - 2).clamp_min(0) * beam + 1
        span = torch.where(depth_of <= 1, 1, beam)
        parents = torch.where(depth_of <= 1, 0, first_of_depth + torch.randint(0, 1 << 20, (bsz, n), generator=g) % span)
    else:
        parents = (torch.rand(bsz, n, generator=g) * idx).long()
    parents[:, 0] = -1
    tokens = torch.randint(0, 5, (bsz, n), generator=g)
    num_nodes = torch.randint(1, n + 1, (bsz,), generator=g)
    num_nodes[0] = n
    child = torch.randint(0, n, (bsz, n), generator=g)
    target = torch.where(torch.rand(bsz, n, generator=g) < 0.8, tokens.gather(1, child), torch.randint(0, 5, (bsz, n), generator=g))
    fed = torch.where(torch.rand(bsz, n, generator=g) < 0.85, idx.expand(bsz, n), -1)
    fed[:, 0] = 0
    room = torch.randint(1, n + 2, (bsz,), generator=g)
    base = torch.randint(0, 30, (bsz,), generator=g)
    rows = torch.randperm(bsz, generator=g)
    return [t.to(DEVICE) for t in (parents, tokens, num_nodes, target, fed, room, base, rows)]


@pytest.mark.parametrize("bsz,n,beam", [(1, 8, 4), (5, 8, 0), (16, 21, 4), (3, 64, 0), (2, 9, 1), (7, 2, 0), (4, 1, 0)])
def test_tree_plan(bsz, n, beam):
    parents, tokens, num_nodes = _tree_case(bsz, n, seed=n + bsz, beam=beam)[:3]
    _poison_int(bsz * n * n)
    fused_parents, fused_depth, fused_mask = tree_plan(parents, num_nodes)
    with activated(TORCH):
        ref = build_tree(tokens, parents, num_nodes=num_nodes)
    assert torch.equal(fused_parents, ref.parents)
    assert torch.equal(fused_depth, ref.depth)
    assert torch.equal(fused_mask, ref.mask)


def _reference_and_fused(case, depth_max: int, page_size: int, simulate=None):
    parents, tokens, num_nodes, target, fed, room, base, rows = case
    table = _page_table(page_size, rows=len(rows), seed=page_size)
    with activated(TORCH):
        tree = build_tree(tokens, parents, num_nodes=num_nodes)
        if simulate is None:
            walk = verify_greedy_tree(target, tree, max_depth=depth_max)
        else:
            alpha, sibling_rate, ranks, seeds, seq_lens = simulate
            walk = simulate_tree(None, tree, alpha, seeds, seq_lens, max_depth=depth_max, greedy_target=target,
                                 sibling_rate=sibling_rate, max_children=ranks)
        ref = accept_plan(*walk, fed, room, base, rows, table)
    _poison_int(4 * len(rows) * (depth_max + 1))
    fused = accept_tree(target, tree.tokens, tree.parents, fed, room, base, rows, table.table, page_size, depth_max,
                        None if simulate is None else (*simulate, DOMAIN_ACCEPT))
    return ref, fused


def _assert_equal(ref, fused):
    for name, a, b in zip(ref._fields, ref, fused):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("bsz,n,depth_max,beam", [(1, 8, 5, 4), (16, 21, 5, 4), (33, 8, 4, 0), (4, 64, 9, 0),
                                                  (6, 2, 1, 0), (3, 1, 1, 0)])
def test_accept_tree_greedy(page_size, bsz, n, depth_max, beam):
    case = _tree_case(bsz, n, seed=7 * n + bsz, beam=beam)
    ref, fused = _reference_and_fused(case, depth_max, page_size)
    _assert_equal(ref, fused)
    if bsz > 4:  # the case exercises several accept lengths and kept draft K/V counts
        assert len(set(ref.num_accepted.tolist())) > 1 and len(set(ref.draft_kv_valid.tolist())) > 1


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("bsz,n,depth_max,beam,alpha,sibling_rate,ranks",
                         [(1, 8, 5, 4, 0.8, None, 4), (32, 21, 5, 4, 0.7, 0.4, 4), (17, 8, 4, 0, 0.6, 0.5, 3),
                          (8, 40, 7, 0, 0.9, 0.3, 8)])
def test_accept_tree_simulated(page_size, bsz, n, depth_max, beam, alpha, sibling_rate, ranks):
    """The simulated walk draws the same coins as sample/rng.uniform, bit for bit, and compares them with the same
    float32 rank thresholds."""
    case = _tree_case(bsz, n, seed=3 * n + bsz, beam=beam)
    g = torch.Generator().manual_seed(bsz)
    seeds = torch.randint(-2**62, 2**62, (bsz,), generator=g).to(DEVICE)
    seq_lens = torch.randint(0, 10_000, (bsz,), generator=g).to(DEVICE)
    ref, fused = _reference_and_fused(case, depth_max, page_size, (alpha, sibling_rate, ranks, seeds, seq_lens))
    _assert_equal(ref, fused)
    if bsz > 4:
        assert len(set(ref.num_accepted.tolist())) > 1


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("bsz,n,beam", [(1, 8, 4), (5, 8, 0), (16, 21, 4), (3, 64, 0), (2, 9, 1), (4, 1, 0)])
def test_move_tree_batch(page_size, bsz, n, beam):
    """Round-ahead's tree batch move (verify_ahead.next_round_batch): the kernel == the torch code, element for
    element, with accept counts 0..N-1, rows in any order, and moved rows running past a row's pages (they map to its
    last page entry, as token_slots clamps)."""
    from hyperdraft.kernels.tree_round import move_tree_batch
    from hyperdraft.speculative.verify_ahead import moved_tree_reference

    parents, tokens = _tree_case(bsz, n, seed=n * 7 + bsz + page_size, beam=beam)[:2]
    table = _page_table(page_size, 6, seed=page_size * 10 + n)
    g = torch.Generator().manual_seed(bsz * 100 + n)
    rows = torch.randint(0, 6, (bsz,), generator=g).to(DEVICE)
    seq_lens = torch.randint(n, n + 8 * page_size, (bsz,), generator=g).to(torch.int32).to(DEVICE)
    num_accepted = torch.randint(0, n, (bsz,), generator=g).to(DEVICE)
    args = (seq_lens, num_accepted, tokens, parents, rows, table.table, page_size)
    _poison_int(4096)
    got = move_tree_batch(*args)
    with activated(TORCH):
        want = moved_tree_reference(*args)
    for name, a, b in zip(got._fields, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
