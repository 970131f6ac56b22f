"""EAGLE-3 at adaptive step 0 against plain decoding: step-0 steps as rounds (park_head off) with the round's next
verify queued ahead (speculative/verify_ahead.py), and as plain decodes with the head parked (the default;
speculative/proposers/slot_hidden.py).

Adaptive tiers give large batches step 0 (64 requests and up on SGLang's default ladder), where a round drafts
nothing; an EAGLE head still needs every token. Four engines per batch size over the SmolLM2-135M shape (random bf16
weights, an EAGLE-3 head, CUDA graphs to 256) live in one process and are measured in turns, so all see the same host:
plain decoding (its decode queued ahead), and EAGLE-3 under the default adaptive ladder (step 0 from 64 requests),
rounds or parked; and NGRAM at step 0 (the plain worker's step without a head to feed: the speculative worker's own
host cost). Wall time per engine step, median over turns.

  python -m benchmarks.probes.step_zero [--batch 64 128 256] [--steps 100] [--turns 3] [--out $OUT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch

from benchmarks.common import require_cuda
from benchmarks.e2e.engines import SMOLLM2, free, make_engine, step_us, write_configs
from hyperdraft.sampling_params import SamplingParams

PROMPT_LEN = 128


def started_engine(target: str, spec: dict | None, batch: int, steps: int, turns: int, **switches):
    engine, _ = make_engine(target, "cuda", 256, spec, batch * (PROMPT_LEN + (turns + 1) * steps + 64), **switches)
    params = SamplingParams(temperature=0.0, max_new_tokens=(turns + 1) * steps + 32, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for prompt in torch.randint(10, SMOLLM2["vocab_size"] - 10, (batch, PROMPT_LEN), generator=g).tolist():
        engine.add_request(input_ids=prompt, params=params)
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    return engine


def measure(target: str, head: str, batch: int, steps: int, turns: int) -> dict[str, list[float]]:
    eagle = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_adaptive=True)
    ngram = dict(speculative_algorithm="NGRAM", speculative_adaptive=True)
    engines = {"plain": started_engine(target, None, batch, steps, turns),
               "EAGLE-3 step 0, rounds (verify-ahead)": started_engine(target, eagle, batch, steps, turns,
                                                                       park_head=False),
               "EAGLE-3 step 0, parked": started_engine(target, eagle, batch, steps, turns),
               "NGRAM step 0 (idle)": started_engine(target, ngram, batch, steps, turns)}
    walls: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(turns):
        for name, engine in engines.items():
            walls[name].append(step_us(engine, steps))
    used = engines["EAGLE-3 step 0, rounds (verify-ahead)"].worker.verify_ahead.used
    queued = engines["EAGLE-3 step 0, parked"].worker.plain.ahead_used
    for engine in engines.values():
        free(engine)
    print(batch, {k: [round(w) for w in v] for k, v in walls.items()}, "verify-ahead used", used,
          "decode-ahead used (parked)", queued, flush=True)
    return walls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    require_cuda()
    root = tempfile.mkdtemp()
    target, head = write_configs(root, SMOLLM2, 8192)
    lines = [f"SmolLM2 shape, bf16, greedy; {a.steps} steps x {a.turns} turns; median us per engine step "
             "(tok/s = batch / step time: step 0 emits one token per request)",
             "| batch | row | us per step | tok/s | vs plain | turns |", "|---|---|---|---|---|---|"]
    for batch in a.batch:
        walls = measure(target, head, batch, a.steps, a.turns)
        plain = statistics.median(walls["plain"])
        for name, runs in walls.items():
            wall = statistics.median(runs)
            lines.append(f"| {batch} | {name} | {wall:.0f} | {batch / wall * 1e6:.0f} | {plain / wall:.2f}x | "
                         f"{' '.join(f'{w:.0f}' for w in runs)} |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, "step_zero.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
