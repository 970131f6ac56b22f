"""Does programmatic dependent launch keep stream order two kernels back? (Why did the push all-reduce hang?)

kernels/pdl.py's rule makes order transitive: a PDL kernel waits for the kernel just before it, which waited for the
one before it, and so on. On two H100s the push all-reduce, launched with PDL right after the nvcc GEMV
(gemv_mma.cu), hung in an 8B engine's first forward, and ran when either was changed (tp_bench_h100.md, 2026-11-27):
as if the push kernel had started before the push call two kernels back had finished. This probe asks the same
question on one GPU, with no second rank:

  A  spins for a while (one program), then writes the iteration number i to a flag   (PDL, triggers at once)
  B  the product under test: the nvcc GEMV, the Triton GEMV, or nothing                (PDL)
  C  reads the flag and records it as seen[i]                                          (PDL)

repeated `--iters` times in one stream, nothing between. If order holds, seen[i] == i every time; a C that ran before
its A finished records i - 1. Each B is tried in turn; the report counts the iterations whose C saw a stale flag. The
control row (a C that skips its wait) must count many: it shows the probe can see a broken order.

  python -m benchmarks.probes.pdl_order [--iters 2000] [--spin-us 20]      # one GPU, about a minute
  TRITON_INTERPRET=1 python -m benchmarks.probes.pdl_order --iters 3 --products none   # CPU smoke test (no PDL)
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from hyperdraft import options
from hyperdraft.kernels._triton import jit, tl
from hyperdraft.kernels.all_reduce import clock_ns
from hyperdraft.kernels.gemv import gemv, mma_fits
from hyperdraft.kernels.pdl import pdl_args, pdl_wait
from hyperdraft.options import triton_interpreted

ROWS, K, N = 8, 4096, 4096  # an 8B o_proj-like product at 8 rows: gemv_mma's shape in the hung forward
# B; "control": no B, and a C launched with PDL that skips its wait, which must read stale flags (the probe can see)
PRODUCTS = ("control", "none", "nvcc-gemv", "triton-gemv")


@jit
def _spin_then_set(Flag, value, spin_ns, TIMED: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    start = clock_ns(TIMED)  # the interpreter has no clock (0 there); it runs programs in order anyway
    now = start
    while now - start < spin_ns * TIMED:
        now = clock_ns(TIMED)
    tl.store(Flag, value)


@jit
def _record_flag(Flag, Seen, i, PDL: tl.constexpr):
    pdl_wait(PDL)
    tl.store(Seen + i, tl.load(Flag, volatile=True))


def stale_reads(product: str, iters: int, spin_us: float, device: torch.device) -> dict:
    """Run A, B(product), C `iters` times -> {'product', 'stale', 'iters', 'kernel'}."""
    flag = torch.full((1,), -1, dtype=torch.int32, device=device)
    seen = torch.full((iters,), -2, dtype=torch.int32, device=device)
    x = torch.randn(ROWS, K, device=device).to(torch.bfloat16)
    w = torch.randn(N, K, device=device).to(torch.bfloat16) * 0.02
    switches = dataclasses.replace(options.current(), cuda_kernels=(product != "triton-gemv"))
    with options.activated(switches):
        kernel = "-" if product in ("none", "control") else ("gemv_mma.cu" if mma_fits(x, w, None)
                                                              else "Triton _gemv_dot")
        record_args = pdl_args(device)
        if product == "control" and record_args["PDL"]:
            record_args = {"PDL": False, "launch_pdl": True}
        for i in range(iters):
            _spin_then_set[(1,)](flag, i, int(spin_us * 1000), TIMED=not triton_interpreted(), **pdl_args(device))
            if product not in ("none", "control"):
                gemv(x, w)
            _record_flag[(1,)](flag, seen, i, **record_args)
    stale = int((seen != torch.arange(iters, device=device, dtype=torch.int32)).sum())
    return {"product": product, "kernel": kernel, "iters": iters, "stale": stale}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--spin-us", type=float, default=20.0, help="how long A holds its flag back")
    ap.add_argument("--products", nargs="+", default=list(PRODUCTS), choices=PRODUCTS)
    args = ap.parse_args()
    device = torch.device("cpu" if triton_interpreted() else "cuda")
    for product in args.products:
        print(stale_reads(product, args.iters, args.spin_us, device), flush=True)


if __name__ == "__main__":
    main()
