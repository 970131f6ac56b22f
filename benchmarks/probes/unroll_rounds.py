"""Does a trained head draft on the real model as it was trained (issue 26)? On MT-bench first turns, greedy, fp32:
the engine's EAGLE-3 chain rounds (rounds and accepted drafts per turn) against the rounds train-draft's unroll
predicts on the same answer (hyperdraft/training/unroll_rounds.py). Equal on every turn means the gap between
held-out agreement and MT-bench acceptance is the head's, not a drift between training and inference.

  python -m benchmarks.probes.unroll_rounds --head HEAD_DIR [--turns 12] [--steps 5] [--new-tokens 64]
"""

from __future__ import annotations

import argparse

from benchmarks.common import mt_bench_first_turns
from hyperdraft import LLM, SamplingParams
from hyperdraft.models.default_model import ensure_default_model
from hyperdraft.training.unroll_rounds import load_target_and_head, predicted_rounds, unrolled_drafts


def compare(head_dir: str, turns: int, steps: int, new_tokens: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """-> per turn: ((engine rounds, engine accepted drafts), (predicted rounds, predicted accepted drafts))."""
    target = ensure_default_model(progress=False)
    model, head = load_target_and_head(target, head_dir)
    plain = LLM(target, device="cpu", dtype="float32")
    prompts = [plain.apply_chat_template([{"role": "user", "content": q}]) for q in mt_bench_first_turns()[:turns]]
    longer = SamplingParams(temperature=0, max_new_tokens=new_tokens + steps + 1, ignore_eos=True)
    answers = [o.token_ids for o in plain.generate(input_ids=prompts, sampling_params=longer, use_tqdm=False)]
    plain.shutdown()
    llm = LLM(target, device="cpu", dtype="float32", speculative_algorithm="EAGLE3",
              speculative_draft_model_path=head_dir, speculative_num_steps=steps, speculative_eagle_topk=1,
              speculative_num_draft_tokens=steps + 1)
    greedy = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    rows = []
    for prompt, answer in zip(prompts, answers):
        out = llm.generate(input_ids=[prompt], sampling_params=greedy, use_tqdm=False)[0]
        assert out.token_ids == answer[:new_tokens], "speculative output differs from plain decoding"
        ids = prompt + answer
        rounds = predicted_rounds(unrolled_drafts(model, head, ids, steps), ids, len(prompt), new_tokens)
        rows.append(((out.meta_info["spec_verify_ct"], out.meta_info["spec_accepted_tokens"]),
                     (len(rounds), sum(rounds))))
    llm.shutdown()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.unroll_rounds", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    rows = compare(a.head, a.turns, a.steps, a.new_tokens)
    print("| turn | engine rounds, accepted | unroll's rounds, accepted |\n|---|---|---|")
    for i, (engine, unroll) in enumerate(rows):
        print(f"| {i} | {engine[0]}, {engine[1]} | {unroll[0]}, {unroll[1]} |")
    rounds, accepted = sum(e[0] for e, _ in rows), sum(e[1] for e, _ in rows)
    print(f"\nturns equal: {sum(e == u for e, u in rows)}/{len(rows)}; engine accept length "
          f"{(rounds + accepted) / rounds:.3f}")


if __name__ == "__main__":
    main()
