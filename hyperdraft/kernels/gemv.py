"""x @ W^T (+ bias, + a residual) for a few rows (decode, verify: M <= 16 tokens) as weight-streaming kernels.

At a handful of rows a projection only reads W once, so its time is W's bytes over the memory bandwidth. cuBLAS
streams the small projections of an 8B decoder at 68-80% of the copy bandwidth on an H100, and every product
boundary drains the GPU. Here each program owns a few output columns and walks K in long steps (tens of KB of
weights in flight per program, hundreds of programs); before waiting on the previous kernel (kernels/pdl.py) it
asks L2 for its first weight tile, so the weight stream does not stop between kernels. One row runs on CUDA
cores (`_gemv_vec`); 2..16 rows on tensor cores (per-row FMAs would be compute-bound there): `gemv_mma.cu` where
it fits (bf16/fp16, K a multiple of 1024, 16-column weight blocks, a GPU it was measured on; its weight operands go
from global memory straight into MMA registers, 2-3% faster than `_gemv_dot` on an 8B layer's shapes,
benchmarks/results/gemv_shapes_h100.md), else `_gemv_dot` over the rows padded to 16 (cp.async tiles in shared
memory). Measured on an 8B layer chain: benchmarks/results/pdl_chain_h100.md.

Batch invariance within each kernel: a row's result depends only on that row (the MMA forms each output from its
own weight row and x row; the dot kernel always pads to 16 rows, so its accumulation order is fixed), and which
kernel runs depends on the weight, not the row count, so a token gets bit-identical projections in any verify of
2..16 rows. The reference is F.linear (another summation order: equal up to rounding).

Across row counts the kernels differ (one row sums on CUDA cores, more rows on tensor cores, past 16 rows cuBLAS
picks its own tiles and split-K from M). Deterministic mode (`invariant_linear`, RuntimeOptions.deterministic)
therefore runs every product, one row to a whole prefill chunk, as the dot kernel over 16-row tiles: one kernel and
one tile shape per weight, so a row's K products are summed in the same order whatever M is.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

import hyperdraft.kernels as kernels
from hyperdraft import options
from hyperdraft.kernels import cuda_kernels
from hyperdraft.kernels._triton import jit, tl, triton
from hyperdraft.kernels.pdl import pdl_args, pdl_enabled, pdl_wait

MAX_ROWS = 16
MMA_K_MULTIPLE = 1024  # gemv_mma.cu: 4 warps split K, each in batches of 8 chunks of 32
# One row: a vector kernel, 8 output columns x 1024-wide K steps per program on 4 warps (CUDA-core FMAs keep up
# with the weight stream at one row, not at several). On an H200 that tile streamed a 32-layer chain of the 9B hybrid's
# products 5.2% faster than 8 x 2048 on 8 warps (3.384 against 3.560 ms for 13.8 GB), and Llama-8B's 5.0%
# (benchmarks/results/gemv_vec_tiles_h200.md); it is also among the best on both. 2..16 rows: tensor cores,
# gemv_mma.cu or else (below) a Triton kernel over the rows padded to 16.
VEC_BLOCK_N, VEC_BLOCK_K, VEC_WARPS = 8, 1024, 4
# Small weights (a 135M-0.5B model's products, a few hundred KB to 17 MB) are latency-bound, not bandwidth-bound: 72
# programs of 8 columns leave half an H200 idle on SmolLM2's 576-wide products. 4 columns on 2 warps (twice the
# programs, each as quick) ran SmolLM2-135M's 120 one-row products in 216 against 280 us and Qwen2.5-0.5B's 96 in 362
# against 468 (36 tiles swept; H200, benchmarks/results/gemv_vec_tiles_small_h200.md). In SmolLM2's decode graph: 680
# -> 596 us a step with every product here (norm unfused), ~1 us with the norm fused (norm_gemv keeps the large tile,
# measured better for it; only o and down come here). The 8B-class products (16.8M weights and up) keep the tile above.
SMALL_VEC_BLOCK_N, SMALL_VEC_WARPS, SMALL_VEC_MAX_WEIGHTS = 4, 2, 10_000_000
# A small weight's K from 1025 to 2048 is one K step (padded to 2048) of 8 columns on 4 warps, not two dependent
# 1024-wide steps of 4: a latency-bound program's second step is a second memory round trip. SmolLM2's down (K = 1536,
# SiLU(gate) * up formed in the program) took its decode graph from 527 to 473 us a step on an H200, in three runs
# (benchmarks/results/plain_step_h200.md). 4 columns in one step: 527 (from 560); 2 columns: 538; 4 columns on 8 warps:
# 545; three unmasked 512-wide steps: 576. Why 8 columns beat 4 by this much (72 programs against 144, on 132 SMs)
# is not pinned down; the isolated-chain sweep (gemv_vec_tiles --small) does not show it, the graph does.
SMALL_VEC_ONE_STEP_K, SMALL_VEC_ONE_STEP_BLOCK_N, SMALL_VEC_ONE_STEP_WARPS = 2048, 8, 4
DOT_BLOCK_N, DOT_BLOCK_K, DOT_WARPS, DOT_STAGES = 32, 256, 4, 6
# Where 32-column tiles make between one and two waves of programs, the second wave runs mostly empty: wider tiles
# (half the programs) with the operands swapped (W is the MMA's 64-row operand) measured 19.0 us against 20.5 for
# a 6144 x 4096 qkv product at 6 rows on an H100, 19.8 unswapped (benchmarks/results/gemv_shapes_h100.md); every
# other 8B shape is best at the default.
WIDE_BLOCK_N, WIDE_BLOCK_K, WIDE_STAGES = 64, 256, 3
# Small weights (at most SMALL_DOT_MAX_WEIGHTS): 32-column tiles launch 18-96 programs on SmolLM2's products, and a
# 6-stage pipeline over a 576-wide K is mostly prologue. 4 stages with the weight as the wide operand, and 16 x 128
# tiles where both sides are at most 1024 (twice the programs), ran SmolLM2's 120 products of a verify in ~320 against
# 371 us at 2 and at 6 rows (50 tiles swept), and its batch-4 decode graph in 691 against 730 us (H200,
# benchmarks/results/gemv_dot_small_h200.md).
SMALL_DOT_MAX_WEIGHTS, SMALL_DOT_STAGES = 2_000_000, 4
NARROW_DOT_SIDE, NARROW_DOT_BLOCK_N, NARROW_DOT_BLOCK_K = 1024, 16, 128


@jit
def _l2_prefetch(ptrs):
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@jit
def _weights_first(W, cols, N, K, BLOCK_K: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr):
    """Ask L2 for this program's first weight tile (weights never depend on the previous kernel), then wait."""
    if PDL:
        lines = tl.minimum(tl.arange(0, BLOCK_K // LINE) * LINE, K - 1)
        _l2_prefetch(W + tl.minimum(cols, N - 1)[:, None].to(tl.int64) * K + lines[None, :])
    pdl_wait(PDL)


@jit
def _add_residual(out, res_ptrs, mask, DTYPE: tl.constexpr):
    """out + residual, rounded as eager torch rounds `F.linear(x, W) + residual`: the product to the activation
    dtype first, then the sum (bit-identical to the two launches it replaces)."""
    return out.to(DTYPE).to(tl.float32) + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)


@jit
def _x_chunk(X, Up, ks, K, GATED: tl.constexpr, EVEN: tl.constexpr):
    """x[ks] in fp32; GATED: SiLU(x[ks]) * up[ks], rounded as kernels/activation.py's silu_mul rounds it (the SiLU to
    the activation dtype, then the product), so the product sees bit for bit the input silu_mul would have written."""
    if EVEN:  # no masks: the loads stay 16 bytes wide
        x = tl.load(X + ks).to(tl.float32)
    else:
        x = tl.load(X + ks, mask=ks < K, other=0.0).to(tl.float32)
    if GATED:
        if EVEN:
            u = tl.load(Up + ks).to(tl.float32)
        else:
            u = tl.load(Up + ks, mask=ks < K, other=0.0).to(tl.float32)
        dt = X.dtype.element_ty
        act = (x / (1.0 + tl.exp(-x))).to(dt).to(tl.float32)
        x = (act * u).to(dt).to(tl.float32)
    return x


@jit
def _gemv_vec(X, Up, W, Bias, Res, Out, N, K, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
              EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    _weights_first(W, cols, N, K, BLOCK_K, LINE, PDL)
    w_rows = W + cols[:, None].to(tl.int64) * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            w = tl.load(w_rows + ks[None, :])
        else:
            w = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        acc += w.to(tl.float32) * _x_chunk(X, Up, ks, K, GATED, EVEN)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(Bias + cols, mask=cols < N, other=0.0).to(tl.float32)
    if HAS_RES:
        out = _add_residual(out, Res + cols, cols < N, X.dtype.element_ty)
    tl.store(Out + cols, out.to(X.dtype.element_ty).to(Out.dtype.element_ty), mask=cols < N)


@jit(do_not_specialize=("M",))
def _gemv_dot(X, W, Bias, Res, Out, M, N, K, stride_xm, stride_rm, stride_om, HAS_BIAS: tl.constexpr,
              HAS_RES: tl.constexpr, EVEN: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr):
    """Out tile [16, BLOCK_N] = X [16, K] @ W tile^T, rows padded to 16; SWAP computes its transpose, W tile @ X^T
    ([BLOCK_N, 16]: the weight is then the MMA's wide operand), the same products in another tile order."""
    # Row tiles vary fastest: the programs of one column tile run together and share its weights through L2.
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    _weights_first(W, cols, N, K, BLOCK_K, LINE, PDL)
    rows = tl.program_id(0) * 16 + tl.arange(0, 16)  # padded: a row's result never depends on how many others there are
    w_rows = W + cols[:, None].to(tl.int64) * K
    if SWAP:
        acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    else:
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        if EVEN:
            w = tl.load(w_rows + ks[None, :])
        else:
            w = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        if IEEE:  # fp32 stays fp32 (no TF32), as F.linear computes it by default
            if SWAP:
                acc += tl.dot(w, tl.trans(x), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            if SWAP:
                acc += tl.dot(w, tl.trans(x))
            else:
                acc += tl.dot(x, tl.trans(w))
    if SWAP:
        out = tl.trans(acc)
    else:
        out = acc
    if HAS_BIAS:
        out += tl.load(Bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_RES:
        out = _add_residual(out, Res + rows[:, None] * stride_rm + cols[None, :],
                            (rows[:, None] < M) & (cols[None, :] < N), X.dtype.element_ty)
    tl.store(Out + rows[:, None] * stride_om + cols[None, :], out.to(X.dtype.element_ty).to(Out.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1 << 30  # the interpreter: no waves to fill
    return torch.cuda.get_device_properties(device).multi_processor_count


def gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether gemv serves this product: CUDA, <= MAX_ROWS rows, row-major weight, no autograd."""
    # RuntimeOptions.gemv off keeps cuBLAS for every product (A/B measurements); so does fused_kernels off.
    return (invariant_fits(x, weight) and options.current().gemv and 0 < x.numel() <= MAX_ROWS * weight.shape[-1]
            and x.stride(-1) == 1)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [..., K] with at most MAX_ROWS rows; weight: [N, K] contiguous -> x @ weight^T + bias (+ residual, [..., N]
    in x's dtype, added in the same launch), [..., N]. The result is rounded to x's dtype, then stored as out_dtype
    (float32 logits: `.float()` of the product without its own launch)."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    assert m <= MAX_ROWS and rows.stride(-1) == 1
    assert residual is None or out_dtype in (None, x.dtype)
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    res = residual.reshape(m, n) if residual is not None else out  # a placeholder pointer when there is none
    assert residual is None or (res.stride(-1) == 1 and res.dtype == x.dtype)
    if m == 1:
        _launch_vec(rows, None, weight, bias, res if residual is not None else None, out)
    elif mma_fits(rows, weight, bias):
        _launch_mma(rows, weight, bias, residual is not None, res, out)
    else:
        _launch_dot(rows, weight, bias, residual is not None, res, out)
    return out.view(*x.shape[:-1], n)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """gemv's product for any row count, batch-invariant: every row goes through the dot kernel's 16-row tiles, so
    a row's result is bit for bit the same alone, in a verify or in a prefill chunk (deterministic mode)."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    assert residual is None or out_dtype in (None, x.dtype)
    res = residual.reshape(m, n) if residual is not None else out
    assert residual is None or (res.stride(-1) == 1 and res.dtype == x.dtype)
    if m > 0:
        _launch_dot(rows, weight, bias, residual is not None, res, out)
    return out.view(*x.shape[:-1], n)


def invariant_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether invariant_linear serves this product (and, with a row bound, gemv): CUDA with the fused kernels, a
    row-major weight of x's width and dtype, no autograd."""
    width = weight.shape[-1]
    return (kernels.use_fused_kernels(x) and x.shape[-1] == width and weight.dim() == 2 and weight.is_contiguous()
            and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and not ((x.requires_grad or weight.requires_grad) and torch.is_grad_enabled()))


class DotTile(NamedTuple):
    """The dot kernel's tile: columns a program, its K step (bf16; fp32 halves it), pipeline stages, and whether the
    weight is the MMA's wide operand (SWAP)."""

    block_n: int
    block_k: int
    stages: int
    swap: bool


def dot_tile(n: int, k: int, sms: int) -> DotTile:
    """The dot kernel's tile for an [n, k] weight: a function of the weight (and the GPU) only, so batch invariance
    holds."""
    if n * k <= SMALL_DOT_MAX_WEIGHTS:
        if max(n, k) <= NARROW_DOT_SIDE:
            return DotTile(NARROW_DOT_BLOCK_N, NARROW_DOT_BLOCK_K, SMALL_DOT_STAGES, True)
        return DotTile(DOT_BLOCK_N, DOT_BLOCK_K, SMALL_DOT_STAGES, True)
    if sms < triton.cdiv(n, DOT_BLOCK_N) < 2 * sms:
        return DotTile(WIDE_BLOCK_N, WIDE_BLOCK_K, WIDE_STAGES, True)
    return DotTile(DOT_BLOCK_N, DOT_BLOCK_K, DOT_STAGES, False)


def _launch_dot(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, has_res: bool,
                res: torch.Tensor, out: torch.Tensor) -> None:
    """The dot kernel over ceil(m / 16) row tiles; its tiles depend on the weight (and the GPU) only."""
    m, k = rows.shape
    n = weight.shape[0]
    line = 128 // rows.element_size()
    tile = dot_tile(n, k, _num_sms(rows.device))
    # fp32 tiles take twice the shared memory per pipeline stage: half the K step keeps the stages in 228 KB
    block_k = min(tile.block_k // rows.element_size() * 2, max(16, triton.next_power_of_2(k)))
    _gemv_dot[(triton.cdiv(m, 16), triton.cdiv(n, tile.block_n))](
        rows, weight, bias if bias is not None else weight, res, out, m, n, k, rows.stride(0), res.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, HAS_RES=has_res, IEEE=rows.dtype == torch.float32, SWAP=tile.swap,
        EVEN=n % tile.block_n == 0 and k % block_k == 0, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        LINE=min(block_k, line), num_warps=DOT_WARPS, num_stages=tile.stages, **pdl_args(rows.device))


class VecTile(NamedTuple):
    """A one-row kernel's tile (_gemv_vec, norm_gemv's _norm_gemv): columns a program, its K step, warps."""

    block_n: int
    block_k: int
    warps: int


def vec_tile(n: int, k: int) -> VecTile:
    """The one-row tile for an [n, k] weight: a function of the weight only (module doc, batch invariance)."""
    block_k = min(VEC_BLOCK_K, triton.next_power_of_2(k))
    if n * k <= SMALL_VEC_MAX_WEIGHTS:
        if VEC_BLOCK_K < k <= SMALL_VEC_ONE_STEP_K:
            return VecTile(SMALL_VEC_ONE_STEP_BLOCK_N, SMALL_VEC_ONE_STEP_K, SMALL_VEC_ONE_STEP_WARPS)
        return VecTile(SMALL_VEC_BLOCK_N, block_k, SMALL_VEC_WARPS)
    return VecTile(VEC_BLOCK_N, block_k, VEC_WARPS)


def _launch_vec(x: torch.Tensor, up: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor | None, out: torch.Tensor) -> None:
    """One row: out = x @ weight^T (+ bias, + residual); with `up`, x is SiLU(x) * up first (GATED)."""
    n, k = weight.shape
    tile = vec_tile(n, k)
    _gemv_vec[(triton.cdiv(n, tile.block_n),)](
        x, up if up is not None else x, weight, bias if bias is not None else weight,
        residual if residual is not None else out, out, n, k, GATED=up is not None, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, EVEN=n % tile.block_n == 0 and k % tile.block_k == 0, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, LINE=min(tile.block_k, 128 // x.element_size()), num_warps=tile.warps, num_stages=3,
        **pdl_args(x.device))


def silu_mul_gemv_fits(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether silu_mul_gemv serves down(SiLU(gate) * up): one row (a batch-1 decode), as gemv_fits otherwise; never
    in deterministic mode (one row would then be summed unlike the same row among others)."""
    return (not options.current().deterministic and gate.dim() == 2 and gate.shape[0] == 1 and up.shape == gate.shape
            and up.dtype == gate.dtype and up.stride(-1) == 1 and gemv_fits(gate, weight))


def silu_mul_gemv(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> torch.Tensor:
    """gate, up: [1, I] (views into one gate/up projection output) -> (SiLU(gate) * up) @ weight^T (+ bias, +
    residual) [1, N] in one launch, bit for bit gemv(silu_mul(gate, up), ...): a batch-1 decode's MLP runs the
    activation inside the down projection instead of a launch of its own (32 per step of a 32-layer model)."""
    out = torch.empty(1, weight.shape[0], dtype=gate.dtype, device=gate.device)
    assert residual is None or (residual.dtype == gate.dtype and residual.is_contiguous())
    _launch_vec(gate, up, weight, bias, residual, out)
    return out


def mma_fits(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether gemv_mma.cu (kernels/cuda_kernels.py) runs this product of 2..16 rows: bf16/fp16, 16-column weight
    blocks, K in whole K splits, 16-byte aligned rows; else the Triton tensor-core kernel does. The conditions
    depend on the weight (and alignment) only, never on the row count, so a token gets the same kernel in any verify."""
    n, k = weight.shape
    return (rows.dtype in (torch.bfloat16, torch.float16) and n % 16 == 0 and k % MMA_K_MULTIPLE == 0
            and rows.stride(0) % 8 == 0 and rows.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and (bias is None or bias.stride(0) == 1) and cuda_kernels.module(rows.device) is not None)


def _launch_mma(rows, weight, bias, has_res: bool, res, out) -> None:
    m, k = rows.shape
    n = weight.shape[0]
    pdl = pdl_enabled(rows.device)
    flags = (bias is not None) | (has_res << 1) | ((out.dtype != rows.dtype) << 2) | (pdl << 3)
    name = f"gemv_mma_{'bf16' if rows.dtype == torch.bfloat16 else 'f16'}_rows{8 if m <= 8 else 16}"
    ptr = ctypes.c_void_p
    args = [ptr(rows.data_ptr()), ptr(weight.data_ptr()), ptr((bias if bias is not None else weight).data_ptr()),
            ptr(res.data_ptr()), ptr(out.data_ptr()), ctypes.c_int(m), ctypes.c_int(k), ctypes.c_int(rows.stride(0)),
            ctypes.c_int(res.stride(0)), ctypes.c_int(out.stride(0)), ctypes.c_int(flags)]
    cuda_kernels.module(rows.device).launch(name, n // 16, 128, args, torch.cuda.current_stream(rows.device), pdl)


def cuda_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The CUDA product (+ residual, as out_dtype): gemv for a few rows, cuBLAS (F.linear) otherwise; in deterministic
    mode the batch-invariant product for every row count."""
    if options.current().deterministic and invariant_fits(x, weight) and (residual is None or residual.dtype == x.dtype):
        return invariant_linear(x, weight, bias, residual, out_dtype)
    if gemv_fits(x, weight) and (residual is None or residual.dtype == x.dtype):
        return gemv(x, weight, bias, residual, out_dtype)
    return gemv_reference(x, weight, bias, residual, out_dtype)


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return finish_product(F.linear(x, weight, bias), residual, out_dtype)


def finish_product(out: torch.Tensor, residual: torch.Tensor | None, out_dtype: torch.dtype | None) -> torch.Tensor:
    """An eager product's epilogue, as the kernels fuse it: + residual (in the product's dtype), then as out_dtype."""
    out = out if residual is None else out + residual
    return out if out_dtype is None else out.to(out_dtype)
