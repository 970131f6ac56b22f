"""Per-projection GEMV timing: each shape of an 8B decoder's verify (qkv, o, gate_up, down, lm_head) at 1 and 6
rows, for a list of tensor-core tile configurations of kernels/gemv.py's `_gemv_dot`.

Each measurement chains `copies` products of one shape over distinct weights (nothing stays in L2) in one CUDA graph,
launched as the engine launches them (PDL on Hopper). Run on a GPU machine:
PYTHONPATH=. python3 benchmarks/gemv_shapes.py ; prints a table (and writes $OUT/gemv_shapes.md).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hyperdraft.kernels.gemv as gemv_module  # noqa: E402
from benchmarks.graph_timing import graph_ms  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
# (BLOCK_N, BLOCK_K, warps, stages); the first is the engine's
CONFIGS = [(32, 256, 4, 6), (16, 256, 4, 6), (16, 512, 4, 4), (32, 128, 4, 6), (32, 256, 4, 4), (64, 128, 4, 5),
           (32, 512, 4, 3), (16, 256, 2, 6), (32, 256, 8, 6)]


def time_shape(n: int, k: int, rows: int, config=None, budget_bytes: float = 6e9) -> float:
    """Microseconds per product."""
    copies = max(4, min(32, int(budget_bytes // (n * k * 2))))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    saved = (gemv_module.DOT_BLOCK_N, gemv_module.DOT_BLOCK_K, gemv_module.DOT_WARPS, gemv_module.DOT_STAGES)
    if config is not None:
        gemv_module.DOT_BLOCK_N, gemv_module.DOT_BLOCK_K, gemv_module.DOT_WARPS, gemv_module.DOT_STAGES = config
    try:
        ms = graph_ms(lambda: [gemv_module.gemv(x, w) for w in weights], reps=10)
    finally:
        gemv_module.DOT_BLOCK_N, gemv_module.DOT_BLOCK_K, gemv_module.DOT_WARPS, gemv_module.DOT_STAGES = saved
    weights.clear()
    torch.cuda.empty_cache()
    return 1000 * ms / copies


def main() -> None:
    lines = ["| shape | N x K | 1 row (vec) us | " + " | ".join(f"6 rows {c} us" for c in CONFIGS) + " |",
             "|---|---|---|" + "---|" * len(CONFIGS)]
    for name, (n, k) in SHAPES.items():
        one = time_shape(n, k, 1)
        six = [time_shape(n, k, 6, c) for c in CONFIGS]
        gb = n * k * 2 / 1e3
        lines.append(f"| {name} | {n} x {k} | {one:.1f} ({gb / one:.0f} GB/s) | "
                     + " | ".join(f"{t:.1f} ({gb / t:.0f})" for t in six) + " |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    with open(os.path.join(os.environ.get("OUT", "."), "gemv_shapes.md"), "w") as f:
        f.write(text + "\n")




# ---- experiment: the weight tiles through TMA (host-built tensor descriptors) ----------------------------------------
try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def _gemv_dot_tma(X, w_desc, Out, M, N, K, stride_xm, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr):
        n0 = tl.program_id(0) * BLOCK_N
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.arange(0, 16)
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=rows[:, None] < M, other=0.0)
            w = w_desc.load([n0, k0])
            acc += tl.dot(x, tl.trans(w))
        cols = n0 + tl.arange(0, BLOCK_N)
        tl.store(Out + rows[:, None] * N + cols[None, :], acc.to(Out.dtype.element_ty), mask=rows[:, None] < M)

    def gemv_tma(x, w, block_n, block_k, warps, stages):
        m, k = x.shape
        n = w.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        desc = TensorDescriptor.from_tensor(w, [block_n, block_k])
        _gemv_dot_tma[(triton.cdiv(n, block_n),)](x, desc, out, m, n, k, x.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                                  PDL=True, launch_pdl=True, num_warps=warps, num_stages=stages)
        return out
except ImportError:
    gemv_tma = None


def time_tma(n: int, k: int, rows: int, config, budget_bytes: float = 6e9) -> float:
    copies = max(4, min(32, int(budget_bytes // (n * k * 2))))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(gemv_tma(x, weights[0], *config), torch.nn.functional.linear(x, weights[0]),
                               atol=2e-2, rtol=2e-2)
    ms = graph_ms(lambda: [gemv_tma(x, w, *config) for w in weights], reps=10)
    weights.clear()
    torch.cuda.empty_cache()
    return 1000 * ms / copies


TMA_CONFIGS = [(32, 256, 4, 6), (32, 128, 4, 8), (64, 128, 4, 6), (32, 256, 4, 4), (16, 256, 4, 8), (64, 64, 4, 8)]


def main_tma() -> None:
    lines = ["| shape | " + " | ".join(f"6 rows TMA {c} us" for c in TMA_CONFIGS) + " |", "|---|" + "---|" * len(TMA_CONFIGS)]
    for name, (n, k) in SHAPES.items():
        gb = n * k * 2 / 1e3
        times = []
        for c in TMA_CONFIGS:
            try:
                times.append(f"{time_tma(n, k, 6, c):.1f}")
            except Exception as e:  # an unsupported tile shows as the error's type
                times.append(type(e).__name__)
        lines.append(f"| {name} ({gb / 1e3:.0f} MB) | " + " | ".join(times) + " |")
        print(lines[-1], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "gemv_shapes_tma.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main_tma() if "--tma" in sys.argv else main()
