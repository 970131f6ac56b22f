"""All 80 MT-bench first turns on the embedded SmolLM2-135M-Instruct: NGRAM speculation on vs off must give
identical greedy tokens (64 new tokens each). Writes benchmarks/results/mt_bench_lossless.md.

  python benchmarks/mt_bench_lossless.py
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyperdraft import LLM, SamplingParams  # noqa: E402
from hyperdraft.models.default_model import ensure_default_model  # noqa: E402

MT_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mt_bench_questions.jsonl")


def main() -> None:
    path = ensure_default_model()
    with open(MT_BENCH) as f:
        questions = [json.loads(line)["turns"][0] for line in f]
    sp = SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True)
    results = {}
    for name, spec in (("off", {}), ("NGRAM", dict(speculative_algorithm="NGRAM", speculative_num_steps=8))):
        llm = LLM(path, dtype="float32", **spec)
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        start = time.perf_counter()
        outs = llm.generate(input_ids=prompts, sampling_params=sp, use_tqdm=False)
        results[name] = ([o.token_ids for o in outs], time.perf_counter() - start, llm.get_server_info()["internal_states"][0])
    same = sum(a == b for a, b in zip(results["off"][0], results["NGRAM"][0]))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = ["# NGRAM speculation is lossless on all 80 MT-bench questions (SmolLM2-135M-Instruct, fp32, CPU)", "",
             f"- date: {datetime.date.today()}; commit: {commit}; command: `python {' '.join(sys.argv)}`",
             "- 80 first turns through the chat template, greedy, 64 new tokens each, all submitted at once", "",
             f"- identical token ids: **{same}/80**",
             f"- accept length with NGRAM (8 draft tokens): {results['NGRAM'][2]['avg_spec_accept_length']:.2f}",
             f"- seconds: off {results['off'][1]:.1f}, NGRAM {results['NGRAM'][1]:.1f}"]
    out = os.path.join(os.path.dirname(__file__), "results", "mt_bench_lossless.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    sys.exit(0 if same == 80 else 1)


if __name__ == "__main__":
    main()
