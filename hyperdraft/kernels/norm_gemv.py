"""RMSNorm(x + residual) @ W^T for one row in one launch: the norm moves into the projection after it.

A small model's decode step is a chain of 3-5 us launches: on SmolLM2-135M (H100, bf16) its 61 RMSNorm launches took
~240 us of a ~700 us step, about 4 us each for 576 numbers (benchmarks/results/round_host_h100.md). Here every
program of the one-row GEMV (kernels/gemv.py `_gemv_vec`'s tiles) forms the running sum x + residual itself, sums its
squares (the row is a few KB, read from L2 by every program), and feeds the normalised row to its columns' dot
products; program 0 also writes the running sum, which the layer hands on. The weights' first tile is requested
before the PDL wait, as in gemv.py, so the extra pass over the row overlaps the weight stream.

Rounding follows kernels/norm.py step by step: the running sum rounded to the activation dtype, the normalised
value rounded before the weight multiplies it, that product rounded, then the product with W as gemv rounds it. The
sum of squares runs in BLOCK_K-wide chunks, so for rows wider than one chunk its order differs from rms_norm's
(equal up to rounding). Not in deterministic mode, whose products are the batch-invariant dot kernel's.

Measured (benchmarks/probes/plain_step.py, H100, SmolLM2-135M shape, batch 1, two engines in one process taken in
turns): the decode graph's GPU time fell from 661 to 600 us per step, the engine step from 751 to 710 us. Sixty
launches fewer saved about 1 us each: inside a CUDA graph a tiny kernel's cost is mostly its own ~2 us of latency, not
a launch gap. On by default; HYPERDRAFT_DISABLE_FUSED_NORM_GEMV=1 (RuntimeOptions.fused_norm_gemv) turns it off.

Only for rows of at most NORM_GEMV_MAX_K: every program passes over the whole row before its columns' products, and
on the Llama-3.1-8B shape (K = 4096, H200, bf16, benchmarks/results/no_regression_8b_h200.md) that
pass made a batch-1 decode 12% slower (208 against 237 tok/s, 236 with the fusion off): ~9 us more a fused product,
where a launch saved is worth ~1 us. At K = 576 (SmolLM2) it saved 61 us a step.
"""

from __future__ import annotations

import torch

from hyperdraft import options
from hyperdraft.kernels._triton import jit, tl, triton
from hyperdraft.kernels.gemv import VEC_BLOCK_K, VEC_BLOCK_N, VEC_WARPS, VecTile, _weights_first, gemv_fits
from hyperdraft.kernels.norm import rms_norm_reference
from hyperdraft.kernels.pdl import pdl_args

NORM_GEMV_MAX_K = 1024  # measured: a gain at 576, a loss at 4096 (module doc); 1024 covers 0.5B-class models


@jit
def _running_sum(X, Res, ks, K, HAS_RES: tl.constexpr):
    """(x + residual)[ks] rounded to the activation dtype, in fp32 (x alone without a residual); 0 past K."""
    s = tl.load(X + ks, mask=ks < K, other=0.0).to(tl.float32)
    if HAS_RES:
        s = (s + tl.load(Res + ks, mask=ks < K, other=0.0).to(tl.float32)).to(X.dtype.element_ty).to(tl.float32)
    return s


@jit
def _norm_gemv(X, Res, NormW, W, Bias, Out, SumOut, N, eps, K: tl.constexpr, HAS_RES: tl.constexpr,
               HAS_BIAS: tl.constexpr,
               EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LINE: tl.constexpr,
               PDL: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    _weights_first(W, cols, N, K, BLOCK_K, LINE, PDL)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        s = _running_sum(X, Res, k0 + tl.arange(0, BLOCK_K), K, HAS_RES)
        squares += s * s
    inv_rms = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
    dt = X.dtype.element_ty
    if HAS_RES:
        if tl.program_id(0) == 0:  # the running sum, written once
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                tl.store(SumOut + ks, _running_sum(X, Res, ks, K, HAS_RES).to(dt), mask=ks < K)
    w_rows = W + cols[:, None].to(tl.int64) * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        s = _running_sum(X, Res, ks, K, HAS_RES)
        gain = tl.load(NormW + ks, mask=ks < K, other=0.0).to(tl.float32)
        h = (gain * (s * inv_rms).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        if EVEN:  # no masks: the weight loads stay 16 bytes wide
            w = tl.load(w_rows + ks[None, :])
        else:
            w = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        acc += w.to(tl.float32) * h[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(Bias + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(Out + cols, out.to(dt), mask=cols < N)


def norm_gemv_wanted(x: torch.Tensor) -> bool:
    """The cheap half of norm_gemv_fits, asked first on every layer: switched on, one row, not deterministic mode."""
    opts = options.current()
    return opts.fused_norm_gemv and not opts.deterministic and x.dim() == 2 and x.shape[0] == 1


def norm_gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether norm_gemv serves this row: wanted, contiguous, on CUDA where gemv would serve the product."""
    return norm_gemv_wanted(x) and x.shape[1] <= NORM_GEMV_MAX_K and x.is_contiguous() and gemv_fits(x, weight)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [1, K] (residual None: x is the running sum itself); norm_weight: [K]; weight: [N, K]
    -> (RMSNorm(x + residual) @ weight^T + bias [1, N], the running sum x + residual [1, K]), in one launch. K is a
    launch constant (a model has a few widths), so the loops over it unroll."""
    n, k = weight.shape
    assert x.shape == (1, k) and x.is_contiguous() and norm_weight.is_contiguous()
    assert residual is None or (residual.shape == x.shape and residual.is_contiguous() and residual.dtype == x.dtype)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    running = torch.empty_like(x) if residual is not None else x
    # The large-weight tile at every size: each program's pass over the row does not shrink with its columns, and
    # gemv.py's small-weight tile (4 columns, 2 warps) ran SmolLM2's qkv and gate_up chains slower here (54.1 against
    # 52.9 and 84.6 against 77.7 us for 30 products; the decode graph 566 against 561 us, H200,
    # benchmarks/results/gemv_vec_tiles_small_h200.md).
    tile = VecTile(VEC_BLOCK_N, min(VEC_BLOCK_K, triton.next_power_of_2(k)), VEC_WARPS)
    _norm_gemv[(triton.cdiv(n, tile.block_n),)](
        x, residual if residual is not None else x, norm_weight, weight, bias if bias is not None else weight, out,
        running, n, eps, K=k, HAS_RES=residual is not None, HAS_BIAS=bias is not None,
        EVEN=n % tile.block_n == 0 and k % tile.block_k == 0, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        LINE=min(tile.block_k, 128 // x.element_size()), num_warps=tile.warps, num_stages=3, **pdl_args(x.device))
    return out, running


def norm_gemv_reference(x, residual, norm_weight, eps, weight, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_gemv's contract in eager torch: rms_norm then F.linear."""
    normed, running = rms_norm_reference(x, norm_weight, eps, residual)
    return torch.nn.functional.linear(normed, weight, bias), running
