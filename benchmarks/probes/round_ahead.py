"""A drafted chain round's next verify queued with its next draft (round-ahead, speculative/verify_ahead.py) against
the same rounds without it, and plain decoding, on the SmolLM2-135M shape (random bf16 weights, an EAGLE-3 head with
an 8k draft vocabulary, simulated acceptance alpha so both engines accept alike, CUDA graphs).

Engines of one batch size live in one process and are measured in turns, so all see the same host: wall time per
engine step and tokens per second (output tokens of the timed steps over their wall time), median over turns.

  python -m benchmarks.probes.round_ahead [--shape smollm2] [--batch 1 4 16] [--steps 5] [--topk 1]
      [--draft-tokens N] [--alpha 0.7] [--rounds 200] [--turns 3] [--out $OUT]

--topk above 1 drafts trees of --draft-tokens nodes (simulated acceptance of first children only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from benchmarks.common import require_cuda
from benchmarks.e2e.engines import LLAMA_8B, SMOLLM2, eagle3_spec, free, make_engine, sync, write_configs
from hyperdraft.sampling_params import SamplingParams

PROMPT_LEN = 256
SHAPES = {"smollm2": SMOLLM2,  # Qwen2.5-1.5B's sizes in a Llama config: the mid-size target between the other two
          "1.5b": dict(SMOLLM2, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, head_dim=128, vocab_size=151936),
          "8b": LLAMA_8B}


def started_engine(target: str, spec: dict | None, batch: int, budget: int, **switches):
    engine, _ = make_engine(target, "cuda", 16, spec, batch * (PROMPT_LEN + budget + 64), **switches)
    params = SamplingParams(temperature=0.0, max_new_tokens=budget, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for prompt in torch.randint(10, 30000, (batch, PROMPT_LEN), generator=g).tolist():
        engine.add_request(input_ids=prompt, params=params)
    for _ in range(20):
        engine.step()
    sync(engine)
    return engine


def timed(engine, steps: int) -> tuple[float, float]:
    """-> (us per step, tokens per second) over `steps` steps."""
    reqs = list(engine.scheduler.running)
    before = sum(len(r.output_ids) for r in reqs)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine)
    seconds = time.perf_counter() - start
    return seconds / steps * 1e6, (sum(len(r.output_ids) for r in reqs) - before) / seconds


def measure(target: str, head: str, batch: int, a) -> list[str]:
    width = a.draft_tokens or a.steps + 1
    spec = eagle3_spec(head, steps=a.steps, topk=a.topk, num_draft_tokens=width, alpha=a.alpha)
    budget = (a.turns + 1) * a.rounds * (a.steps + 1) + 64
    label = f"chain {a.steps}" if a.topk == 1 else f"tree {a.steps}x{a.topk}/{width}"
    engines = {"plain": started_engine(target, None, batch, budget),
               f"{label}, round-ahead off": started_engine(target, spec, batch, budget, round_ahead=False),
               f"{label}, round-ahead on": started_engine(target, spec, batch, budget)}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for _ in range(a.turns):
        for name, engine in engines.items():
            runs[name].append(timed(engine, a.rounds))
    used = engines[f"{label}, round-ahead on"].worker.verify_ahead.used
    for engine in engines.values():
        free(engine)
    plain = statistics.median(t for _, t in runs["plain"])
    rows = []
    for name, r in runs.items():
        us, tps = statistics.median(u for u, _ in r), statistics.median(t for _, t in r)
        turns = " ".join(f"{t:.0f}" for _, t in r)
        rows.append(f"| {batch} | {name} | {us:.1f} | {tps:.0f} | {tps / plain:.2f}x | {turns} |")
    print("\n".join(rows), f"\nqueued verifies used: {used}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="smollm2")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--topk", type=int, default=1)
    ap.add_argument("--draft-tokens", type=int, default=None, help="tree nodes a request (default: steps + 1)")
    ap.add_argument("--alpha", type=float, default=0.7)
    ap.add_argument("--rounds", type=int, default=200, help="engine steps per turn")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    require_cuda()
    target, head = write_configs(tempfile.mkdtemp(), SHAPES[a.shape], 8192)
    title = (f"{a.shape} shape, EAGLE-3 steps {a.steps} topk {a.topk}, simulated alpha {a.alpha}, "
             f"{a.rounds} steps x {a.turns} turns")
    lines = [title, "", "| batch | engine | us per step | tok/s | vs plain | turns (tok/s) |", "|---|---|---|---|---|---|"]
    for batch in a.batch:
        lines += measure(target, head, batch, a)
    with open(os.path.join(a.out, f"round_ahead_{a.shape}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
