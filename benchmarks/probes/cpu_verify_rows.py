"""What a few-row verify costs on this CPU, projection by projection (SmolLM2-135M shapes, fp32), on the engine's
two CPU paths: MKL in the orientation models/cpu_linear.py picks (`skinny_linear`: `W @ x^T`, one row padded to
two) and oneDNN over a blocked copy of the weight (models/cpu_packed.py), which verifies of 3..16 rows take.

Whether a chain of k drafts pays on the CPU depends on how a (k+1)-row product compares with the 1-2 rows of a
plain decode. Each projection is timed over 30 distinct weight copies (as many as SmolLM2 has layers; the lm_head
over 3), so the weights stream from memory as in a forward instead of sitting in cache.

    python -m benchmarks.probes.cpu_verify_rows [--repeats 20]     # -> stdout, a markdown table
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import command_line, cpu_name, git_commit
from hyperdraft.models.cpu_linear import skinny_linear
from hyperdraft.models.cpu_packed import BlockedWeight

SHAPES = {"q/k/v": (960, 576, 30), "o_proj": (576, 576, 30), "gate/up": (3072, 576, 30), "down": (576, 1536, 30),
          "lm_head": (49152, 576, 3)}
ROWS = [1, 2, 3, 4, 6, 8, 12, 16]


def per_forward_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def rows_of(name: str, out_features: int, in_features: int, copies: int, repeats: int) -> list[str]:
    weights = [torch.randn(out_features, in_features) / in_features ** 0.5 for _ in range(copies)]
    packs = [BlockedWeight.of(w, None) for w in weights]
    mkl, onednn = [], []
    for m in ROWS:
        x = torch.randn(m, in_features)
        mkl.append(per_forward_ms(lambda: [skinny_linear(x, w) for w in weights], repeats))
        onednn.append(per_forward_ms(lambda: [p.product(x) for p in packs], repeats))
    return [f"| {name} | MKL | " + " | ".join(f"{v:.1f}" for v in mkl) + " |",
            "| | oneDNN, blocked | " + " | ".join(f"**{b:.1f}**" if b < a else f"{b:.1f}" for a, b in zip(mkl, onednn))
            + " |"]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.cpu_verify_rows", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lines = [f"- device: {cpu_name()}, {args.threads} threads, torch {torch.__version__}; commit {git_commit()}; "
             f"command: `{command_line()}`",
             "- ms per forward (each layer's distinct weights; bold: the blocked copy is faster)", "",
             "| projection | path | " + " | ".join(f"{m} rows" for m in ROWS) + " |", "|---" * (len(ROWS) + 2) + "|"]
    with torch.no_grad():
        for name, (out_features, in_features, copies) in SHAPES.items():
            lines += rows_of(name, out_features, in_features, copies, args.repeats)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
