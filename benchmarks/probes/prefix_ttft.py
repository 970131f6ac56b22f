"""Where does a turn-2 TTFT go when the history is cached? SmolLM2-135M, a ~2k-token turn 1, then turn 2 with the
prefix cache on and off: per-request TTFT over several repeats (the first ones include Triton compiles), then a
profile of one cached turn 2 (top GPU kernels and host ops). Prints its lines.

  python -m benchmarks.probes.prefix_ttft [--device cuda] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.e2e.prefix_cache import greedy, questions, reference_text
from hyperdraft import LLM
from hyperdraft.models.default_model import ensure_default_model


def turn2_ids(llm: LLM, qs, k: int, history: int) -> list[int]:
    turn1 = [{"role": "user", "content": reference_text(llm, qs, k, history) + "\n\n" + qs[k][0]}]
    first = llm.chat(turn1, greedy(16), use_tqdm=False)
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": qs[k][1]}]
    return llm.apply_chat_template(turn2)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.prefix_ttft", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    qs, path = questions(), ensure_default_model()
    for disable in (True, False):
        llm = LLM(path, device=args.device, dtype=args.dtype, disable_radix_cache=disable, max_total_tokens=60_000)
        ttfts = []
        for k in range(args.repeats):
            ids = turn2_ids(llm, qs, k, args.history)
            out = llm.generate(input_ids=[ids], sampling_params=greedy(1), use_tqdm=False)[0]
            ttfts.append(out.meta_info["ttft"])
        print(f"cache {'off' if disable else 'on'}: turn-2 TTFT ms " + " ".join(f"{1e3 * t:.1f}" for t in ttfts)
              + f"; median of the last half {1e3 * statistics.median(ttfts[len(ttfts) // 2:]):.1f}")
        ids = turn2_ids(llm, qs, args.repeats, args.history)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = llm.generate(input_ids=[ids], sampling_params=greedy(1), use_tqdm=False)[0]
        print(f"profiled turn 2: TTFT {1e3 * out.meta_info['ttft']:.1f} ms, {out.meta_info['cached_tokens']} cached of "
              f"{len(ids)}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        del llm


if __name__ == "__main__":
    main()
