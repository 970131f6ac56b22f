"""Rounds whose drafts are drawn from q (rejection sampling) as one graph each, against the same rounds step by step.

Issue 27 asks for sampled rounds in one graph. Two engines over the SmolLM2-135M shape (random bf16 weights, an
EAGLE-3 head with an 8k draft vocabulary, simulated acceptance alpha 0.8: the accept decision is replaced, every
draft, sampling and verify kernel still runs) differ in RuntimeOptions.sampling_round_graphs alone. Every request
samples (temperature 0.8, top-p 0.95, its own seed), so every round draws its drafts from q; the penalised row adds
a repetition penalty (1.1) to every request. The engines run in
turns in one process and the table gives the median wall time of an engine step; the simulated coins are seeded,
so both engines accept the same tokens and the step time ratio is the speed ratio.

  python -m benchmarks.probes.drawn_round [--steps 300] [--turns 3] [--device cpu] [--out $OUT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from dataclasses import dataclass

import torch

from benchmarks.common import require_cuda
from benchmarks.e2e.engines import SMOLLM2, TINY, eagle3_spec, make_engine, step_us, write_configs
from hyperdraft.sampling_params import SamplingParams

@dataclass(frozen=True)
class Row:
    name: str
    steps: int
    topk: int
    num_draft_tokens: int
    batch: int
    repetition_penalty: float = 1.0


ROWS = [Row("chain 5", 5, 1, 6, 1), Row("chain 5", 5, 1, 6, 8), Row("tree 5x4/8", 5, 4, 8, 1),
        Row("chain 5, penalised", 5, 1, 6, 1, repetition_penalty=1.1)]
PROMPT_LEN = 256


def started_engine(target: str, head: str, row: Row, graphs: bool, device: str, steps: int, turns: int):
    spec = dict(eagle3_spec(head, row.steps, row.topk, row.num_draft_tokens, alpha=0.8),
                speculative_use_rejection_sampling=True)
    engine, _ = make_engine(target, device, row.batch, spec, 8 * 4096, sampling_round_graphs=graphs)
    vocab = engine.model_config.vocab_size
    for i in range(row.batch):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_new_tokens=(turns + 1) * steps * 8 + 200,
                                repetition_penalty=row.repetition_penalty, ignore_eos=True)
        engine.add_request(input_ids=torch.randint(10, vocab - 10, (PROMPT_LEN,)).tolist(), params=params)
    for _ in range(30):
        engine.step()
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (tiny shape, emulated graphs)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if a.device == "cuda":
        require_cuda()
    cuda = a.device == "cuda"
    target, head = write_configs(tempfile.mkdtemp(), SMOLLM2 if cuda else TINY, 8192 if cuda else 256)
    lines = [f"drawn rounds (temperature 0.8, top-p 0.95), EAGLE-3 head, alpha 0.8; median us per engine step over "
             f"{a.turns} turns of {a.steps} steps", "",
             "| round | batch | step by step | one graph | speed-up | sampling graphs replayed |",
             "|---|---|---|---|---|---|"]
    for row in ROWS:
        engines = {on: started_engine(target, head, row, on, a.device, a.steps, a.turns) for on in (False, True)}
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(a.turns):
            for on, engine in engines.items():
                times[on].append(step_us(engine, a.steps))
        loop = engines[True].worker.proposer.draft_loop
        replayed = sum(n for k, n in loop.replays.items() if k.sampling is not None)
        off, on = (statistics.median(times[d]) for d in (False, True))
        lines.append(f"| {row.name} | {row.batch} | {off:.1f} | {on:.1f} | {off / on:.2f}x | {replayed} |")
        print(lines[-1], flush=True)
        for engine in engines.values():
            engine.close()
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, "drawn_round.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
