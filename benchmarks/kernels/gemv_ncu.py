"""Profile target for Nsight Compute: the one-row `_gemv_vec` and the six-row `_gemv_dot` on one 8B shape, each
over its own fresh weights (nothing in L2), so the counters of the two can be put side by side.

    ncu --clock-control none --kernel-name regex:_gemv --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        python -m benchmarks.kernels.gemv_ncu [--n 28672 --k 4096]
(the first two launches of each kernel are warm-up and compilation; the next two are one vec and one dot. The
six-row product is `_gemv_dot` at the engine's tile, launched directly: gemv() would run gemv_mma.cu there.)
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import require_cuda
from benchmarks.kernels.gemv_tiles import ENGINE_DOT_TILE, gemv_dot
from hyperdraft.kernels.gemv import gemv


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.gemv_ncu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=28672)
    ap.add_argument("--k", type=int, default=4096)
    a = ap.parse_args()
    require_cuda()
    weights = [torch.randn(a.n, a.k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(4)]
    one, six = (torch.randn(m, a.k, device="cuda", dtype=torch.bfloat16) for m in (1, 6))
    gemv(one, weights[0])  # warm-up launches (compilation)
    gemv_dot(six, weights[1], ENGINE_DOT_TILE)
    torch.cuda.synchronize()
    gemv(one, weights[2])  # the two profiled launches
    gemv_dot(six, weights[3], ENGINE_DOT_TILE)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
