"""Write hyperdraft/training/evaluation_set.py's fingerprints of MT-bench's questions (every turn), so train-draft
refuses them as training prompts wherever it runs, with or without the questions file beside it.

  python scripts/mt_bench_fingerprints.py [QUESTIONS.jsonl]    (default: ../shared/data/mt_bench_questions.jsonl)
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from hyperdraft.training.evaluation_set import fingerprint  # noqa: E402

MODULE = os.path.join(os.path.dirname(__file__), "..", "hyperdraft", "training", "evaluation_set.py")
BEGIN, END = "MT_BENCH_FINGERPRINTS = frozenset({\n", "})\n"


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                                                              "mt_bench_questions.jsonl")
    with open(path) as f:
        turns = [turn for line in f if line.strip() for turn in json.loads(line)["turns"]]
    prints = sorted({fingerprint(t) for t in turns})
    with open(MODULE) as f:
        text = f.read()
    head, rest = text.split(BEGIN)
    body = "".join(f'    "{p}",\n' for p in prints)
    with open(MODULE, "w") as f:
        f.write(head + BEGIN + body + END + rest.split(END, 1)[1])
    print(f"{len(turns)} turns, {len(prints)} fingerprints -> {MODULE}")


if __name__ == "__main__":
    main()
