"""Per-projection GEMV timing: each shape of an 8B decoder's verify (qkv, o, gate_up, down, lm_head) at 1 and 6
rows: gemv() as the engine runs it, then kernels/gemv.py's `_gemv_dot` at a list of tensor-core tile configurations.

Each measurement chains `copies` products of one shape over distinct weights (nothing stays in L2) in one CUDA graph,
launched as the engine launches them (PDL on Hopper). Run on a GPU machine:

  python -m benchmarks.kernels.gemv_shapes [--out $OUT]     # prints a table, writes OUT/gemv_shapes_<device>.md
  python -m benchmarks.kernels.gemv_shapes --swapped       # `_gemv_dot` with swapped operands (SWAP) over its own
                                                           # tile list instead: OUT/gemv_swapped_<device>.md

The six-row engine column runs gemv_mma.cu where it fits (kernels/gemv.py). Results, with split-K, TMA and CUDA-core
variants that were tried and dropped: benchmarks/results/gemv_shapes_h100.md.
"""

from __future__ import annotations

import argparse
import os

import torch

import hyperdraft.kernels.gemv as gemv_module
from benchmarks.common import device_tag, require_cuda
from benchmarks.kernels.gemv_tiles import ENGINE_DOT_TILE, gemv_dot
from benchmarks.kernels.timing import graph_ms

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096), "head qkv": (6144, 8192), "head fc": (4096, 12288), "head lm_head": (32000, 4096)}
# (BLOCK_N, BLOCK_K, warps, stages); the first is the engine's `_gemv_dot` tile
CONFIGS = [ENGINE_DOT_TILE] + [c for c in [(32, 256, 4, 6), (16, 256, 4, 6), (16, 512, 4, 4), (32, 128, 4, 6),
                                           (32, 256, 4, 4), (64, 128, 4, 5), (32, 512, 4, 3), (16, 256, 2, 6),
                                           (32, 256, 8, 6)] if c != ENGINE_DOT_TILE]
SWAPPED = [(64, 128, 4, 4), (64, 128, 4, 6), (64, 256, 4, 3), (64, 64, 4, 8), (128, 64, 4, 6), (128, 128, 4, 3),
           (128, 128, 8, 4), (64, 128, 8, 4)]


def _copies(n: int, k: int, budget_bytes: float = 6e9) -> int:
    return max(4, min(32, int(budget_bytes // (n * k * 2))))


def time_shape(n: int, k: int, rows: int) -> float:
    """Microseconds per product of gemv() (the engine's dispatch)."""
    copies = _copies(n, k)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ms = graph_ms(lambda: [gemv_module.gemv(x, w) for w in weights], reps=10)
    weights.clear()
    torch.cuda.empty_cache()
    return 1000 * ms / copies


def time_dot(n: int, k: int, rows: int, tile, swap: bool = False) -> float:
    """Microseconds per product of `_gemv_dot` at `tile` (checked against F.linear first)."""
    copies = _copies(n, k)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)

    def run():
        for w in weights:
            gemv_dot(x, w, tile, swap=swap, out=out)

    ref = torch.nn.functional.linear(x.float(), weights[-1].float())  # run() leaves the last product in out
    run()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"_gemv_dot wrong at {tile} (swap={swap}): rel err {err}"
    ms = graph_ms(run, reps=10)
    weights.clear()
    torch.cuda.empty_cache()
    return 1000 * ms / copies


def main_swapped(out_dir: str) -> None:
    lines = ["| shape | N x K | 1 row (vec) us | 6 rows engine us | "
             + " | ".join(f"6 rows swapped {c} us" for c in SWAPPED) + " |",
             "|---|---|---|---|" + "---|" * len(SWAPPED)]
    for name, (n, k) in SHAPES.items():
        one, six = time_shape(n, k, 1), time_shape(n, k, 6)
        swapped = []
        for c in SWAPPED:
            try:
                swapped.append(f"{time_dot(n, k, 6, c, swap=True):.1f}")
            except Exception as e:  # a tile that does not compile (shared memory) is reported, not fatal
                swapped.append(f"fail ({type(e).__name__})")
        lines.append(f"| {name} | {n} x {k} | {one:.1f} | {six:.1f} | " + " | ".join(swapped) + " |")
        print(lines[-1], flush=True)
    with open(os.path.join(out_dir, f"gemv_swapped_{device_tag()}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.gemv_shapes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--swapped", action="store_true", help="time `_gemv_dot` with swapped operands over SWAPPED")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output directory (default: $OUT or .)")
    a = ap.parse_args()
    require_cuda()
    if a.swapped:
        return main_swapped(a.out)
    lines = ["| shape | N x K | 1 row (vec) us | 6 rows engine us | "
             + " | ".join(f"6 rows dot {c} us" for c in CONFIGS) + " |", "|---|---|---|---|" + "---|" * len(CONFIGS)]
    for name, (n, k) in SHAPES.items():
        one, engine = time_shape(n, k, 1), time_shape(n, k, 6)
        gb = n * k * 2 / 1e3
        six = []
        for c in CONFIGS:
            try:
                t = time_dot(n, k, 6, c)
                six.append(f"{t:.1f} ({gb / t:.0f})")
            except Exception as e:  # a tile that does not compile (shared memory) is reported, not fatal
                six.append(f"fail ({type(e).__name__})")
        lines.append(f"| {name} | {n} x {k} | {one:.1f} ({gb / one:.0f} GB/s) | {engine:.1f} ({gb / engine:.0f}) | "
                     + " | ".join(six) + " |")
        print(lines[-1], flush=True)
    with open(os.path.join(a.out, f"gemv_shapes_{device_tag()}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
