"""Host time of NGRAM's prompt lookup against a full cross-request history (speculative/proposers/ngram.py), per
request per round, for a last token that occurs rarely or often in the history.

The history holds 65,536 tokens (HISTORY_TOKENS) drawn from a Zipf law (exponent 1.2, a 49,152-token vocabulary, as
chat text: a few tokens make up much of it); the request's own sequence is 400 such tokens whose last token is set
to one of the given count in the history. Mean us per ngram_match call (chain of 4 drafts, windows 1..12). Then
long matches, as in a code edit: a request whose answer copies a 300-token block of its prompt, looked up at 200
points inside the copy (suffixes that recur for the whole window), without and with the history.

  python -m benchmarks.probes.ngram_match [--calls 200] [--out $OUT]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from hyperdraft.speculative.proposers.ngram import HISTORY_TOKENS, ngram_match

VOCAB = 49152


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    history = np.minimum(rng.zipf(1.2, HISTORY_TOKENS), VOCAB - 1).astype(np.int64)
    sequence = np.minimum(rng.zipf(1.2, 400), VOCAB - 1).astype(np.int64)
    tokens, counts = np.unique(history, return_counts=True)
    lines = ["| last token's occurrences in the history (or: a long match) | us per lookup |", "|---|---|"]
    for want in (10, 500, 5000, int(counts.max())):
        token = int(tokens[np.argmin(np.abs(counts - want))])
        seq = sequence.copy()
        seq[-1] = token
        start = time.perf_counter()
        for _ in range(a.calls):
            ngram_match(seq, 4, 1, 12, history)
        lines.append(f"| {int((history == token).sum())} | {(time.perf_counter() - start) / a.calls * 1e6:.1f} |")
    block = np.minimum(rng.zipf(1.2, 300), VOCAB - 1).astype(np.int64)
    copied = np.concatenate([sequence[:100], block, block])
    for name, hist in (("code edit, no history", None), ("code edit, with the history", history)):
        start = time.perf_counter()
        for i in range(a.calls):
            ngram_match(copied[: len(copied) - i % 200], 4, 1, 12, hist)
        lines.append(f"| {name} | {(time.perf_counter() - start) / a.calls * 1e6:.1f} |")
    text = "\n".join(lines)
    print(text)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "ngram_match.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
