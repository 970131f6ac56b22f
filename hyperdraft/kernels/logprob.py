"""Chosen tokens' log-probabilities, log softmax(logits[row])[token], in two Triton launches.

torch.logsumexp over a few 128k-wide rows runs each row on one block (~15 us per reduction on an H100, two
reductions plus ~8 elementwise kernels per step). Here every 4096-wide chunk of a row gets a program (stage 1: the
chunk's max m_c and sum of exp(x - m_c)); stage 2 merges a row's chunks, log-sum-exp = M + log(sum_c s_c *
exp(m_c - M)) with M the row max, and subtracts it from the chosen token's logit. A row's result depends only on
that row. The reference is logits_ops.token_logprobs's torch path (another summation order: equal up to rounding).
"""

from __future__ import annotations

import torch

from hyperdraft.kernels._triton import jit, tl, triton
from hyperdraft.kernels.pdl import pdl_args, pdl_wait

CHUNK = 4096


@jit
def _chunk_sumexp(X, Max, SumExp, stride_x, width, num_chunks, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(X + n * stride_x + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    s = tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - m)), axis=0)  # an all -inf chunk sums to 0, not NaN
    tl.store(Max + n * num_chunks + c, m)
    tl.store(SumExp + n * num_chunks + c, s)


@jit
def _token_logprob(X, Max, SumExp, Rows, Tokens, Out, stride_x, num_chunks, HAS_ROWS: tl.constexpr,
                   BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(Rows + i).to(tl.int64) if HAS_ROWS else i
    c = tl.arange(0, BLOCK_C)
    ok = c < num_chunks
    m = tl.load(Max + row * num_chunks + c, mask=ok, other=float("-inf"))
    s = tl.load(SumExp + row * num_chunks + c, mask=ok, other=0.0)
    top = tl.max(m, axis=0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - top)), axis=0)
    logit = tl.load(X + row * stride_x + tl.load(Tokens + i)).to(tl.float32)
    tl.store(Out + i, logit - (top + tl.log(total)))


def token_logprobs_kernel(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] (last dim contiguous); tokens, rows: [M] int (rows None: M = N, row i) -> [M] fp32."""
    n, width = logits.shape
    count = tokens.shape[0]
    out = torch.empty(count, dtype=torch.float32, device=logits.device)
    if count == 0 or n == 0:
        return out
    num_chunks = triton.cdiv(width, CHUNK)
    maxes = torch.empty(n, num_chunks, dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(maxes)
    launch = pdl_args(logits.device)
    _chunk_sumexp[(n, num_chunks)](logits, maxes, sums, logits.stride(0), width, num_chunks, CHUNK=CHUNK, num_warps=8,
                                   **launch)
    tokens = tokens.contiguous()
    rows_arg = rows.contiguous() if rows is not None else tokens
    _token_logprob[(count,)](logits, maxes, sums, rows_arg, tokens, out, logits.stride(0), num_chunks,
                             HAS_ROWS=rows is not None, BLOCK_C=triton.next_power_of_2(num_chunks), num_warps=1,
                             **launch)
    return out
