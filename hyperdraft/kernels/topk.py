"""A beam's children: each row's k largest log-probabilities and their ids, in two Triton launches, beside
torch.log_softmax(row).topk(k) (the reference).

Measured on an H100 (EAGLE-3 tree 5x4/8, 8B-shaped target, batch 1, benchmarks/e2e/gpu_profile.py --spec --tree): the
torch path spread each draft step's 4 rows over the 128k target vocabulary, ran log_softmax over them (~30 us a step)
and torch.topk's multi-pass radix select (~12 kernels, ~60 us a step): ~0.48 ms of a 9 ms round. Here stage 1 gives
every 4096-wide chunk of a row its own program, which finds the chunk's top k by k max-and-remove passes over
registers and its max and sum of exponentials; stage 2 merges the chunks' candidates and log-sum-exps per row
(9 + 5 us a step; the round's draft 2183 -> 1679 us, benchmarks/results/tree_round_h100.md).
With column ids (an EAGLE-3 head's draft-to-target map) the rows are the head's Vd draft logits and the ids are
target ids: the spread row is never built.

Order: largest first; equal values go to the smaller id first (torch.topk leaves tie order unspecified).
NaN-free input is assumed.
"""

from __future__ import annotations

import torch

from hyperdraft.kernels._triton import jit, tl, triton
from hyperdraft.kernels.pdl import pdl_args, pdl_wait

CHUNK = 4096
NO_ID = tl.constexpr(2147483647) if tl is not None else 2147483647  # a jitted kernel reads only constexpr globals


@jit
def _chunk_topk(X, ColumnIds, Vals, Ids, Max, SumExp, stride_x, width, num_chunks, K: tl.constexpr,
                HAS_IDS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    ok = cols < width
    x = tl.load(X + n * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
    if HAS_IDS:
        ids = tl.load(ColumnIds + cols, mask=ok, other=NO_ID).to(tl.int32)
    else:
        ids = tl.where(ok, cols, NO_ID)
    best = tl.max(x, axis=0)
    tl.store(Max + n * num_chunks + c, best)
    sum_exp = tl.sum(tl.where(ok, tl.exp(x - best), 0.0), axis=0)
    tl.store(SumExp + n * num_chunks + c, tl.where(best > float("-inf"), sum_exp, 0.0))  # an all -inf chunk adds 0
    out = (n * num_chunks + c) * K
    for r in tl.static_range(K):
        top = tl.max(x, axis=0)
        first = tl.min(tl.where(x == top, ids, NO_ID), axis=0)
        tl.store(Vals + out + r, top)
        tl.store(Ids + out + r, first)
        x = tl.where(ids == first, float("-inf"), x)


@jit
def _merge_topk(Vals, Ids, Max, SumExp, OutVals, OutIds, num_chunks, K: tl.constexpr, BLOCK_C: tl.constexpr,
                BLOCK_CK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    chunk_max = tl.load(Max + n * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    top = tl.max(chunk_max, axis=0)
    scaled = tl.load(SumExp + n * num_chunks + c, mask=c < num_chunks, other=0.0) * tl.exp(chunk_max - top)
    log_norm = top + tl.log(tl.sum(tl.where(c < num_chunks, scaled, 0.0), axis=0))
    j = tl.arange(0, BLOCK_CK)
    ok = j < num_chunks * K
    vals = tl.load(Vals + n * num_chunks * K + j, mask=ok, other=float("-inf"))
    ids = tl.load(Ids + n * num_chunks * K + j, mask=ok, other=NO_ID)
    for r in tl.static_range(K):
        best = tl.max(vals, axis=0)
        first = tl.min(tl.where(vals == best, ids, NO_ID), axis=0)
        tl.store(OutVals + n * K + r, best - log_norm)
        tl.store(OutIds + n * K + r, first.to(tl.int64))
        vals = tl.where(ids == first, float("-inf"), vals)


def top_logprobs_kernel(x: torch.Tensor, k: int, column_ids: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, W] logits (last dim contiguous, k <= W) -> (log-probabilities [N, k] float32, ids [N, k] int64): each
    row's k largest log_softmax values, largest first, and their columns (or column_ids[column], distinct ids)."""
    rows, width = x.shape
    assert x.stride(-1) == 1 and 0 < k <= width
    values = torch.empty(rows, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=x.device)
    if rows == 0:
        return values, ids
    num_chunks = triton.cdiv(width, CHUNK)
    cand_vals = torch.empty(rows, num_chunks, k, dtype=torch.float32, device=x.device)
    cand_ids = torch.empty(rows, num_chunks, k, dtype=torch.int32, device=x.device)
    chunk_max = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    chunk_sum = torch.empty(rows, num_chunks, dtype=torch.float32, device=x.device)
    column_ids = column_ids if column_ids is not None else cand_ids  # a placeholder pointer when there are no ids
    _chunk_topk[(rows, num_chunks)](x, column_ids, cand_vals, cand_ids, chunk_max, chunk_sum, x.stride(0), width,
                                    num_chunks, K=k, HAS_IDS=column_ids is not cand_ids, CHUNK=CHUNK, num_warps=8,
                                    **pdl_args(x.device))
    _merge_topk[(rows,)](cand_vals, cand_ids, chunk_max, chunk_sum, values, ids, num_chunks, K=k,
                         BLOCK_C=triton.next_power_of_2(num_chunks), BLOCK_CK=triton.next_power_of_2(num_chunks * k),
                         num_warps=1, **pdl_args(x.device))
    return values, ids


def top_logprobs_reference(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, V] logits over the ids themselves (a draft vocabulary already spread, -inf outside it)."""
    return torch.log_softmax(x if x.dtype == torch.float32 else x.float(), -1).topk(k, dim=-1)
