"""Several trained heads' MT-bench acceptance on one machine, without a GPU (issue 26): the target's greedy answers to
MT-bench first turns (CPU, fp32) are made once, and each head's chain rounds over them are the ones train-draft's
unroll predicts (hyperdraft/training/unroll_rounds.py), which the engine's rounds equal (probes/unroll_rounds.py,
checked on the real model). Reports each head's chain accept length (rounds until --new-tokens are out, as
real_accept counts them) and its first-draft agreement over every answer position.

  python -m benchmarks.probes.head_ab HEAD_DIR [HEAD_DIR ...] [--turns 40] [--steps 5] [--new-tokens 96]
"""

from __future__ import annotations

import argparse

from benchmarks.common import chat_turns, mt_bench_first_turns
from hyperdraft import LLM, SamplingParams
from hyperdraft.models.default_model import ensure_default_model
from hyperdraft.training.unroll_rounds import load_target_and_head, predicted_rounds, unrolled_drafts


def greedy_answers(target: str, turns: int, length: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) per MT-bench first turn; EOS ignored, so every answer has `length` tokens."""
    plain = LLM(target, device="cpu", dtype="float32")
    try:
        prompts = chat_turns(plain, mt_bench_first_turns()[:turns])
        params = SamplingParams(temperature=0, max_new_tokens=length, ignore_eos=True)
        outs = plain.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
        return [(p, o.token_ids) for p, o in zip(prompts, outs)]
    finally:
        plain.shutdown()


def measure(target: str, head_dir: str, answers, steps: int, new_tokens: int) -> tuple[float, float]:
    """-> (chain accept length, first-draft agreement) of one head over the answers."""
    model, head = load_target_and_head(target, head_dir)
    rounds = accepted = agreed = positions = 0
    for prompt, answer in answers:
        ids = prompt + answer
        drafts = unrolled_drafts(model, head, ids, steps)
        per_round = predicted_rounds(drafts, ids, len(prompt), new_tokens)
        rounds, accepted = rounds + len(per_round), accepted + sum(per_round)
        for i in range(len(prompt) - 1, len(ids) - 2):  # drafts[0][i] proposes ids[i + 2]
            agreed += int(drafts[0][i] == ids[i + 2])
            positions += 1
    return 1 + accepted / rounds, agreed / positions


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.head_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=96)
    a = ap.parse_args()
    target = ensure_default_model(progress=False)
    answers = greedy_answers(target, a.turns, a.new_tokens + a.steps + 2)  # room for the last round's drafts
    print(f"| head | MT-bench chain {a.steps} accept length ({a.turns} turns, {a.new_tokens} tokens) | "
          "first-draft agreement |\n|---|---|---|")
    for head_dir in a.heads:
        length, agreement = measure(target, head_dir, answers, a.steps, a.new_tokens)
        print(f"| {head_dir} | {length:.3f} | {agreement:.3f} |", flush=True)


if __name__ == "__main__":
    main()
