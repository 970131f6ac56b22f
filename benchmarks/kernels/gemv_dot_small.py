"""Tile sweep of kernels/gemv.py's few-row tensor-core kernel `_gemv_dot` on a small model's products (a verify of
2..16 rows on SmolLM2-135M: qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, none served by gemv_mma.cu).
At 32 columns a program the 576-wide products launch 18 programs on a 132-SM GPU; this measures what narrower
tiles, shallower pipelines and the swapped operands buy. Each shape: a chain of 30 distinct weights in one CUDA graph,
PDL on, at --rows rows.

  python -m benchmarks.kernels.gemv_dot_small [--rows 2 6] [--out $OUT]
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch

from benchmarks.common import device_tag, require_cuda
from benchmarks.kernels.gemv_tiles import ENGINE_DOT_TILE, gemv_dot
from benchmarks.kernels.timing import graph_ms, shape_table
from hyperdraft.options import RuntimeOptions, activated

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
TILES = list(itertools.product((16, 32), (64, 128, 256), (2, 4), (2, 4)))  # (BLOCK_N, BLOCK_K, warps, stages)
# Long K steps: one step for the 576-wide products at 1024, for down (K 1536) at 2048. A latency-bound one-row
# product gained most from one K step (kernels/gemv.py SMALL_VEC_ONE_STEP_K); whether a few-row one does is open.
TILES += [(n, k, 4, s) for n, k, s in itertools.product((16, 32), (512, 1024, 2048), (1, 2))]


def sweep(num_rows: int) -> list[str]:
    weights = {s: [torch.randn(*s, dtype=torch.bfloat16, device="cuda") / 24 for _ in range(LAYERS)] for s in SHAPES}
    xs = {k: torch.randn(num_rows, k, dtype=torch.bfloat16, device="cuda") for _, k in SHAPES}
    outs = {n: torch.empty(num_rows, n, dtype=torch.bfloat16, device="cuda") for n, _ in SHAPES}
    results = []
    for tile, swap in itertools.product(TILES + [ENGINE_DOT_TILE], (False, True)):
        try:
            gemv_dot(xs[576], weights[(576, 576)][0], tile, swap, outs[576])
        except Exception as e:  # a tile the compiler rejects (shared memory, layout) is left out
            print(f"{tile} swap={swap}: {type(e).__name__}")
            continue
        per_shape = [graph_ms(lambda s=s: [gemv_dot(xs[s[1]], w, tile, swap, outs[s[0]]) for w in weights[s]]) * 1e3
                     for s in SHAPES]
        results.append((sum(per_shape), tile, swap, per_shape))
    results.sort()
    mark = " (large weights' tile)"
    labelled = [(total, f"{tile}{mark if (tile, swap) == (ENGINE_DOT_TILE, False) else ''} swap={swap}", per_shape)
                for total, tile, swap, per_shape in results]
    large = next(r for r in labelled if mark in r[1])
    shown = labelled[:12] + ([large] if large not in labelled[:12] else [])
    lines = [f"## {num_rows} rows: chains of {LAYERS} products a shape (us)", "",
             "tile = (BLOCK_N, BLOCK_K, warps, stages); total = the sum over the shapes; the 12 best, then the tile "
             "larger weights take", ""]
    return lines + shape_table(SHAPES, shown, best_of=labelled)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.gemv_dot_small", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 6])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    require_cuda()
    lines = [f"# `_gemv_dot` tiles on SmolLM2's products ({torch.cuda.get_device_name()})", "",
             f"Command: `python -m benchmarks.kernels.gemv_dot_small --rows {' '.join(map(str, a.rows))}`.", ""]
    with activated(RuntimeOptions(pdl=True)):
        for rows in a.rows:
            lines += sweep(rows)
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, f"gemv_dot_small_{device_tag()}.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
