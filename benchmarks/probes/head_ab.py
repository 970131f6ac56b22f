"""Several trained heads' MT-bench acceptance on one machine, without a GPU (issue 26): the target's greedy answers to
MT-bench first turns (CPU, fp32) are made once, and each head's chain rounds over them are the ones train-draft's
unroll predicts (hyperdraft/training/unroll_rounds.py), which the engine's rounds equal (probes/unroll_rounds.py,
checked on the real model). Reports each head's chain accept length (rounds until --new-tokens are out, as
real_accept counts them) and its first-draft agreement over every answer position; --by-category adds a row per
MT-bench category (writing, roleplay, reasoning, math, coding, extraction, stem, humanities) under each head.

  python -m benchmarks.probes.head_ab HEAD_DIR [HEAD_DIR ...] [--turns 40] [--steps 5] [--new-tokens 96]
      [--by-category]
"""

from __future__ import annotations

import argparse

import collections

from benchmarks.common import chat_turns, mt_bench_categories, mt_bench_first_turns
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


class Tally:
    """Chain rounds and first-draft agreement summed over answers: rounds, drafts accepted, agreeing positions."""

    def __init__(self):
        self.rounds = self.accepted = self.agreed = self.positions = 0

    def add(self, rounds: list[int], agreed: int, positions: int) -> None:
        self.rounds, self.accepted = self.rounds + len(rounds), self.accepted + sum(rounds)
        self.agreed, self.positions = self.agreed + agreed, self.positions + positions

    def row(self, name: str) -> str:
        return f"| {name} | {1 + self.accepted / self.rounds:.3f} | {self.agreed / self.positions:.3f} |"


def measure(target: str, head_dir: str, answers, steps: int, new_tokens: int, groups: list[str]) -> dict[str, Tally]:
    """-> each group's Tally (chain accept length, first-draft agreement) of one head over the answers, and the
    whole set's under ""; groups: a name per answer."""
    model, head = load_target_and_head(target, head_dir)
    tallies = collections.defaultdict(Tally)
    for (prompt, answer), group in zip(answers, groups):
        ids = prompt + answer
        drafts = unrolled_drafts(model, head, ids, steps)
        rounds = predicted_rounds(drafts, ids, len(prompt), new_tokens)
        answer_positions = range(len(prompt) - 1, len(ids) - 2)  # drafts[0][i] proposes ids[i + 2]
        agreed = sum(int(drafts[0][i] == ids[i + 2]) for i in answer_positions)
        for key in ("", group):
            tallies[key].add(rounds, agreed, len(answer_positions))
    return tallies


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.head_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--by-category", action="store_true")
    a = ap.parse_args()
    target = ensure_default_model(progress=False)
    answers = greedy_answers(target, a.turns, a.new_tokens + a.steps + 2)  # room for the last round's drafts
    categories = mt_bench_categories()[:a.turns]
    print(f"| head | MT-bench chain {a.steps} accept length ({a.turns} turns, {a.new_tokens} tokens) | "
          "first-draft agreement |\n|---|---|---|")
    for head_dir in a.heads:
        tallies = measure(target, head_dir, answers, a.steps, a.new_tokens, categories)
        print(tallies[""].row(head_dir), flush=True)
        if a.by_category:
            for category in dict.fromkeys(categories):
                print(tallies[category].row(f"{head_dir}: {category}"), flush=True)


if __name__ == "__main__":
    main()
