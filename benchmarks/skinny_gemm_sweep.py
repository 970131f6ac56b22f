"""Sweep hyperdraft/kernels/skinny_gemm.py's launch configurations against F.linear on the projection shapes of an
8B decoder, weights cycled past L2 (as benchmarks/gemm_orientation.py): GB/s per shape and M, best config each, and
the max error against F.linear. Run on a GPU: python3 benchmarks/skinny_gemm_sweep.py
"""

from __future__ import annotations

import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.gemm_orientation import SHAPES, seconds_per_call  # noqa: E402
from hyperdraft.kernels.skinny_gemm import skinny_gemm  # noqa: E402

CONFIGS = [dict(block_n=bn, block_k=bk, split_k=s, num_warps=nw, num_stages=4)
           for bn, bk, s, nw in itertools.product((16, 32, 64), (256, 512), (1, 2, 4), (4, 8))]
SWEPT = ("o_proj", "qkv", "down", "gate_up")


def main() -> None:
    print(torch.cuda.get_device_name(), len(CONFIGS), "configs")
    for name, (n, k) in ((s, SHAPES[s]) for s in SWEPT):
        nbytes = n * k * 2
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
                   for _ in range(max(2, -(-(256 << 20) // nbytes)))]
        for m in (1, 6):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            base = seconds_per_call(lambda w: F.linear(x, w), weights)
            best = None
            for cfg in CONFIGS:
                try:
                    err = (skinny_gemm(x, weights[0], **cfg).float() - F.linear(x, weights[0]).float()).abs().max().item()
                    t = seconds_per_call(lambda w: skinny_gemm(x, w, **cfg), weights, graph_passes=2)
                except Exception as e:  # a config the compiler rejects (shared memory) is skipped
                    print("skip", cfg, type(e).__name__)
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg, err)
            print(f"{name:<8} M={m}: F.linear {nbytes / base / 1e9:6.0f} GB/s; best skinny {nbytes / best[0] / 1e9:6.0f} "
                  f"GB/s ({base / best[0]:.2f}x) {best[1]} max err {best[2]:.2e}", flush=True)
        del weights


if __name__ == "__main__":
    main()
