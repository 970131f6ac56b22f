"""Profile target for Nsight Compute: the one-row `_gemv_vec` and the six-row `_gemv_dot` on one 8B shape, each
over its own fresh weights (nothing in L2), so the counters of the two can be put side by side.

    ncu --clock-control none --kernel-name regex:_gemv --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        python3 benchmarks/gemv_ncu.py [--n 28672 --k 4096]
(the first two launches of each kernel are warm-up and compilation; the next two are one vec and one dot.)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hyperdraft.kernels.gemv import gemv  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=28672)
    ap.add_argument("--k", type=int, default=4096)
    a = ap.parse_args()
    weights = [torch.randn(a.n, a.k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(4)]
    one, six = (torch.randn(m, a.k, device="cuda", dtype=torch.bfloat16) for m in (1, 6))
    gemv(one, weights[0])  # warm-up launches (compilation)
    gemv(six, weights[1])
    torch.cuda.synchronize()
    gemv(one, weights[2])  # the two profiled launches
    gemv(six, weights[3])
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
