"""A tree round's index work in two launches: the tree's depths and ancestor mask from its parent pointers
(tree_plan), and the accept walk with everything the round's commit needs from it (accept_tree). Round-ahead's next
verify batch (speculative/verify_ahead.next_round_batch) is one more: the next tree's plan with its rows moved on
by each request's accept count (move_tree_batch).

Measured on an H100 (EAGLE-3 tree 5x4/8, 8B-shaped target, batch 1, benchmarks/e2e/round_timeline.py): the torch
code these stand in for ran as ~25 kernels before the verify and ~110 after it (build_tree's repeated squaring; the
walk's per-level gathers and wheres; compaction's slot lookups), each a few microseconds of GPU time on a handful of
integers: 94 us before the verify and 736 us between the verify and the next draft, against 28 and 62 us for a
chain-5 round. With these kernels: 47 and 77 us (benchmarks/results/tree_round_h100.md). The torch references are speculative/verify/tree_buffers.build_tree, tree_rejection.verify_greedy_tree,
simulated.simulate_tree (with a greedy target) and compaction.accept_plan; tests/gpu/test_tree_round.py compares
them element for element.

Shapes: B requests, N node slots per request (node 0 the root), D = the deepest accepted depth the tier allows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from hyperdraft.kernels._triton import jit, tl
from hyperdraft.kernels.draft_plan import _pow2, _token_slots
from hyperdraft.kernels.pdl import pdl_args, pdl_wait
from hyperdraft.kernels.uniform import fold_domain, uniform_at


class TreeAccept(NamedTuple):
    """What a tree round's accept decides, and the index lists its commit applies."""

    num_accepted: torch.Tensor  # [B] int64 accepted draft nodes (root not counted)
    path: torch.Tensor  # [B, D+1] int64 accepted nodes from the root 0, then -1
    tokens: torch.Tensor  # [B, D+1] int64 accepted nodes' tokens, the recovered or bonus token, then -1
    draft_kv_valid: torch.Tensor  # [B] int64 accepted nodes below the root whose draft K/V is kept
    target_moves: torch.Tensor  # [2, B*(D+1)] int64 (dst, src) slots moving the path's K/V to n, n+1, ...
    draft_moves: torch.Tensor | None  # [2, B*(D+1)] int64 the same for the drafter's pool (its kept nodes only)
    last_node: torch.Tensor  # [B] int64 the last accepted node (its state becomes the committed one)
    last_fed: torch.Tensor  # [B] int64 scratch entry of the drafter's last kept node (-1: the root's, committed)
    hidden_rows: torch.Tensor  # [B, D+1] int64 verify row of each path node (b * N + node; the root's past the path)


@jit
def _ancestors(Parents, parents, i, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """One request's (mask [BLOCK_N, BLOCK_N] bool: node j is node i or an ancestor of it, depth [BLOCK_N] int64),
    its real nodes' parents loaded (-1 elsewhere; Parents points at its row). Every node follows its parent pointer
    at once: after s hops each has met its ancestors up to s levels up, so N - 1 hops reach every root."""
    mask = i[:, None] == i[None, :]
    depth = tl.zeros([BLOCK_N], dtype=tl.int64)
    up = parents
    for _ in range(N - 1):
        has = up >= 0
        mask = mask | ((i[None, :] == up[:, None]) & has[:, None])
        depth += has.to(tl.int64)
        up = tl.load(Parents + tl.maximum(up, 0), mask=has, other=-1)
    return mask, depth


@jit
def _tree_plan(Parents, NumNodes, ParentsOut, Depth, Mask, stride_parents, N: tl.constexpr, BLOCK_N: tl.constexpr,
               PDL: tl.constexpr):
    """Program b: request b's tree (_ancestors), its padding nodes (index >= NumNodes[b]) parentless."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    ok = i < N
    real = ok & (i < tl.load(NumNodes + b))
    parents = tl.load(Parents + b * stride_parents + i, mask=real, other=-1)
    tl.store(ParentsOut + b * N + i, parents, mask=ok)
    mask, depth = _ancestors(Parents + b * stride_parents, parents, i, N, BLOCK_N)
    tl.store(Depth + b * N + i, depth, mask=ok)
    tl.store(Mask + b * N * N + i[:, None] * N + i[None, :], mask.to(tl.int8), mask=ok[:, None] & ok[None, :])


def tree_plan(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """parents [B, N] int64 (parents[b, i] < i for real nodes), num_nodes [B] int64 -> (parents with padding nodes'
    set to -1 [B, N] int64, depth [B, N] int64, mask [B, N, N] bool: node j is node i or an ancestor of it)."""
    parents, num_nodes = parents.contiguous(), num_nodes.contiguous()
    bsz, n = parents.shape
    out = torch.empty_like(parents)
    depth = torch.empty_like(parents)
    mask = torch.empty(bsz, n, n, dtype=torch.bool, device=parents.device)
    if bsz:
        _tree_plan[(bsz,)](parents, num_nodes, out, depth, mask.view(torch.int8), parents.stride(0), N=n,
                           BLOCK_N=_pow2(n), num_warps=1, **pdl_args(parents.device))
    return out, depth, mask


class MovedTree(NamedTuple):
    """A tree round's verify batch moved on by each request's a + 1, for the next tree (next_round_batch)."""

    ids: torch.Tensor  # [B*N] int64: the next tree's node tokens (its root the bonus token)
    positions: torch.Tensor  # [B*N] int64: root index + depth
    slots: torch.Tensor  # [B*N] int64: node i at index n + a + 1 + i
    seq_lens: torch.Tensor  # [B] int32
    depth: torch.Tensor  # [B, N] int64
    mask: torch.Tensor  # [B, N, N] bool: the ancestor mask


@jit
def _move_tree_batch(SeqLens, NumAccepted, Tokens, Parents, Rows, Table, Ids, Positions, Slots, NewLens, Depth, Mask,
                     stride_tokens, stride_parents, stride_table, last_page, N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """Program b: request b's N nodes start at index n + a + 1 (SeqLens holds n + N, the verify it moves on), each at
    RoPE position start + depth."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    ok = i < N
    parents = tl.load(Parents + b * stride_parents + i, mask=ok, other=-1)
    mask, depth = _ancestors(Parents + b * stride_parents, parents, i, N, BLOCK_N)
    start = tl.load(SeqLens + b).to(tl.int64) + tl.load(NumAccepted + b) + 1 - N
    index = start + i
    page = tl.load(Table + tl.load(Rows + b) * stride_table + tl.minimum(index // PAGE_SIZE, last_page), mask=ok,
                   other=0)
    out = b * N + i
    tl.store(Ids + out, tl.load(Tokens + b * stride_tokens + i, mask=ok), mask=ok)
    tl.store(Positions + out, start + depth, mask=ok)
    tl.store(Slots + out, page * PAGE_SIZE + index % PAGE_SIZE, mask=ok)
    tl.store(NewLens + b, (start + N).to(tl.int32))
    tl.store(Depth + out, depth, mask=ok)
    tl.store(Mask + b * N * N + i[:, None] * N + i[None, :], mask.to(tl.int8), mask=ok[:, None] & ok[None, :])


def move_tree_batch(seq_lens: torch.Tensor, num_accepted: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                    rows: torch.Tensor, table: torch.Tensor, page_size: int) -> MovedTree:
    """seq_lens [B] int32 (n + N: the verify being moved), num_accepted [B] int64, tokens and parents [B, N] int64 (the
    next tree, every node real; parents[b, i] < i), rows [B] int64, table [rows, pages] int64 (the device page
    table, flushed) -> the next verify's rows. The torch reference: verify_ahead.moved_tree_reference (~17 eager ops
    and tree_plan's launch, ~10 us of host an op on the H200's host)."""
    bsz, n = tokens.shape
    assert tokens.stride(1) == 1 and parents.stride(1) == 1 and table.stride(1) == 1
    device = tokens.device
    flat = torch.empty(4, bsz * n, dtype=torch.int64, device=device)  # ids, positions, slots, depth
    moved = MovedTree(flat[0], flat[1], flat[2], torch.empty(bsz, dtype=torch.int32, device=device),
                      flat[3].view(bsz, n), torch.empty(bsz, n, n, dtype=torch.bool, device=device))
    if bsz:
        _move_tree_batch[(bsz,)](seq_lens, num_accepted, tokens, parents, rows, table, moved.ids, moved.positions,
                                 moved.slots, moved.seq_lens, moved.depth, moved.mask.view(torch.int8),
                                 tokens.stride(0), parents.stride(0), table.stride(0), table.shape[1] - 1, N=n,
                                 PAGE_SIZE=page_size, BLOCK_N=_pow2(n), num_warps=1, **pdl_args(device))
    return moved


@jit
def _accept_tree(Target, Tokens, Parents, Fed, Room, Base, Rows, Table, Seeds, SeqLens, Thresholds,
                 NumAccepted, Path, OutTokens, DraftKV, TargetMoves, DraftMoves, LastNode, LastFed, HiddenRows,
                 n, num_ranks, domain_hash, stride_table, page_size, last_page, moves_stride,
                 DEPTH: tl.constexpr, SIMULATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 PDL: tl.constexpr):
    """Program b. The walk: at the current node v, the children (nodes whose parent is v) are tried in index order;
    greedy, the first whose token is the target's argmax at v is accepted; SIMULATE, the first of rank r (its place
    among v's children) with this level's coin < Thresholds[r], for r < num_ranks. The walk stops where none is, or
    at depth DEPTH (the tier's steps: a compile-time constant, so the walk unrolls). The last token is the target's argmax at the last accepted node."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_N)
    ok = i < n
    tokens = tl.load(Tokens + b * n + i, mask=ok, other=-1)
    parents = tl.load(Parents + b * n + i, mask=ok, other=-2)  # -2: a child of no node
    target = tl.load(Target + b * n + i, mask=ok, other=-1)
    j = tl.arange(0, BLOCK_D)  # path positions 0 .. D; lanes past D stay -1
    path = tl.where(j == 0, 0, -1).to(tl.int64)
    out = tl.full([BLOCK_D], -1, dtype=tl.int64)
    cur = (b * 0).to(tl.int64)
    going = cur == 0
    num_accepted = cur
    if SIMULATE:
        seed, seq_len = tl.load(Seeds + b), tl.load(SeqLens + b)
    for d in range(DEPTH):
        child = parents == cur
        if SIMULATE:  # sample/rng.uniform(seed, seq_len + d, DOMAIN_ACCEPT), bit for bit
            coin = uniform_at(seed, seq_len + d, domain_hash, i * 0)  # column 0, in every lane
            rank = tl.cumsum(child.to(tl.int32), 0) - 1
            ranked = child & (rank < num_ranks)
            hit = ranked & (coin < tl.load(Thresholds + rank, mask=ranked, other=0.0))
        else:
            hit = child & (tokens == tl.sum(tl.where(i == cur, target, 0)))
        picked = tl.min(tl.where(hit, i, BLOCK_N))
        going = going & (picked < BLOCK_N)
        cur = tl.where(going, picked, cur)
        num_accepted += going.to(tl.int64)
        path = tl.where(j == d + 1, tl.where(going, picked, -1), path)
        out = tl.where(j == d, tl.where(going, tl.sum(tl.where(i == cur, tokens, 0)), -1), out)
    out = tl.where(j == num_accepted, tl.sum(tl.where(i == cur, target, 0)), out)
    on_path = j <= DEPTH
    tl.store(NumAccepted + b, num_accepted)
    tl.store(Path + b * (DEPTH + 1) + j, path, mask=on_path)
    tl.store(OutTokens + b * (DEPTH + 1) + j, out, mask=on_path)
    tl.store(LastNode + b, cur)
    tl.store(HiddenRows + b * (DEPTH + 1) + j, b * n + tl.maximum(path, 0), mask=on_path)

    # The drafter's fed offset of each path node; past its reserved room the node's draft K/V went to padding.
    fed = tl.load(Fed + b * n + tl.maximum(path, 0), mask=on_path, other=-1)
    fed = tl.where(fed <= tl.load(Room + b), fed, -1)
    kept_end = tl.min(tl.where((j >= 1) & ((fed < 0) | (j > num_accepted) | ~on_path), j, BLOCK_D))
    draft_kv = kept_end - 1
    tl.store(DraftKV + b, draft_kv)
    tl.store(LastFed + b, tl.maximum(tl.sum(tl.where(j == draft_kv, fed, 0)), 0) - 1)

    row, base, at = tl.load(Rows + b), tl.load(Base + b), b * (DEPTH + 1) + j
    _store_moves(TargetMoves + at, moves_stride, Table, row, base, j, path, num_accepted, stride_table, page_size,
                 last_page, on_path)
    _store_moves(DraftMoves + at, moves_stride, Table, row, base, j, fed, draft_kv, stride_table, page_size,
                 last_page, on_path)


@jit
def _store_moves(Moves, moves_stride, Table, row, base, j, offsets, last, stride_table, page_size, last_page, on_path):
    """One request's K/V moves: path position j's entry goes from index base + offsets[j] (j <= last; the others
    stay put) to base + j, both as pool slots: (dst, src) at Moves and Moves + moves_stride."""
    src = tl.where(j <= last, base + tl.maximum(offsets, 0), base + j)
    tl.store(Moves, _token_slots(Table, row, base + j, stride_table, page_size, last_page, on_path), mask=on_path)
    tl.store(Moves + moves_stride, _token_slots(Table, row, src, stride_table, page_size, last_page, on_path),
             mask=on_path)


@functools.lru_cache(maxsize=16)
def rank_thresholds(alpha: float, sibling_rate: float, ranks: int, device: torch.device) -> torch.Tensor:
    """[ranks] float32: a rank-r child matches when the level's coin < 1 - (1 - alpha) * (1 - s)^r (the torch path
    compares a float32 coin with that Python float, which rounds it to float32 the same way). Cached: a device tensor
    built once per setting, not a copy per round."""
    return torch.tensor([1.0 - (1.0 - alpha) * (1.0 - sibling_rate) ** r for r in range(ranks)],
                        dtype=torch.float32, device=device)


def accept_tree(target: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, fed: torch.Tensor,
                room: torch.Tensor, base: torch.Tensor, rows: torch.Tensor, table: torch.Tensor, page_size: int,
                depth_max: int, simulate=None) -> TreeAccept:
    """target [B, N] int64 argmax of each node's verify row; tokens, parents (padding nodes -1), fed (the drafter's
    fed offset of each node, -1 if never fed) [B, N] int64; room, base (the root's sequence index), rows [B] int64;
    table: the page table's device tensor. simulate: None (greedy verification) or (alpha, sibling_rate, ranks,
    seeds [B], seq_lens [B], domain): benchmark-only simulated acceptance (verify/simulated.py)."""
    bsz, n = tokens.shape
    device, width = tokens.device, depth_max + 1
    # One allocation for the nine outputs: each torch.empty was ~5-10 us of host on the H200's host, views ~1-2.
    flat = torch.empty(bsz * (4 + 7 * width), dtype=torch.int64, device=device)
    scalars, grids, moves = flat.split([4 * bsz, 3 * bsz * width, 4 * bsz * width])
    num_accepted, draft_kv, last_node, last_fed = scalars.view(4, bsz)
    path, out, hidden_rows = grids.view(3, bsz, width)
    target_moves, draft_moves = moves.view(2, 2, bsz * width)
    if simulate is None:
        seeds = seq_lens = thresholds = base
        ranks, domain_hash = 0, 0
    else:
        alpha, sibling_rate, ranks, seeds, seq_lens, domain = simulate
        ranks = ranks if sibling_rate else 1  # without a sibling rate only first children can match
        thresholds = rank_thresholds(float(alpha), float(sibling_rate or 0.0), ranks, device)
        domain_hash = fold_domain(domain)
    if bsz:
        _accept_tree[(bsz,)](
            target.contiguous(), tokens.contiguous(), parents.contiguous(), fed.contiguous(), room, base, rows,
            table, seeds, seq_lens, thresholds, num_accepted, path, out, draft_kv, target_moves, draft_moves,
            last_node, last_fed, hidden_rows, n, ranks, domain_hash, table.stride(0), page_size,
            table.shape[1] - 1, bsz * width, DEPTH=depth_max, SIMULATE=simulate is not None, BLOCK_N=_pow2(n),
            BLOCK_D=_pow2(width + 1), num_warps=1, **pdl_args(device))
    return TreeAccept(num_accepted, path, out, draft_kv, target_moves, draft_moves, last_node, last_fed, hidden_rows)
