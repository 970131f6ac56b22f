"""Several trained heads' first-draft acceptance under rejection sampling on MT-bench, without a GPU: the expected
acceptance of a draft sampled from the head, sum_x min(p_T(x), q_T(x)), averaged over the answer positions of the
target's greedy answers to MT-bench first turns (CPU, fp32). p_T is the target's distribution at temperature T, q_T
the head's over its draft vocabulary at T (zero elsewhere), as the engine drafts and verifies at T. head_ab.py counts
greedy acceptance; a head trained towards the target's argmax (train-draft --hard-label-weight) can gain there and
lose here, which this probe shows.

  python -m benchmarks.probes.sampled_accept HEAD_DIR [HEAD_DIR ...] [--turns 40] [--new-tokens 128]
      [--temperature 0.7 1.0]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.probes.head_ab import greedy_answers
from hyperdraft.models.default_model import ensure_default_model
from hyperdraft.training.unroll_rounds import load_target_and_head, unrolled_logits


def sampled_overlap(target_logits: torch.Tensor, draft_logits: torch.Tensor, draft_ids: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    """target_logits [n, V], draft_logits [n, Vd] over the target ids draft_ids [Vd] -> [n]: sum_x min(p_T, q_T),
    the chance that rejection sampling accepts a draft drawn from q_T."""
    p = torch.softmax(target_logits.float() / temperature, -1)
    q = torch.zeros_like(p)
    q[:, draft_ids] = torch.softmax(draft_logits.float() / temperature, -1)
    return torch.minimum(p, q).sum(-1)


def first_draft_logits(model, head, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (target logits labelling each head position [len(ids) - 2, V], the head's first-draft logits there
    [len(ids) - 2, Vd]): head position i is fed ids[i + 1] and drafts ids[i + 2], labelled by the target at i + 1."""
    final, (drafts,) = unrolled_logits(model, head, ids, 1)
    with torch.no_grad():
        return model.compute_logits(final[1:len(ids) - 1]), drafts


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.sampled_accept", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.7, 1.0])
    a = ap.parse_args()
    if not all(t > 0 for t in a.temperature):
        ap.error(f"--temperature: each must be > 0 (greedy acceptance is head_ab's), got {a.temperature}")
    target = ensure_default_model(progress=False)
    answers = greedy_answers(target, a.turns, a.new_tokens)
    print(f"| head ({a.turns} turns, {a.new_tokens} tokens) | "
          + " | ".join(f"first draft accepted at T = {t:g}" for t in a.temperature) + " |")
    print("|---|" + "---|" * len(a.temperature))
    for head_dir in a.heads:
        model, head = load_target_and_head(target, head_dir)
        sums, positions = torch.zeros(len(a.temperature), dtype=torch.float64), 0
        for prompt, answer in answers:
            labels, drafts = first_draft_logits(model, head, prompt + answer)
            rows = slice(len(prompt) - 2, None)  # the drafts of answer tokens
            for k, t in enumerate(a.temperature):
                sums[k] += float(sampled_overlap(labels[rows], drafts[rows], head.draft_to_target, t).sum())
            positions += len(answer)
        print(f"| {head_dir} | " + " | ".join(f"{s / positions:.4f}" for s in sums.tolist()) + " |", flush=True)


if __name__ == "__main__":
    main()
