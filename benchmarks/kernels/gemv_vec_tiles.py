"""Tile sweep of kernels/gemv.py's one-row kernel `_gemv_vec` over a batch-1 decode's chain of products, with PDL, as
one CUDA graph: the Qwen3.5-9B hybrid's 32 layers (24 Gated DeltaNet: in_proj 12352x4096, out_proj 4096x4096; 8
gated attention: qkv 10240x4096, o 4096x4096; every layer gate_up 24576x4096, down 4096x12288) and, for comparison,
Llama-3.1-8B's (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336). Distinct weights per layer (no
L2 reuse). Reports each tile's chain time and its weight-streaming rate against a device copy.

  python -m benchmarks.kernels.gemv_vec_tiles [--out $OUT]
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch

from benchmarks.common import device_tag, require_cuda
from benchmarks.e2e.hybrid_bench import bandwidth
from benchmarks.kernels.timing import graph_ms
from hyperdraft.kernels import gemv as gemv_module
from hyperdraft.options import RuntimeOptions, activated

CHAINS = {
    "qwen3.5-9b": [(12352, 4096), (4096, 4096), (24576, 4096), (4096, 12288)] * 3
    + [(10240, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],  # x 8: 3 GDN layers, then attention
    "llama-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] * 4,
}
REPEATS = 8  # the chain above, 8 times: 32 layers
TILES = [(n, k, w, s) for n, k, w, s in itertools.product((4, 8, 16), (1024, 2048, 4096), (4, 8), (2, 3, 4))
         if n * k <= 65536]


def launch(x, w, out, tile) -> None:
    import triton

    block_n, block_k, warps, stages = tile
    n, k = w.shape
    gemv_module._gemv_vec[(triton.cdiv(n, block_n),)](
        x, x, w, w, out, out, n, k, GATED=False, HAS_BIAS=False, HAS_RES=False, EVEN=n % block_n == 0 and k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, LINE=min(block_k, 64), num_warps=warps, num_stages=stages,
        **gemv_module.pdl_args(x.device))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.gemv_vec_tiles", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    require_cuda()
    engine_tile = (gemv_module.VEC_BLOCK_N, gemv_module.VEC_BLOCK_K, gemv_module.VEC_WARPS, 3)
    bw = bandwidth()  # eager copies, as hybrid_bench measures it (a graph-captured copy measured 2713 against 4233 GB/s)
    lines = [f"# `_gemv_vec` tiles on {torch.cuda.get_device_name()}", "",
             f"Copy bandwidth {bw / 1e9:.0f} GB/s. Engine tile (BLOCK_N, BLOCK_K, warps, stages) = {engine_tile}. "
             "Command: `python -m benchmarks.kernels.gemv_vec_tiles`.", ""]
    with activated(RuntimeOptions(pdl=True)):
        for name, chain in CHAINS.items():
            weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / 64 for n, k in chain * REPEATS]
            xs = {k: torch.randn(1, k, dtype=torch.bfloat16, device="cuda") for _, k in chain}
            outs = [torch.empty(1, w.shape[0], dtype=torch.bfloat16, device="cuda") for w in weights]
            nbytes = sum(w.numel() * 2 for w in weights)
            rows = []
            for tile in TILES:
                ms = graph_ms(lambda: [launch(xs[w.shape[1]], w, o, tile) for w, o in zip(weights, outs)])
                rows.append((ms, tile))
            rows.sort()
            engine_ms = next(ms for ms, t in rows if t == engine_tile)
            lines += [f"## {name}: {len(weights)} products, {nbytes / 1e9:.2f} GB", "",
                      "| tile (N, K, warps, stages) | chain ms | of copy bandwidth | vs engine tile |", "|---|---|---|---|"]
            lines += [f"| {t} | {ms:.3f} | {nbytes / (ms / 1e3) / bw:.1%} | {engine_ms / ms:.3f}x |" for ms, t in rows[:12]]
            lines += [f"| engine {engine_tile} | {engine_ms:.3f} | {nbytes / (engine_ms / 1e3) / bw:.1%} | 1.000x |", ""]
            weights.clear()
            torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, f"gemv_vec_tiles_{device_tag()}.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
