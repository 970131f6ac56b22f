"""Several trained heads' MT-bench acceptance on one machine, without a GPU (issue 26): the target's greedy answers to
MT-bench first turns (CPU, fp32) are made once, and each head's chain rounds over them are the ones train-draft's
unroll predicts (hyperdraft/training/unroll_rounds.py), which the engine's rounds equal (probes/unroll_rounds.py,
checked on the real model). Reports each head's chain accept length (rounds until --new-tokens are out, as
real_accept counts them) and its first-draft agreement over every answer position; --by-category adds a row per
MT-bench category (writing, roleplay, reasoning, math, coding, extraction, stem, humanities) under each head.
--stop-at-eos ends each answer at the target's EOS (or --new-tokens), as SGLang's MT-bench EAGLE benchmark
(benchmark/mtbench/bench_sglang_eagle.py: max_tokens 1024, no ignore_eos) counts; without it EOS is ignored and every
answer is --new-tokens long, the stricter count real_accept.py uses by default.

  python -m benchmarks.probes.head_ab HEAD_DIR [HEAD_DIR ...] [--turns 40] [--steps 5] [--new-tokens 96]
      [--by-category] [--stop-at-eos]
"""

from __future__ import annotations

import argparse

import collections

from benchmarks.common import chat_turns, mt_bench_categories, mt_bench_first_turns
from hyperdraft import LLM, SamplingParams
from hyperdraft.models.default_model import ensure_default_model
from hyperdraft.training.unroll_rounds import load_target_and_head, predicted_rounds, unrolled_drafts

NO_TOKEN = -1  # past an answer's end: no draft equals it


def greedy_answers(target: str, turns: int, length: int, stop_at_eos: bool = False) -> list[tuple[list[int], list[int]]]:
    """(prompt, answer) per MT-bench first turn, `length` tokens, or up to and with EOS when stop_at_eos."""
    plain = LLM(target, device="cpu", dtype="float32")
    try:
        prompts = chat_turns(plain, mt_bench_first_turns()[:turns])
        params = SamplingParams(temperature=0, max_new_tokens=length, ignore_eos=not stop_at_eos)
        outs = plain.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
        return [(p, o.token_ids) for p, o in zip(prompts, outs)]
    finally:
        plain.shutdown()


def rounds_to_end(drafts: list[list[int]], prompt: list[int], answer: list[int], steps: int) -> list[int]:
    """Accepted drafts per round until the answer's last token is out, as the engine finishes a request at its EOS:
    drafts (unrolled over at least prompt + answer + steps + 1 tokens) proposing tokens past the answer are rejected."""
    return predicted_rounds(drafts, prompt + answer + [NO_TOKEN] * (steps + 1), len(prompt), len(answer))


class Tally:
    """Chain rounds and first-draft agreement summed over answers: rounds, drafts accepted, agreeing positions."""

    def __init__(self):
        self.rounds = self.accepted = self.agreed = self.positions = 0

    def add(self, rounds: list[int], agreed: int, positions: int) -> None:
        self.rounds, self.accepted = self.rounds + len(rounds), self.accepted + sum(rounds)
        self.agreed, self.positions = self.agreed + agreed, self.positions + positions

    def row(self, name: str) -> str:
        return f"| {name} | {1 + self.accepted / self.rounds:.3f} | {self.agreed / self.positions:.3f} |"


def measure(target: str, head_dir: str, answers, steps: int, new_tokens: int, groups: list[str],
            stop_at_eos: bool = False) -> dict[str, Tally]:
    """-> each group's Tally (chain accept length, first-draft agreement) of one head over the answers, and the
    whole set's under ""; groups: a name per answer. With stop_at_eos an answer's rounds end with its last token
    (its EOS, or token new_tokens): drafts past it count as rejected, since the engine finishes the request there."""
    model, head = load_target_and_head(target, head_dir)
    tallies = collections.defaultdict(Tally)
    for (prompt, answer), group in zip(answers, groups):
        answer = answer[:new_tokens] if stop_at_eos else answer
        ids = prompt + answer
        if stop_at_eos:
            # The unroll needs real tokens past the answer to run over; the rounds never accept them.
            drafts = unrolled_drafts(model, head, ids + [answer[-1]] * (steps + 1), steps)
            rounds = rounds_to_end(drafts, prompt, answer, steps)
        else:
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
    ap.add_argument("--stop-at-eos", action="store_true")
    a = ap.parse_args()
    target = ensure_default_model(progress=False)
    # Without EOS, room for the last round's drafts; with it, the answer's end is the rounds' end.
    answers = greedy_answers(target, a.turns, a.new_tokens + (0 if a.stop_at_eos else a.steps + 2), a.stop_at_eos)
    categories = mt_bench_categories()[:a.turns]
    length = f"up to {a.new_tokens} tokens, stopping at EOS" if a.stop_at_eos else f"{a.new_tokens} tokens"
    if a.stop_at_eos:
        print(f"answer lengths: mean {sum(len(x) for _, x in answers) / len(answers):.0f}, "
              f"{sum(len(x) == a.new_tokens for _, x in answers)} of {len(answers)} reach {a.new_tokens}")
    print(f"| head | MT-bench chain {a.steps} accept length ({a.turns} turns, {length}) | "
          "first-draft agreement |\n|---|---|---|")
    for head_dir in a.heads:
        tallies = measure(target, head_dir, answers, a.steps, a.new_tokens, categories, a.stop_at_eos)
        print(tallies[""].row(head_dir), flush=True)
        if a.by_category:
            for category in dict.fromkeys(categories):
                print(tallies[category].row(f"{head_dir}: {category}"), flush=True)


if __name__ == "__main__":
    main()
