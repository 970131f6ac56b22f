"""How much of the target's MT-bench output a draft vocabulary can even propose (issue 26).

An EAGLE-3 head drafts only tokens of its draft vocabulary (train-draft picks the most frequent tokens of the
target's training answers). A target token outside it is a certain miss at that position. This probe ranks the
tokens of a train-draft answer store (OUT/samples.jsonl, gzip or not) by frequency, as train-draft does, and reports
the share of answer tokens that the top K cover: on held-out training answers and on the target's own greedy MT-bench
answers (CPU, fp32, the default model).

  python -m benchmarks.probes.draft_vocab_coverage --samples HEAD_DIR/samples.jsonl[.gz] [--turns 40]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random

import torch

from benchmarks.common import mt_bench_first_turns
from hyperdraft import LLM, SamplingParams
from hyperdraft.models.default_model import ensure_default_model

HELD_OUT = 2000  # answers kept out of the ranking, to measure coverage on unseen training-like text


def answers(path: str) -> list[list[int]]:
    """The answer tokens of each stored sample (a sample is [prompt + answer ids, prompt length]; null: skipped)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = [json.loads(line)["sample"] for line in f]
    return [ids[prompt_len:] for ids, prompt_len in (r for r in rows if r)]


def mt_bench_answers(turns: int, new_tokens: int) -> list[int]:
    llm = LLM(ensure_default_model(), device="cpu", dtype="float32")
    try:
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in mt_bench_first_turns()[:turns]]
        params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
        outs = llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        llm.shutdown()
    return [t for o in outs for t in o.token_ids]


def coverage(ranked: list[int], size: int, tokens: torch.Tensor, vocab: int) -> float:
    kept = torch.zeros(vocab, dtype=torch.bool)
    kept[torch.tensor(ranked[:size], dtype=torch.int64)] = True
    return kept[tokens].float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", required=True, help="a train-draft answer store, samples.jsonl or samples.jsonl.gz")
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 12288, 16384, 24576, 32768])
    a = ap.parse_args()
    stored = answers(a.samples)
    random.Random(0).shuffle(stored)
    held_out, ranked_from = stored[:HELD_OUT], stored[HELD_OUT:]
    counts = collections.Counter(t for ans in ranked_from for t in ans)
    ranked = [t for t, _ in counts.most_common()]
    mt_bench = torch.tensor(mt_bench_answers(a.turns, a.new_tokens))
    held = torch.tensor([t for ans in held_out for t in ans])
    vocab = int(max(mt_bench.max(), held.max(), max(ranked))) + 1
    print(f"{len(ranked_from)} stored answers ranked ({len(ranked)} distinct tokens); {len(held)} held-out answer "
          f"tokens; {len(mt_bench)} MT-bench answer tokens ({a.turns} turns x {a.new_tokens})")
    print("| draft vocabulary | held-out training answers | MT-bench answers |")
    print("|---|---|---|")
    for size in sorted(set(a.sizes + [len(ranked)])):
        print(f"| {size} | {coverage(ranked, size, held, vocab):.4f} | {coverage(ranked, size, mt_bench, vocab):.4f} |")


if __name__ == "__main__":
    main()
