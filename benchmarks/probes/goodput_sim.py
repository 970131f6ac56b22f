"""The goodput policy (speculative/adaptive/goodput.py) against an oracle, on synthetic hosts: how much of the best
tier's tokens per second it keeps when step times are noisy, drift, or now and then spike (a GC pause, a descheduled
thread). Pure bookkeeping: no model, no engine; seeded, so every run prints the same table.

Each simulated step runs the slot's tier: its cost is (1 + 0.16 * steps) time units times the host's factor, and its
drafts are accepted one after another with the given rate (a chain's acceptance). An n-gram-like drafter finds a
match in only some rounds (`match`), and drafts nothing in the others. The slot sees the step's time (spikes
included) and accepted drafts; the score is tokens over the cost without spikes, against the best fixed tier's
expected tokens per unit time.

  python -m benchmarks.probes.goodput_sim [--steps 4000] [--seeds 6]
"""

from __future__ import annotations

import argparse
import math
import random

from hyperdraft.speculative.adaptive.goodput import GoodputSlot
from hyperdraft.speculative.adaptive.tier import Tier

STEPS = (0, 1, 2, 3, 5)
COST_PER_DRAFT = 0.16  # a draft step plus a verify row, in plain steps (a small model's round)


def best_rate(accept: float, match: float = 1.0) -> tuple[float, int]:
    """(tokens per time unit, steps) of the best fixed tier."""
    def rate(s: int) -> float:
        return (1 + match * sum(accept ** j for j in range(1, s + 1))) / (1 + COST_PER_DRAFT * s)
    return max((rate(s), s) for s in STEPS)


def simulate(seed: int, steps: int, accept: float, noise: float, drift: float, spikes: float,
             match: float = 1.0) -> float:
    """Tokens per time unit the slot achieved, over the best fixed tier's."""
    rng = random.Random(seed)
    slot = GoodputSlot([Tier(s) for s in STEPS], 2)
    tokens = time = 0.0
    factor = 1.0
    for i in range(steps):
        if i % 200 == 0:  # the host's speed moves every 200 steps
            factor = math.exp(rng.uniform(-drift, drift))
        tier = slot.tier
        cost = (1 + COST_PER_DRAFT * tier.steps) * factor * (1 + rng.uniform(-noise, noise))
        accepted = 0
        if match >= 1 or rng.random() < match:  # (no draw when every round matches: seeded runs stay comparable)
            while accepted < tier.steps and rng.random() < accept:
                accepted += 1
        seen = cost * (rng.uniform(5, 20) if rng.random() < spikes else 1)
        slot.observe([accepted], 1, seen)
        tokens, time = tokens + 1 + accepted, time + cost / factor  # the policy's choices, not the host's speed
    return tokens / time / best_rate(accept, match)[0]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.goodput_sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--seeds", type=int, default=6)
    a = ap.parse_args()
    print("| host | acceptance | best tier | achieved / best, mean | min |\n|---|---|---|---|---|")
    hosts = {"steady (+-10%)": (0.1, 0.0, 0.0), "drifting (+-30% every 200 steps)": (0.1, 0.3, 0.0),
             "1% spikes of 5-20x": (0.1, 0.0, 0.01), "3% spikes of 5-20x": (0.1, 0.0, 0.03)}
    for host, (noise, drift, spikes) in hosts.items():
        for accept in (0.2, 0.45, 0.8):
            scores = [simulate(seed, a.steps, accept, noise, drift, spikes) for seed in range(a.seeds)]
            print(f"| {host} | {accept} | {best_rate(accept)[1]} | {sum(scores) / len(scores):.3f} | "
                  f"{min(scores):.3f} |")
    print("\n| n-gram-like drafter (steady host) | match in | acceptance once matched | best tier | "
          "achieved / best, mean | min |\n|---|---|---|---|---|---|")
    for match, accept in ((0.0, 0.8), (0.15, 0.8), (0.3, 0.8), (0.6, 0.8), (0.3, 0.5)):
        scores = [simulate(seed, a.steps, accept, 0.1, 0.0, 0.0, match) for seed in range(a.seeds)]
        print(f"| | {match} | {accept} | {best_rate(accept, match)[1]} | {sum(scores) / len(scores):.3f} | "
              f"{min(scores):.3f} |")


if __name__ == "__main__":
    main()
