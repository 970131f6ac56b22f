"""All 80 MT-bench first turns on the embedded SmolLM2-135M-Instruct: NGRAM speculation on vs off must give
identical greedy tokens (64 new tokens each). Exits 1 unless all 80 are identical.

  python -m benchmarks.e2e.mt_bench_lossless     # CPU -> benchmarks/results/mt_bench_lossless_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

from benchmarks.common import command_line, device_tag, git_commit, mt_bench_first_turns, write_results
from hyperdraft import LLM, SamplingParams
from hyperdraft.models.default_model import ensure_default_model


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.mt_bench_lossless", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", help="report path (default: benchmarks/results/mt_bench_lossless_<device>.md)")
    args = ap.parse_args()
    tag = device_tag(args.device)
    path = ensure_default_model()
    questions = mt_bench_first_turns()
    sp = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
    results = {}
    for name, spec in (("off", {}), ("NGRAM", dict(speculative_algorithm="NGRAM", speculative_num_steps=8))):
        llm = LLM(path, device=args.device, dtype="float32", **spec)
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        start = time.perf_counter()
        outs = llm.generate(input_ids=prompts, sampling_params=sp, use_tqdm=False)
        results[name] = ([o.token_ids for o in outs], time.perf_counter() - start, llm.get_server_info()["internal_states"][0])
    same = sum(a == b for a, b in zip(results["off"][0], results["NGRAM"][0]))
    lines = [f"# NGRAM speculation is lossless on all 80 MT-bench questions (SmolLM2-135M-Instruct, fp32, "
             f"{tag.upper()})", "",
             f"- date: {datetime.date.today()}; commit: {git_commit()}; command: `{command_line()}`",
             "- 80 first turns through the chat template, greedy, 64 new tokens each, all submitted at once", "",
             f"- identical token ids: **{same}/80**",
             f"- accept length with NGRAM (8 draft tokens): {results['NGRAM'][2]['avg_spec_accept_length']:.2f}",
             f"- seconds: off {results['off'][1]:.1f}, NGRAM {results['NGRAM'][1]:.1f}"]
    write_results(lines, args.out, "mt_bench_lossless", tag)
    print("\n".join(lines))
    sys.exit(0 if same == 80 else 1)


if __name__ == "__main__":
    main()
