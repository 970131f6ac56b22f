"""Does a trained head draft on the real model as it was trained (issue 26)? On MT-bench first turns, greedy, fp32:
the engine's EAGLE-3 chain rounds (rounds and accepted drafts per turn) against the rounds train-draft's unroll
predicts on the same answer (hyperdraft/training/unroll_rounds.py). Equal on every turn means the gap between
held-out agreement and MT-bench acceptance is the head's, not a drift between training and inference.

  python -m benchmarks.probes.unroll_rounds --head HEAD_DIR [--turns 12] [--steps 5] [--new-tokens 64]
"""

from __future__ import annotations

import argparse

from benchmarks.common import chat_turns, mt_bench_first_turns
from hyperdraft import LLM
from hyperdraft.models.default_model import ensure_default_model
from hyperdraft.training.unroll_rounds import Rounds, compare_rounds, load_target_and_head


def compare(head_dir: str, turns: int, steps: int, new_tokens: int) -> list[Rounds]:
    target = ensure_default_model(progress=False)
    plain = LLM(target, device="cpu", dtype="float32")
    speculative = LLM(target, device="cpu", dtype="float32", speculative_algorithm="EAGLE3",
                      speculative_draft_model_path=head_dir, speculative_num_steps=steps, speculative_eagle_topk=1,
                      speculative_num_draft_tokens=steps + 1)
    try:
        prompts = chat_turns(plain, mt_bench_first_turns()[:turns])
        return compare_rounds(plain, speculative, *load_target_and_head(target, head_dir), prompts, steps, new_tokens)
    finally:
        plain.shutdown()
        speculative.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.unroll_rounds", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    rows = compare(a.head, a.turns, a.steps, a.new_tokens)
    print("| turn | engine rounds, accepted | unroll's rounds, accepted | output equal to plain |\n|---|---|---|---|")
    for i, row in enumerate(rows):
        print(f"| {i} | {row.engine[0]}, {row.engine[1]} | {row.unroll[0]}, {row.unroll[1]} | {row.output_equal} |")
    rounds, accepted = sum(r.engine[0] for r in rows), sum(r.engine[1] for r in rows)
    print(f"\nturns equal: {sum(r.engine == r.unroll for r in rows)}/{len(rows)}; engine accept length "
          f"{(rounds + accepted) / rounds:.3f}")


if __name__ == "__main__":
    main()
