"""Per-projection GEMV timing: each shape of an 8B decoder's verify (qkv, o, gate_up, down, lm_head) at 1 and 6
rows, for a list of tensor-core tile configurations of kernels/gemv.py's `_gemv_dot`.

Each measurement chains `copies` products of one shape over distinct weights (nothing stays in L2) in one CUDA graph,
launched as the engine launches them (PDL on Hopper). Run on a GPU machine:
PYTHONPATH=. python3 benchmarks/gemv_shapes.py ; prints a table (and writes $OUT/gemv_shapes.md); `--swapped` times
the six-row kernel with swapped operands (SWAP) over its own tile list instead. Results, with split-K, TMA and
CUDA-core variants that were tried and dropped: benchmarks/results/gemv_shapes_h100.md.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hyperdraft.kernels.gemv as gemv_module  # noqa: E402
from benchmarks.graph_timing import graph_ms  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096), "head qkv": (6144, 8192), "head fc": (4096, 12288), "head lm_head": (32000, 4096)}
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


def time_swapped(n: int, k: int, rows: int, config, budget_bytes: float = 6e9) -> float:
    """Microseconds per product of `_gemv_dot` with swapped operands (SWAP) at tile config."""
    import triton

    block_n, block_k, warps, stages = config
    copies = max(4, min(32, int(budget_bytes // (n * k * 2))))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    pdl = gemv_module.pdl_args(x.device)

    def run():
        for w in weights:
            gemv_module._gemv_dot[(triton.cdiv(n, block_n),)](
                x, w, w, out, out, rows, n, k, x.stride(0), out.stride(0), out.stride(0), HAS_BIAS=False,
                HAS_RES=False, IEEE=False, SWAP=True,
                EVEN=n % block_n == 0 and k % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, LINE=64,
                num_warps=warps, num_stages=stages, **pdl)

    ref = torch.nn.functional.linear(x.float(), weights[-1].float())  # run() leaves the last product in out
    run()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"swapped kernel wrong at {config}: rel err {err}"
    ms = graph_ms(run, reps=10)
    weights.clear()
    torch.cuda.empty_cache()
    return 1000 * ms / copies


SWAPPED = [(64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3), (64, 64, 4, 8), (128, 64, 4, 6), (128, 128, 4, 3),
           (128, 128, 8, 4), (64, 128, 8, 4)]


def main_swapped() -> None:
    lines = ["| shape | N x K | 1 row (vec) us | 6 rows engine us | "
             + " | ".join(f"6 rows swapped {c} us" for c in SWAPPED) + " |", "|---|---|---|---|" + "---|" * len(SWAPPED)]
    for name, (n, k) in SHAPES.items():
        one, six = time_shape(n, k, 1), time_shape(n, k, 6)
        swapped = []
        for c in SWAPPED:
            try:
                swapped.append(f"{time_swapped(n, k, 6, c):.1f}")
            except Exception as e:  # a tile that does not compile (shared memory) is reported, not fatal
                swapped.append(f"fail ({type(e).__name__})")
        lines.append(f"| {name} | {n} x {k} | {one:.1f} | {six:.1f} | " + " | ".join(swapped) + " |")
        print(lines[-1], flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "gemv_swapped.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    if "--swapped" in sys.argv:
        return main_swapped()
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


if __name__ == "__main__":
    main()
