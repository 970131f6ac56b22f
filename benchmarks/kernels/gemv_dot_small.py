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
from benchmarks.kernels.timing import graph_ms
from hyperdraft.options import RuntimeOptions, activated

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
TILES = list(itertools.product((16, 32), (64, 128, 256), (2, 4), (2, 4)))  # (BLOCK_N, BLOCK_K, warps, stages)


def sweep(rows: int) -> list[str]:
    weights = {s: [torch.randn(*s, dtype=torch.bfloat16, device="cuda") / 24 for _ in range(LAYERS)] for s in SHAPES}
    xs = {k: torch.randn(rows, k, dtype=torch.bfloat16, device="cuda") for _, k in SHAPES}
    outs = {n: torch.empty(rows, n, dtype=torch.bfloat16, device="cuda") for n, _ in SHAPES}
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
    engine = next(r for r in results if r[1] == ENGINE_DOT_TILE and not r[2])
    lines = [f"## {rows} rows: chains of {LAYERS} products a shape (us)", "",
             "| tile (N, K, warps, stages) | swap | " + " | ".join(f"{n}x{k}" for n, k in SHAPES) + " | sum |",
             "|---|---|" + "---|" * (len(SHAPES) + 1)]
    for total, tile, swap, per_shape in results[:12] + ([engine] if engine not in results[:12] else []):
        mark = " (engine)" if (tile, swap) == (ENGINE_DOT_TILE, False) else ""
        lines.append(f"| {tile}{mark} | {swap} | " + " | ".join(f"{us:.1f}" for us in per_shape) + f" | {total:.1f} |")
    best = [min(results, key=lambda r: r[3][i]) for i in range(len(SHAPES))]
    lines += ["", "best per shape: " + ", ".join(f"{n}x{k} {r[1]} swap={r[2]} {r[3][i]:.1f} us"
                                                  for i, ((n, k), r) in enumerate(zip(SHAPES, best))), ""]
    return lines


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
