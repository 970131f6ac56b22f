"""Prefix cache on against off where no prompt shares a prefix, on a host-bound engine: a tiny random Llama (16
layers, hidden 64) on the CPU with one thread, so each step's cost is mostly Python, as a small model's is on a GPU.
64 prompts of 150-400 random tokens, 32 new tokens each, 16 running at a time, an 8192-token pool (it fills, so cached
prefixes are evicted as new prompts arrive). Runs alternate off/on; the median of each is reported, and a profile of
one cache-on run counts the time inside the cache's own calls.

  python -m benchmarks.probes.prefix_noreuse          # CPU -> stdout (results/prefix_noreuse_cpu.md)
  python -m benchmarks.probes.prefix_noreuse --prompts 2000 --min-len 30 --max-len 60 --new-tokens 4 \
      --pool 60000 --runs 1 --no-profile     # a tree of ~1000 cached sequences, evicting on every reservation
  python -m benchmarks.probes.prefix_noreuse --device cuda --shape smollm2 --dtype bfloat16 --prompts 512 \
      --running 64 --pool 40000 --no-profile # a GPU: SmolLM2-135M's shape (random weights: speed only)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import tempfile
import time

import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.testing.tiny import make_tiny_model

SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152)

def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.prefix_noreuse", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=150)
    ap.add_argument("--max-len", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--pool", type=int, default=8192, help="K/V pool tokens (max_total_tokens)")
    ap.add_argument("--runs", type=int, default=5, help="alternating off/on runs; medians reported")
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled cache-on run")
    ap.add_argument("--profile-both", type=int, default=0, metavar="N",
                    help="also profile one run each way and print the N functions with the most own time, and the "
                         "engine's decode-ahead and cache counters")
    ap.add_argument("--profile-dump", metavar="DIR", help="with --profile-both: also write each profile (pstats) there")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--running", type=int, default=16, help="max_running_requests")
    ap.add_argument("--shape", choices=["tiny", "smollm2"], default="tiny",
                    help="tiny: 16 layers of hidden 64; smollm2: SmolLM2-135M's dimensions")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shape = SMOLLM2_SHAPE if args.shape == "smollm2" else dict(num_hidden_layers=16)
    path = make_tiny_model(tempfile.mkdtemp(), "llama", seed=0, **shape)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 380) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.prompts)]
    params = SamplingParams(temperature=0, max_new_tokens=args.new_tokens, ignore_eos=True)

    def run(disable: bool, profile: cProfile.Profile | None = None) -> float:
        llm = LLM(path, device=args.device, dtype=args.dtype, max_total_tokens=args.pool,
                  max_running_requests=args.running, disable_radix_cache=disable)
        llm.generate(input_ids=prompts[:4], sampling_params=params, use_tqdm=False)
        steps: list[float] = []
        step = llm.engine.step

        def timed_step():
            t0 = time.perf_counter()
            out = step()
            steps.append(time.perf_counter() - t0)
            return out

        llm.engine.step = timed_step
        gc_start = gc_seconds[0]
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
        if profile is not None:
            profile.disable()
        seconds = time.perf_counter() - start
        worker = llm.engine.worker
        counters[disable] = dict(ahead_used=worker.ahead_used, ahead_discarded=worker.ahead_discarded,
                                 **llm.engine.cache_state())
        slowest = sorted(steps)[-3:]
        print(f"cache {'off' if disable else 'on '}: {seconds:.3f} s, {len(steps)} steps, median step "
              f"{statistics.median(steps) * 1e3:.2f} ms, slowest {' '.join(f'{s * 1e3:.0f}' for s in slowest)} ms, "
              f"gc {gc_seconds[0] - gc_start:.3f} s, steps over 10 ms {sum(s for s in steps if s > 0.01):.3f} s, "
              f"the rest {sum(s for s in steps if s <= 0.01):.3f} s", flush=True)
        llm.shutdown()
        return seconds

    counters: dict[bool, dict] = {}
    gc_seconds = [0.0]
    gc_began = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_began[0] = time.perf_counter()
        else:
            gc_seconds[0] += time.perf_counter() - gc_began[0]

    gc.callbacks.append(on_gc)

    times = {True: [], False: []}
    for i in range(args.runs):
        for disable in (True, False) if i % 2 == 0 else (False, True):  # each goes first as often
            times[disable].append(run(disable))
    off, on = statistics.median(times[True]), statistics.median(times[False])
    print(f"cache off {off:.3f} s, cache on {on:.3f} s (medians of {args.runs}): on/off throughput {off / on:.3f}x")
    print("runs (s): off " + " ".join(f"{t:.3f}" for t in times[True]) + "; on " + " ".join(f"{t:.3f}" for t in times[False]))
    for disable in (True, False) if args.profile_both else ():
        profile = cProfile.Profile()
        total = run(disable, profile)
        print(f"\n### cache {'off' if disable else 'on'}: profiled run {total:.3f} s; {counters[disable]}")
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(args.profile_both)
        if args.profile_dump:
            stats.dump_stats(f"{args.profile_dump}/cache_{'off' if disable else 'on'}.prof")
    if args.no_profile:
        return
    profile = cProfile.Profile()
    total = run(False, profile)
    stats = pstats.Stats(profile).stats
    cache = sum(tt for (file, _, _), (_, _, tt, _, _) in stats.items()
                if file.endswith(("prefix_cache.py", "radix_tree.py")))
    print(f"profiled cache-on run {total:.3f} s; inside prefix_cache.py and radix_tree.py (own time) {cache:.3f} s")


if __name__ == "__main__":
    main()
