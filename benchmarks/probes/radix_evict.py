"""The cost of one eviction from the prefix cache's radix tree as the tree grows: a pool full of cached pages evicts
on every reservation, so this is paid per running request per step in a long serving run.

Trees of N cached sequences (5 pages each, 50 shared first keys, page size 1); the time of 200 calls of evict(1),
after they are built, per call.

  python -m benchmarks.probes.radix_evict     # -> stdout (results/radix_evict_cpu.md)
"""

from __future__ import annotations

import random
import time

from hyperdraft.kvcache.radix_tree import RadixTree

CALLS = 200


def evict_cost_us(sequences: int) -> float:
    rng = random.Random(0)
    tree, page = RadixTree(1), 0
    for i in range(sequences):
        tree.insert([i % 50, i] + [rng.randrange(1000) for _ in range(3)], list(range(page, page + 5)))
        page += 5
    start = time.perf_counter()
    for _ in range(CALLS):
        tree.evict(1)
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> None:
    print("| cached sequences | pages | evict(1), us per call |")
    print("|---|---|---|")
    for n in (1000, 10000, 30000):
        print(f"| {n} | {5 * n} | {evict_cost_us(n):.1f} |")


if __name__ == "__main__":
    main()
