"""Tile sweep of kernels/gemv.py's one-row kernel `_gemv_vec` over a batch-1 decode's chain of products, with PDL, as
one CUDA graph: the Qwen3.5-9B hybrid's 32 layers (24 Gated DeltaNet: in_proj 12352x4096, out_proj 4096x4096; 8
gated attention: qkv 10240x4096, o 4096x4096; every layer gate_up 24576x4096, down 4096x12288) and, for comparison,
Llama-3.1-8B's (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336). Distinct weights per layer (no
L2 reuse). Reports each tile's chain time and its weight-streaming rate against a device copy.

--small sweeps small models' layers instead (SMALL_CHAINS: SmolLM2-135M, Qwen2.5-0.5B), where a product is a few
hundred KB to 17 MB and its time is mostly latency, not bandwidth: each shape's own chain (one product a layer, the
best tile per shape) and the whole chain under one tile.

  python -m benchmarks.kernels.gemv_vec_tiles [--small] [--out $OUT]
"""

from __future__ import annotations

import argparse
import itertools
import os

import torch

from benchmarks.common import device_tag, require_cuda
from benchmarks.e2e.hybrid_bench import bandwidth
from benchmarks.kernels.timing import graph_ms, shape_table
from hyperdraft.kernels import gemv as gemv_module
from hyperdraft.options import RuntimeOptions, activated

CHAINS = {
    "qwen3.5-9b": [(12352, 4096), (4096, 4096), (24576, 4096), (4096, 12288)] * 3
    + [(10240, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],  # x 8: 3 GDN layers, then attention
    "llama-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] * 4,
}
REPEATS = 8  # the chain above, 8 times: 32 layers
SMALL_CHAINS = {  # a layer's one-row products (qkv, o, gate_up, down) and the model's layer count
    "smollm2-135m": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
    "qwen2.5-0.5b": ([(1152, 896), (896, 896), (9728, 896), (896, 4864)], 24),
}
GATED_SHAPE = 3  # down: a batch-1 decode forms SiLU(gate) * up inside it (gemv.silu_mul_gemv)
# 2048-wide steps: the engine's tile for small weights whose K is 1025-2048 (SmolLM2's down), one K step
SMALL_TILES = ([(n, k, w, 3) for n, k, w in itertools.product((1, 2, 4, 8), (256, 512, 1024), (1, 2, 4))]
               + [(n, 2048, w, 3) for n, w in itertools.product((4, 8), (4, 8))])
TILES = [(n, k, w, s) for n, k, w, s in itertools.product((4, 8, 16), (1024, 2048, 4096), (4, 8), (2, 3, 4))
         if n * k <= 65536]


def launch(x, w, out, tile, up=None) -> None:
    """x @ w^T at `tile`; with `up`, (SiLU(x) * up) @ w^T, as a batch-1 decode's down projection runs it."""
    import triton

    block_n, block_k, warps, stages = tile
    n, k = w.shape
    gemv_module._gemv_vec[(triton.cdiv(n, block_n),)](
        x, x if up is None else up, w, w, out, out, n, k, GATED=up is not None, HAS_BIAS=False, HAS_RES=False,
        EVEN=n % block_n == 0 and k % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k, LINE=min(block_k, 64),
        num_warps=warps, num_stages=stages, **gemv_module.pdl_args(x.device))


def sweep_small(name: str) -> list[str]:
    """A small model's products: per shape (one distinct weight a layer) and the whole chain, every small tile."""
    chain, repeats = SMALL_CHAINS[name]
    lines = [f"## {name}: per-shape chains of {repeats} products, then the whole chain (us)", ""]
    weights = {shape: [torch.randn(*shape, dtype=torch.bfloat16, device="cuda") / 24 for _ in range(repeats)]
               for shape in chain}
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16, device="cuda") for _, k in chain}
    outs = {n: torch.empty(1, n, dtype=torch.bfloat16, device="cuda") for n, _ in chain}
    ups = {shape: torch.randn(1, shape[1], dtype=torch.bfloat16, device="cuda") if i == GATED_SHAPE else None
           for i, shape in enumerate(chain)}
    large = (gemv_module.VEC_BLOCK_N, gemv_module.VEC_BLOCK_K, gemv_module.VEC_WARPS, 3)
    small = (gemv_module.SMALL_VEC_BLOCK_N, gemv_module.VEC_BLOCK_K, gemv_module.SMALL_VEC_WARPS, 3)
    marks = {large: " (engine, large weights)", small: " (engine, small weights)"}
    rows = []
    for tile in SMALL_TILES:
        try:
            launch(xs[chain[0][1]], weights[chain[0]][0], outs[chain[0][0]], tile)
        except Exception as e:  # a tile the compiler rejects (too few elements for the warps) is left out
            lines.append(f"- {tile}: {type(e).__name__}")
            continue
        per_shape = [graph_ms(lambda s=shape: [launch(xs[s[1]], w, outs[s[0]], tile, ups[s]) for w in weights[s]])
                     * 1e3 for shape in chain]
        whole = graph_ms(lambda: [launch(xs[s[1]], weights[s][i], outs[s[0]], tile, ups[s])
                                  for i in range(repeats) for s in chain]) * 1e3
        rows.append((whole, f"{tile}{marks.get(tile, '')}", per_shape))
    rows.sort()
    lines += ["tile = (BLOCK_N, BLOCK_K, warps, stages); total = the whole chain under that tile; the last shape "
              "(down) is the GATED product, SiLU(gate) * up formed inside it, as a batch-1 decode runs it", ""]
    lines += shape_table(chain, rows)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.gemv_vec_tiles", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--small", action="store_true",
                    help="small models' products (SMALL_CHAINS) instead of the 8B-class chains")
    a = ap.parse_args()
    require_cuda()
    if a.small:
        with activated(RuntimeOptions(pdl=True)):
            text = "\n".join([f"# `_gemv_vec` tiles on {torch.cuda.get_device_name()} (small models)", "",
                              "Command: `python -m benchmarks.kernels.gemv_vec_tiles --small`; one CUDA graph per "
                              "chain, PDL on, 30 replays.", ""]
                             + [line for name in SMALL_CHAINS for line in sweep_small(name)])
        print(text)
        with open(os.path.join(a.out, f"gemv_vec_tiles_small_{device_tag()}.md"), "w") as f:
            f.write(text + "\n")
        return
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
