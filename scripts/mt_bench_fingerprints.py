"""Write hyperdraft/training/mt_bench_hashes.py: the hashes of MT-bench's questions (every turn) that train-draft
refuses as training prompts wherever it runs (training/evaluation_set.py says what they are).

  python scripts/mt_bench_fingerprints.py [QUESTIONS.jsonl]    (default: ../shared/data/mt_bench_questions.jsonl)
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hyperdraft.training.evaluation_set import fingerprint, shingles  # noqa: E402

MODULE = os.path.join(os.path.dirname(__file__), "..", "hyperdraft", "training", "mt_bench_hashes.py")


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                                                              "mt_bench_questions.jsonl")
    with open(path) as f:
        turns = [turn for line in f if line.strip() for turn in json.loads(line)["turns"]]
    prints = " ".join(sorted({fingerprint(t) for t in turns}))
    runs = [" ".join(sorted(shingles(t))) for t in turns]
    lines = ['"""MT-bench\'s questions, every turn, as hashes (training/evaluation_set.py); written by',
             'scripts/mt_bench_fingerprints.py, not by hand."""', "", "FINGERPRINTS = ("]
    lines += [f'    "{chunk} "' for chunk in textwrap.wrap(prints, 108)] + [")", "", "SHINGLES = ("]
    for question in runs:  # one string a question, in chunks a line
        chunks = textwrap.wrap(question, 108) or [""]
        lines += [f'    "{chunk} "' for chunk in chunks[:-1]] + [f'    "{chunks[-1]}",']
    lines += [")", ""]
    with open(MODULE, "w") as f:
        f.write("\n".join(lines))
    print(f"{len(turns)} turns, {len(set(prints.split()))} fingerprints, {sum(len(r.split()) for r in runs)} "
          f"shingles -> {MODULE}")


if __name__ == "__main__":
    main()
