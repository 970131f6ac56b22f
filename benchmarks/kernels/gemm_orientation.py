"""Skinny GEMMs on a GPU: which cuBLAS call streams a decoder's projection weights fastest at 1..8 rows?

For x [M, K] and W [N, K] (bf16), times F.linear(x, W) (cuBLAS sees the token count as its narrow dimension), the
same product as (W @ x^T)^T (the token count on the other side, as cpu_linear.py does for MKL), and torch.mv at M = 1,
each in a CUDA graph of back-to-back calls (launch costs excluded), for the Llama-3.1-8B projection shapes. The calls
cycle through enough copies of W (>= 256 MB) that no call finds its weights in L2 (50 MB on an H100), as in a real
forward, which streams 15 GB per token. Prints GB/s of weight read per call.

  python -m benchmarks.kernels.gemm_orientation      # GPU; prints the table
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import require_cuda
from benchmarks.kernels.timing import graph_ms

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096), "head_fc": (4096, 12288)}


def seconds_per_call(call, weights: list[torch.Tensor], graph_passes: int = 4) -> float:
    """call(w) once per weight copy, graph_passes times over, in one CUDA graph: seconds per call."""
    def run():
        for _ in range(graph_passes):
            for w in weights:
                call(w)

    return graph_ms(run, reps=5, warm_replays=1) / 1000 / (graph_passes * len(weights))


def main() -> None:
    argparse.ArgumentParser(prog="python -m benchmarks.kernels.gemm_orientation", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    require_cuda()
    print(torch.cuda.get_device_name())
    print(f"{'shape':<8} {'M':>2} {'F.linear GB/s':>14} {'W@x^T GB/s':>11} {'mv GB/s':>8}")
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(max(2, -(-(256 << 20) // nbytes)))]
        for m in (1, 2, 4, 6, 8):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            lin = seconds_per_call(lambda w: F.linear(x, w), weights)
            ori = seconds_per_call(lambda w: torch.mm(w, x.t()), weights)
            mv = seconds_per_call(lambda w: torch.mv(w, x[0]), weights) if m == 1 else float("nan")
            print(f"{name:<8} {m:>2} {nbytes / lin / 1e9:14.0f} {nbytes / ori / 1e9:11.0f} {nbytes / mv / 1e9:8.0f}")
        del weights


if __name__ == "__main__":
    main()
