"""Where a trained head accepts less (issue 26): its EAGLE-3 chain's accept length on MT-bench first turns, per
MT-bench category, greedy, on the default model. Says which kinds of request the training prompts should cover
better; the speed rows are benchmarks/real_accept.py's.

  python -m benchmarks.probes.accept_by_category --head HEAD_DIR [--steps 5] [--new-tokens 64] [--device cpu]
"""

from __future__ import annotations

import argparse
import collections
import json

from benchmarks.common import MT_BENCH
from hyperdraft import LLM, SamplingParams
from hyperdraft.models.default_model import ensure_default_model


def accept_by_category(head: str, steps: int, new_tokens: int, device: str, dtype: str) -> dict[str, float]:
    """category -> output tokens per verify round (accept length), over that category's first turns; "all" too."""
    with open(MT_BENCH) as f:
        questions = [json.loads(line) for line in f]
    llm = LLM(ensure_default_model(), device=device, dtype=dtype, max_running_requests=8,
              speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_num_steps=steps)
    try:
        prompts = [llm.apply_chat_template([{"role": "user", "content": q["turns"][0]}]) for q in questions]
        params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
        outs = llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        llm.shutdown()
    tokens, rounds = collections.Counter(), collections.Counter()
    for q, out in zip(questions, outs):
        for key in (q["category"], "all"):
            tokens[key] += len(out.token_ids)
            rounds[key] += out.meta_info["spec_verify_ct"]
    return {key: tokens[key] / rounds[key] for key in sorted(tokens, key=lambda k: tokens[k] / rounds[k])}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.accept_by_category", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True, help="EAGLE-3 head directory written by hyperdraft train-draft")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    print("| category | accept length |\n|---|---|")
    for key, length in accept_by_category(args.head, args.steps, args.new_tokens, args.device, args.dtype).items():
        print(f"| {key} | {length:.2f} |")


if __name__ == "__main__":
    main()
