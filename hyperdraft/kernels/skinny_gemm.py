"""x @ W^T for a few rows (decode, verify: M <= 16 tokens) as a weight-streaming Triton kernel.

At a handful of rows a projection is a matrix-vector product bound by reading W once; cuBLAS streams the small
projections of an 8B decoder at 68-80% of the copy bandwidth on an H100 (benchmarks/results/gemm_orientation_h100.md).
Each program here owns BLOCK_N output columns and walks K in BLOCK_K steps (tl.dot over the rows padded to 16),
optionally split over SPLIT_K programs whose fp32 partials a second launch sums in a fixed order (deterministic,
no atomics). The reference is F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperdraft.kernels._triton import jit, tl, triton

MAX_ROWS = 16


@jit
def _skinny_gemm(X, W, Out, M, N, K, stride_xm, stride_wn, stride_os, stride_om,
                 K_PER_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, 16)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):
        ks = k_start + k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(W + cols[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K),
                    other=0.0)
        acc += tl.dot(x, tl.trans(w))
    out = Out + split * stride_os + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(Out.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@jit
def _sum_splits(Part, Out, total, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(Part + s * total + offs, mask=mask, other=0.0)
    tl.store(Out + offs, acc.to(Out.dtype.element_ty), mask=mask)


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, block_n: int = 32, block_k: int = 256, split_k: int = 1,
                num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x: [M, K] (M <= 16, contiguous rows), w: [N, K] contiguous -> x @ w^T, [M, N] in x's dtype."""
    m, k = x.shape
    n = w.shape[0]
    assert m <= MAX_ROWS and w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    grid = (triton.cdiv(n, block_n), split_k)
    if split_k == 1:
        _skinny_gemm[grid](x, w, out, m, n, k, x.stride(0), w.stride(0), 0, out.stride(0), K_PER_SPLIT=k_per_split,
                           BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
        return out
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _skinny_gemm[grid](x, w, part, m, n, k, x.stride(0), w.stride(0), part.stride(0), part.stride(1),
                       K_PER_SPLIT=k_per_split, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    _sum_splits[(triton.cdiv(m * n, 1024),)](part, out, m * n, SPLIT_K=split_k, BLOCK=1024)
    return out


def skinny_gemm_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)
