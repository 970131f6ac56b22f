"""Prefix cache on against off where no prompt shares a prefix, on a host-bound engine: a tiny random Llama (16
layers, hidden 64) on the CPU with one thread, so each step's cost is mostly Python, as a small model's is on a GPU.
64 prompts of 150-400 random tokens, 32 new tokens each, 16 running at a time, an 8192-token pool (it fills, so cached
prefixes are evicted as new prompts arrive). Runs alternate off/on; the median of each is reported, and a profile of
one cache-on run counts the time inside the cache's own calls.

  python -m benchmarks.probes.prefix_noreuse          # CPU -> stdout (results/prefix_noreuse_cpu.md)
"""

from __future__ import annotations

import cProfile
import pstats
import random
import statistics
import tempfile
import time

import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.testing.tiny import make_tiny_model

RUNS = 5


def main() -> None:
    torch.set_num_threads(1)
    path = make_tiny_model(tempfile.mkdtemp(), "llama", seed=0, num_hidden_layers=16)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 380) for _ in range(rng.randint(150, 400))] for _ in range(64)]
    params = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)

    def run(disable: bool, profile: cProfile.Profile | None = None) -> float:
        llm = LLM(path, device="cpu", dtype="float32", max_total_tokens=8192, max_running_requests=16,
                  disable_radix_cache=disable)
        llm.generate(input_ids=prompts[:4], sampling_params=params, use_tqdm=False)
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
        if profile is not None:
            profile.disable()
        seconds = time.perf_counter() - start
        llm.shutdown()
        return seconds

    times = {True: [], False: []}
    for _ in range(RUNS):
        for disable in (True, False):
            times[disable].append(run(disable))
    off, on = statistics.median(times[True]), statistics.median(times[False])
    print(f"cache off {off:.3f} s, cache on {on:.3f} s (medians of {RUNS}): on/off throughput {off / on:.3f}x")
    profile = cProfile.Profile()
    total = run(False, profile)
    stats = pstats.Stats(profile).stats
    cache = sum(tt for (file, _, _), (_, _, tt, _, _) in stats.items()
                if file.endswith(("prefix_cache.py", "radix_tree.py")))
    print(f"profiled cache-on run {total:.3f} s; inside prefix_cache.py and radix_tree.py (own time) {cache:.3f} s")


if __name__ == "__main__":
    main()
