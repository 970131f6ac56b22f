"""What a few-row verify costs on this CPU, projection by projection (SmolLM2-135M shapes, fp32).

models/cpu_linear.py runs few-row products as `W @ x^T` because MKL streams the weights fastest that way. Whether a
chain of k drafts pays on the CPU depends on how a (k+1)-row product compares with the 2-row one a plain decode runs
(one row is padded to two). Each projection is timed over 30 distinct weight copies (as many as SmolLM2 has
layers), so the weights stream from memory as in a forward instead of sitting in cache; also the down projection
(K = 1536) split into two contiguous K = 768 halves whose products are added.

    python -m benchmarks.probes.cpu_verify_rows            # -> stdout, a markdown table
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import command_line, cpu_name, git_commit

SHAPES = {"q/k/v": (960, 576), "o_proj": (576, 576), "gate/up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def per_forward_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def row(name: str, out_features: int, in_features: int, rows: list[int], repeats: int) -> list[str]:
    weights = [torch.randn(out_features, in_features) for _ in range(LAYERS)]
    cells = []
    for m in rows:
        x = torch.randn(m, in_features)
        cells.append(f"{per_forward_ms(lambda: [torch.mm(w, x.t()) for w in weights], repeats):.1f}")
    return [f"| {name} | " + " | ".join(cells) + " |"]


def split_row(rows: list[int], repeats: int) -> list[str]:
    out_features, in_features = SHAPES["down"]
    half = in_features // 2
    halves = [(w[:, :half].contiguous(), w[:, half:].contiguous())
              for w in (torch.randn(out_features, in_features) for _ in range(LAYERS))]
    cells = []
    for m in rows:
        x = torch.randn(m, in_features)
        a, b = x[:, :half].contiguous(), x[:, half:].contiguous()
        ms = per_forward_ms(lambda: [torch.mm(h0, a.t()) + torch.mm(h1, b.t()) for h0, h1 in halves], repeats)
        cells.append(f"{ms:.1f}")
    return ["| down, two K = 768 halves | " + " | ".join(cells) + " |"]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.cpu_verify_rows", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [2, 3, 4, 5, 6]
    lines = [f"- device: {cpu_name()}, {args.threads} threads, torch {torch.__version__}; commit {git_commit()}; "
             f"command: `{command_line()}`", "- ms per forward (30 layers' worth of distinct weights), `W @ x^T`", "",
             "| projection | " + " | ".join(f"{m} rows" for m in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for name, (out_features, in_features) in SHAPES.items():
        lines += row(name, out_features, in_features, rows, args.repeats)
    lines += split_row(rows, args.repeats)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
