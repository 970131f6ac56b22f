"""The accept lengths gpu_bench's chain rows draw, replayed on the CPU, and where each draw sits among other seeds.

Simulated acceptance is a function of each request's seed and of its drafts' positions (speculative/verify/simulated.py: coin j
of a round is uniform(seed, sequence index of d_j, DOMAIN_ACCEPT); d_j is accepted iff it and every draft before it
drew a coin below alpha). gpu_bench sets no seed, so each request takes the engine's next draw from
random.Random(random_seed) in arrival order, and every setting's fresh engine sees the same requests in the same order
(one warm-up request, then each alpha and batch size in turn; the phase-split and A/B rows run on engines of their
own). Every gpu_bench run therefore draws the same accept lengths on any GPU. This script replays that order and, for each chain row, reports:

  draw        the pooled accept length of gpu_bench's own seeds (what the GPU run measures: 3.58 at chain 5,
              alpha 0.8, batch 1, in benchmarks/results/gpu_bench_h100.md)
  E_run       its expectation (e2e/gpu_bench_report.py)
  percentile  the share of other seed streams (the same number of requests from random.Random(s), s = 1..pools)
              whose pooled accept length is at or below the draw

    python -m benchmarks.e2e.accept_draws [--pools 200] [--batches 1,8,32]     # CPU, prints a markdown table
"""

from __future__ import annotations

import argparse
import random

import torch

from benchmarks.e2e.engines import ALPHAS, SETTINGS, SPEC_REPEATS
from benchmarks.e2e.gpu_bench_report import expected_run_accept
from hyperdraft.sample.rng import DOMAIN_ACCEPT, uniform_reference


def run_rounds(seed: int, alpha: float, steps: int, prompt_len: int, output_len: int) -> int:
    """Verify rounds one request takes to emit output_len tokens (the first comes from its prefill)."""
    first = prompt_len + 1  # sequence index of the first round's d_0 (the prefill's token sits at prompt_len)
    span = output_len + steps + 1
    coins = uniform_reference(torch.full((span,), seed, dtype=torch.int64), torch.arange(first, first + span),
                              DOMAIN_ACCEPT)[:, 0].tolist()
    emitted, rounds, pos = 1, 0, 0
    while emitted < output_len:
        left = output_len - emitted
        accepted = 0
        while accepted < steps and coins[pos + accepted] < alpha:
            accepted += 1
        emitted += min(accepted + 1, left)
        pos += accepted + 1
        rounds += 1
    return rounds


def pooled_accept(seeds: list[int], alpha: float, steps: int, prompt_len: int, output_len: int) -> float:
    """Tokens after the first per verify round, pooled over the requests (gpu_bench's accept length)."""
    rounds = sum(run_rounds(s, alpha, steps, prompt_len, output_len) for s in seeds)
    return len(seeds) * (output_len - 1) / rounds


def bench_seeds(batches: tuple[int, ...], random_seed: int = 0) -> dict[tuple[float, int], list[int]]:
    """The seeds of every (alpha, batch) row of one setting's engine, in gpu_bench's request order."""
    rng = random.Random(random_seed)
    rng.getrandbits(63)  # the warm-up request
    return {(alpha, bs): [rng.getrandbits(63) for _ in range(SPEC_REPEATS if bs == 1 else bs)]
            for alpha in ALPHAS for bs in batches}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.accept_draws", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pools", type=int, default=200, help="other seed streams to rank each draw against")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batches", default="1,8,32")
    a = ap.parse_args()
    batches = tuple(int(b) for b in a.batches.split(","))
    print("| setting | alpha | batch | requests | draw | E_run | percentile |")
    print("|---|---|---|---|---|---|---|")
    for name, (steps, topk, _) in SETTINGS.items():
        if topk != 1:
            continue  # trees are simulated as a walk down first children, not as this chain
        for (alpha, bs), seeds in bench_seeds(batches).items():
            draw = pooled_accept(seeds, alpha, steps, a.input_len, a.output_len)
            others = []
            for s in range(1, a.pools + 1):
                rng = random.Random(s)
                others.append(pooled_accept([rng.getrandbits(63) for _ in seeds], alpha, steps, a.input_len,
                                            a.output_len))
            rank = sum(x <= draw for x in others) / len(others)
            print(f"| {name} | {alpha} | {bs} | {len(seeds)} | {draw:.3f} | "
                  f"{expected_run_accept(alpha, steps, a.output_len - 1):.3f} | {100 * rank:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
