"""How paged attention is tiled and split (kernels/attention.py launches with these): row and key tiles, the key
split count of a launch, the split workspace, and deterministic mode's fixed tiles, fixed splits and tree paths.
Everything here is a function of static sizes (shapes and bounds), never of a batch's contents, so a captured CUDA
graph stays valid for every batch under its bounds."""

from __future__ import annotations

from typing import NamedTuple

import torch

MIN_KEYS_PER_SPLIT = 128  # below this a split's fixed cost (q load, partial write, merge) outweighs its keys
MAX_SPLITS = 32  # measured: 64 splits of 128 keys ran slower than 33 of 256 at batch 1 x 8k
# Deterministic mode cuts the keys every INVARIANT_SPLIT_KEYS positions, whatever the launch: a decode or verify runs
# the splits as parallel programs, a prefill walks them inside one program; both merge them in order, bit for bit alike.
INVARIANT_SPLIT_KEYS = 128
INVARIANT_PARALLEL_ROWS = 16  # launches with at most this many queries per request run their splits in parallel


def next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


class Tiles(NamedTuple):
    m: int  # rows: (query, q head) pairs of one kv head's group
    n: int  # keys per block
    d: int  # head_dim padded to a power of two
    warps: int
    stages: int


def tile_config(group: int, max_extend_len: int, head_dim: int, dtype: torch.dtype) -> Tiles:
    """A bf16/fp16 K or V tile stays near 16 KB, three pipeline stages deep (decode and verify are bound by these
    loads; 3 stages measured 7% faster than 2 at batch 32 x 8k on an H100). float32 runs its dots as exact FMA
    loops (no tf32), whose operands live in registers: small tiles, so nothing spills (sm_90 compiler report).
    128-row tiles over 8 warps measured 5% slower for a 4k prefill, so rows stop at 64."""
    block_d = max(16, next_pow2(head_dim))
    if dtype == torch.float32:
        return Tiles(16, max(16, min(64, 2048 // block_d)), block_d, 4, 2)
    rows = max(16, next_pow2(max_extend_len * group))
    return Tiles(min(rows, 64 if block_d <= 128 else 32), max(16, min(64, 8192 // block_d)), block_d, 4,
                 3 if rows <= 64 else 2)


# Splits of at most this many keys (at the static bound) run a 2-stage pipeline: with a few key blocks per program a
# deeper one only lengthens the prologue. Batch 1 on an H100 at a 4096-key bound (32 splits): decode 7.7 us per layer
# against 8.9 with 3 stages at 641 keys, 10.7 against 11.3 at 4090; chain-5 verify 10.4 against 10.7 at 646
# (benchmarks/kernels/verify_attention.py). Long splits keep 3 (7% faster at batch 32 x 8k, 3 splits).
SHORT_SPLIT_KEYS = 512


def invariant_tiles(group: int, head_dim: int, dtype: torch.dtype) -> Tiles:
    """Deterministic mode's tiles: one shape per model (nothing from the batch or the bounds), rows enough for one
    query's group (a tree's path programs hold one query), keys as tile_config's."""
    block_d = max(16, next_pow2(head_dim))
    keys = 2048 if dtype == torch.float32 else 8192
    return Tiles(max(16, next_pow2(group)), max(16, min(64, keys // block_d)), block_d, 4, 2)


def invariant_num_splits(max_extend_len: int, max_seq_len: int) -> int:
    """Deterministic mode's split count, from static bounds: every fixed split as a program of its own for a decode or
    a verify (few programs otherwise), else 1 (one program walks them; a prefill has programs enough)."""
    if max_extend_len > INVARIANT_PARALLEL_ROWS:
        return 1
    return max(1, -(-max_seq_len // INVARIANT_SPLIT_KEYS))


def tail_paths(tail_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tail_mask [B, Q, W] -> (path [B, Q, W] int32: each query's visible tail offsets, ascending, then zeros;
    seen [B, Q] int32: how many). Tensor ops only (CUDA-graph safe). A tree lists a node after its ancestors, so the
    ascending offsets are its branch in order."""
    b, q, w = tail_mask.shape
    rank = tail_mask.cumsum(-1, dtype=torch.int32) - 1
    dest = torch.where(tail_mask, rank, w).long()  # invisible offsets all land in a spare column
    offsets = torch.arange(w, dtype=torch.int32, device=tail_mask.device).expand(b, q, w)
    path = torch.zeros(b, q, w + 1, dtype=torch.int32, device=tail_mask.device).scatter_(-1, dest, offsets)
    return path[..., :w].contiguous(), (rank[..., -1] + 1).contiguous()


def split_tiles(tiles: Tiles, max_seq_len: int, num_splits: int) -> Tiles:
    """tiles with the pipeline depth for splits of max_seq_len / num_splits keys (static bounds only)."""
    if tiles.stages > 2 and -(-max_seq_len // num_splits) <= SHORT_SPLIT_KEYS:
        return tiles._replace(stages=2)
    return tiles


def num_row_tiles(group: int, max_extend_len: int, block_m: int) -> int:
    return max(1, -(-max_extend_len * group // block_m))


def num_kv_splits(batch: int, num_kv_heads: int, row_tiles: int, max_seq_len: int, num_sms: int,
                  min_keys: int = MIN_KEYS_PER_SPLIT) -> int:
    """Key splits per program, from static sizes only: enough programs for ~4 per SM, each >= min_keys keys."""
    programs = max(1, batch * num_kv_heads * row_tiles)
    want = -(-4 * num_sms // programs)
    return max(1, min(want, -(-max_seq_len // min_keys), MAX_SPLITS))


def attention_workspace(num_tokens: int, num_heads: int, head_dim: int, num_splits: int, device) -> tuple:
    """Partial outputs and log-sum-exps of the splits (None when there is one split)."""
    if num_splits == 1:
        return None
    part_o = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=device)
    return part_o, part_lse
