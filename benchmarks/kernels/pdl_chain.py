"""Does programmatic dependent launch (PDL) close the batch-1 GEMV gap? An 8B-shaped decoder layer chain, 32 layers.

Each layer: RMSNorm -> qkv -> 4 small kernels standing in for RoPE, the K/V store, attention and its merge ->
o_proj -> RMSNorm(+residual) -> gate_up -> SiLU*up -> down, one token, distinct weights per layer (no L2 reuse),
captured as one CUDA graph. Variants: cuBLAS GEMMs (the engine today) against Triton GEMVs, each without and with
PDL (every kernel launched with the programmatic-serialisation attribute, waiting on `griddepcontrol.wait` before
reading its inputs), with and without an L2 prefetch of the GEMV's first weight tiles issued before that wait.

The kernels/gemv.py variants run with PDL on or off through RuntimeOptions(pdl=...) (hyperdraft.options.activated);
its "dot" variants launch `_gemv_dot` at the given tile (kernels/gemv_tiles.py), its "engine dispatch" rows run gemv()
as the engine does (gemv_mma.cu where it fits).

Run on a GPU machine: python -m benchmarks.kernels.pdl_chain [--out $OUT] ; prints a table and writes
OUT/pdl_chain_<device>.md.
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.common import device_tag, require_cuda
from benchmarks.kernels.gemv_tiles import gemv_dot
from benchmarks.kernels.timing import graph_ms
from hyperdraft.kernels.gemv import gemv
from hyperdraft.options import RuntimeOptions, activated

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    jit = triton.jit
except ImportError:  # no triton (a CPU machine): the kernels below stay plain functions; main() needs a GPU
    triton = tl = gdc_launch_dependents = gdc_wait = None

    def jit(fn):
        return fn

HIDDEN, INTER, QKV, LAYERS = 4096, 14336, 6144, 32


@jit
def _l2_prefetch(ptrs):
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@jit
def _gemv(X, W, Out, N, K, PDL: tl.constexpr, PREFETCH_K: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = W + cols[:, None].to(tl.int64) * K
    if PREFETCH_K > 0:  # weights never depend on the previous kernel: start streaming them before the wait
        lines = tl.arange(0, PREFETCH_K // 64) * 64
        _l2_prefetch(w_rows + lines[None, :])
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + ks).to(tl.float32)
        w = tl.load(w_rows + ks[None, :]).to(tl.float32)
        acc += w * x[None, :]
    tl.store(Out + cols, tl.sum(acc, axis=1).to(Out.dtype.element_ty))


@jit
def _prologue(PDL: tl.constexpr, EARLY: tl.constexpr):
    """EARLY lets the next kernel be scheduled before this one's wait as well as after it."""
    if PDL:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
        gdc_launch_dependents()


@jit
def _rms(X, R, W, Out, ResOut, D: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    _prologue(PDL, EARLY)
    cols = tl.arange(0, D)
    x = tl.load(X + cols).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(R + cols).to(tl.float32)
        tl.store(ResOut + cols, x.to(ResOut.dtype.element_ty))
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + 1e-5)
    tl.store(Out + cols, (x * inv * tl.load(W + cols).to(tl.float32)).to(Out.dtype.element_ty))


@jit
def _copy(X, Out, D: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    _prologue(PDL, EARLY)
    cols = tl.arange(0, D)
    tl.store(Out + cols, tl.load(X + cols))


@jit
def _silu_mul(X, Out, D: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK: tl.constexpr):
    _prologue(PDL, EARLY)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    g = tl.load(X + cols).to(tl.float32)
    u = tl.load(X + D + cols).to(tl.float32)
    tl.store(Out + cols, (g / (1.0 + tl.exp(-g)) * u).to(Out.dtype.element_ty))


class Chain:
    def __init__(self, gemm: str, pdl: bool, prefetch_k: int, early: bool, block_n: int, block_k: int, warps: int,
                 rows: int = 1, dot: tuple | None = None):
        """gemm: "cublas", "triton" (this file's _gemv) or "module" (kernels/gemv.py: gemv() as the engine runs it,
        or `_gemv_dot` at tile `dot` when one is given)."""
        self.gemm, self.pdl, self.prefetch_k, self.early = gemm, pdl, prefetch_k, early
        self.block_n, self.block_k, self.warps, self.rows, self.dot = block_n, block_k, warps, rows, dot
        self.options = RuntimeOptions.from_env(pdl=pdl)  # kernels/gemv.py's launches read the active options

    def linear(self, x, w, out):
        if self.gemm == "cublas":
            torch.matmul(x.view(self.rows, -1), w.t(), out=out.view(self.rows, -1))
            return out
        if self.gemm == "module":
            with activated(self.options):
                if self.dot is not None:
                    return gemv_dot(x.view(self.rows, -1), w, self.dot).view(-1)
                return gemv(x.view(self.rows, -1), w).view(-1)
        n, k = w.shape
        _gemv[(n // self.block_n,)](x, w, out, n, k, PDL=self.pdl, PREFETCH_K=self.prefetch_k, BLOCK_N=self.block_n,
                                    BLOCK_K=self.block_k, num_warps=self.warps, num_stages=3, launch_pdl=self.pdl)
        return out

    def forward(self, layers, buf):
        kw = dict(PDL=self.pdl, EARLY=self.early, launch_pdl=self.pdl)
        for lw in layers:
            _rms[(1,)](buf["h"], buf["h"], lw["n1"], buf["x"], buf["h"], D=HIDDEN, HAS_RES=False, num_warps=8, **kw)
            buf["qkv"] = self.linear(buf["x"], lw["qkv"], buf["qkv"])
            _copy[(1,)](buf["qkv"], buf["s1"], D=HIDDEN, num_warps=4, **kw)  # RoPE
            _copy[(1,)](buf["s1"], buf["s2"], D=HIDDEN, num_warps=4, **kw)  # K/V store
            _copy[(1,)](buf["s2"], buf["s3"], D=HIDDEN, num_warps=4, **kw)  # attention
            _copy[(1,)](buf["s3"], buf["attn"], D=HIDDEN, num_warps=4, **kw)  # merge
            buf["o"] = self.linear(buf["attn"], lw["o"], buf["o"])
            _rms[(1,)](buf["o"], buf["h"], lw["n2"], buf["x"], buf["h"], D=HIDDEN, HAS_RES=True, num_warps=8, **kw)
            buf["gu"] = self.linear(buf["x"], lw["gate_up"], buf["gu"])
            _silu_mul[(INTER // 1024,)](buf["gu"], buf["act"], D=INTER, BLOCK=1024, num_warps=4, **kw)
            buf["h2"] = self.linear(buf["act"], lw["down"], buf["h2"])
            _rms[(1,)](buf["h2"], buf["h"], lw["n1"], buf["x"], buf["h"], D=HIDDEN, HAS_RES=True, num_warps=8, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.pdl_chain", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output directory (default: $OUT or .)")
    a = ap.parse_args()
    require_cuda()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    layers = [dict(qkv=torch.randn(QKV, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02,
                   o=torch.randn(HIDDEN, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02,
                   gate_up=torch.randn(2 * INTER, HIDDEN, device=dev, dtype=torch.bfloat16) * 0.02,
                   down=torch.randn(HIDDEN, INTER, device=dev, dtype=torch.bfloat16) * 0.02,
                   n1=torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16),
                   n2=torch.ones(HIDDEN, device=dev, dtype=torch.bfloat16)) for _ in range(LAYERS)]
    weight_bytes = sum(t.numel() * 2 for lw in layers for t in lw.values())
    src = torch.empty(2 * 1024**3 // 4, device=dev)
    dst = torch.empty_like(src)
    copy_ms = graph_ms(lambda: dst.copy_(src), reps=10)
    copy_bw = 2 * src.numel() * 4 / copy_ms / 1e6
    shapes = dict(h=HIDDEN, x=HIDDEN, qkv=QKV, s1=HIDDEN, s2=HIDDEN, s3=HIDDEN, attn=HIDDEN, o=HIDDEN, gu=2 * INTER,
                  act=INTER, h2=HIDDEN)
    variants = {
        "cuBLAS, no PDL (engine before)": Chain("cublas", False, 0, False, 32, 512, 4),
        "cuBLAS, small kernels PDL": Chain("cublas", True, 0, False, 32, 512, 4),
        "bench GEMV 8x2048 8w, PDL, prefetch 2048": Chain("triton", True, 2048, False, 8, 2048, 8),
        "kernels/gemv.py, PDL": Chain("module", True, 0, False, 8, 2048, 8),
        "kernels/gemv.py, no PDL": Chain("module", False, 0, False, 8, 2048, 8),
    }
    for rows in (6, 16):
        variants[f"M={rows}: cuBLAS, small kernels PDL"] = Chain("cublas", True, 0, False, 0, 0, 0, rows)
        variants[f"M={rows}: kernels/gemv.py (engine dispatch), PDL"] = Chain("module", True, 0, False, 0, 0, 0, rows)
        for dot in [(32, 256, 4, 6), (32, 128, 4, 8), (32, 256, 2, 6), (32, 256, 8, 6), (64, 128, 4, 6),
                    (32, 256, 4, 5), (32, 512, 8, 3), (64, 256, 8, 4)] if rows == 6 else [(32, 256, 4, 6)]:
            variants[f"M={rows}: kernels/gemv.py dot {dot}, PDL"] = Chain("module", True, 0, False, 0, 0, 0, rows, dot)
    lines = [f"device {torch.cuda.get_device_name()}; copy {copy_bw:.0f} GB/s; weights {weight_bytes / 1e9:.2f} GB "
             f"-> {weight_bytes / copy_bw / 1e6:.3f} ms at copy speed", "",
             "| variant | ms / 32 layers | GB/s | vs cuBLAS | max abs diff vs cuBLAS |", "|---|---|---|---|---|"]
    ref_out, base = None, None
    for name, chain in variants.items():
        torch.manual_seed(1)
        buf = {k: torch.zeros(n * chain.rows, device=dev, dtype=torch.bfloat16) for k, n in shapes.items()}
        h0 = torch.randn(HIDDEN, device=dev, dtype=torch.bfloat16)

        def run():
            buf["h"][:HIDDEN].copy_(h0)
            chain.forward(layers, buf)

        ms = graph_ms(run)
        run()
        torch.cuda.synchronize()
        out = buf["x"][:HIDDEN].float().clone()
        ref_out = out if ref_out is None else ref_out
        base = ms if base is None else base
        diff = (out - ref_out).abs().max().item()  # row 0 sees the same inputs in every variant
        lines.append(f"| {name} | {ms:.3f} | {weight_bytes / ms / 1e6:.0f} | {base / ms:.3f}x | {diff:.3g} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, f"pdl_chain_{device_tag()}.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
