"""Detokenization per engine step: what one request-step costs on the host when each request decodes its own windows
through transformers (the old path), when each pushes alone through the Rust tokenizer, and when the whole step goes
through one push_all (hyperdraft/detokenizer.py). Each request streams the test tokenizer's (byte-level BPE)
tokens of MT-bench questions, from its own offset, one token a step, with a stop string to look for; CPU.

  python -m benchmarks.probes.detok_batch          -> stdout (results/detok_batch_cpu.md)
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

from transformers import AutoTokenizer

from benchmarks.common import MT_BENCH
from hyperdraft import detokenizer
from hyperdraft.detokenizer import IncrementalDetokenizer, push_all
from hyperdraft.testing.tiny import make_tiny_model


def transformers_decode(tokenizer, sequences, skip_special_tokens):
    return [tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]


def per_request_step_us(tok, text_ids: list[int], batch: int, steps: int, mode: str) -> float:
    rng = random.Random(0)
    offsets = [rng.randrange(len(text_ids) - steps) for _ in range(batch)]
    detoks = [IncrementalDetokenizer(tok, ["STOP"]) for _ in range(batch)]
    start = time.perf_counter()
    for step in range(steps):
        pushes = [(d, [text_ids[o + step]], False) for d, o in zip(detoks, offsets)]
        if mode == "batched":
            push_all(pushes)
        else:
            for d, ids, final in pushes:
                d.push(ids, final=final)
    return (time.perf_counter() - start) / steps / batch * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.detok_batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(make_tiny_model(tempfile.mkdtemp(), "llama"))
    with open(MT_BENCH) as f:
        text_ids = tok.encode(" ".join(json.loads(line)["turns"][0] for line in f))
    fast = detokenizer.decode_many
    print("| requests | transformers decode, each alone (us) | Rust decode, each alone (us) | push_all (us) |")
    print("|---|---|---|---|")
    for batch in args.batch:
        detokenizer.decode_many = transformers_decode
        old = per_request_step_us(tok, text_ids, batch, args.steps, "alone")
        detokenizer.decode_many = fast
        alone = per_request_step_us(tok, text_ids, batch, args.steps, "alone")
        batched = per_request_step_us(tok, text_ids, batch, args.steps, "batched")
        print(f"| {batch} | {old:.1f} | {alone:.1f} | {batched:.1f} |")


if __name__ == "__main__":
    main()
