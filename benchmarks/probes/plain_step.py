"""A small model's plain decode step against its graph replay (issue 27: the step may cost at most 1.2x the replay),
with one RuntimeOptions switch off and on (default: fused_norm_gemv, the one-row norm-in-projection fusion).

Two engines over the SmolLM2-135M shape (random bf16 weights, batch 1, CUDA graphs) live in one process and are
measured in turns, so both see the same host. For each: the wall time of an engine step (scheduler, graph fill,
replay, sampling, the host copy and the commit), and the GPU time of the step's target graph alone, replayed back to
back between CUDA events (the replays queue faster than they run, so this is the graph's GPU time, not the host's).

  python -m benchmarks.probes.plain_step [--steps 600] [--turns 3] [--switch kv_in_attention] [--batch 1] [--out $OUT]

--batch N decodes N requests a step (the graph of N rows: 2..16 rows take the few-row kernels a verify takes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile

import torch

from benchmarks.common import require_cuda
from benchmarks.e2e.engines import SMOLLM2, make_engine, step_us, write_configs
from hyperdraft.options import RuntimeOptions
from hyperdraft.sampling_params import SamplingParams

PROMPT_LEN = 512


def started_engine(target: str, switch: str, on: bool, steps: int, turns: int, batch: int = 1):
    params = SamplingParams(temperature=0.0, max_new_tokens=(turns + 1) * steps + 100, ignore_eos=True)
    # each request's whole length, and no more: a flat 32k tokens a request outgrew the H200 at batch 256
    engine, _ = make_engine(target, "cuda", batch, None, batch * (PROMPT_LEN + params.max_new_tokens + 64),
                            **{switch: on})
    for _ in range(batch):
        engine.add_request(input_ids=torch.randint(10, SMOLLM2["vocab_size"] - 10, (PROMPT_LEN,)).tolist(),
                           params=params)
    for _ in range(30):
        engine.step()
    torch.cuda.synchronize()
    return engine


def replay_us(engine, steps: int) -> float:
    """GPU time of the decode graph the steps used most (one token a request), replayed `steps` times."""
    graphs = engine.runner.graphs
    key = graphs.replays.most_common(1)[0][0]
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        for segment in graphs.graphs[key]:
            segment.replay()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--switch", default="fused_norm_gemv",
                    choices=[f.name for f in dataclasses.fields(RuntimeOptions) if f.type in (bool, "bool")])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    require_cuda()
    target, _ = write_configs(tempfile.mkdtemp(), SMOLLM2, 8192)
    engines = {on: started_engine(target, a.switch, on, a.steps, a.turns, a.batch) for on in (False, True)}
    walls: dict[bool, list[float]] = {False: [], True: []}
    replays: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(a.turns):
        for fused, engine in engines.items():
            walls[fused].append(step_us(engine, a.steps))
            replays[fused].append(replay_us(engine, a.steps))
    lines = [f"smollm2 plain decode, batch {a.batch}, {a.steps} steps x {a.turns} turns (medians, us)",
             f"| {a.switch} | engine step | graph replay (GPU) | step / replay | turns (step) |",
             "|---|---|---|---|---|"]
    for fused in (False, True):
        wall, replay = statistics.median(walls[fused]), statistics.median(replays[fused])
        lines.append(f"| {'on' if fused else 'off'} | {wall:.1f} | {replay:.1f} | {wall / replay:.2f}x | "
                     f"{' '.join(f'{w:.0f}' for w in walls[fused])} |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, "plain_step.txt"), "w") as f:
        f.write(text + "\n")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
