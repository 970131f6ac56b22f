"""Python's cyclic GC pauses on an engine's critical path: the startup heap as built, frozen, and frozen with the
youngest generation's collections deferred (engine/gc_policy.py: the server and tensor-parallel follower ranks do
both once their engine is built).

One engine (random weights: the 8-layer TINY shape on the CPU, the SmolLM2-135M shape on a GPU) decodes waves of
--batch requests; every collection is timed through gc.callbacks. The same engine runs --steps steps with its heap as
built, then freeze_startup_heap() and --steps more, then defer_young_collections() and --steps more; then all
three again after gc.unfreeze() and CPython's thresholds (two turns), so the phases see the same process. Reports per
phase: steps, wall time per step, collections by generation, time in the oldest generation's collections and the
longest pause.

  python -m benchmarks.probes.gc_pause [--device cpu] [--batch 256] [--steps 600] [--out $OUT]
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time

import torch

from benchmarks.e2e.engines import SMOLLM2, TINY, make_engine, sync, write_configs
from hyperdraft.engine.gc_policy import defer_young_collections, freeze_startup_heap
from hyperdraft.sampling_params import SamplingParams

PROMPT_LEN = 64
NEW_TOKENS = 96


class PauseLog:
    """Every collection's generation and duration, from gc.callbacks."""

    def __init__(self):
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0
        gc.callbacks.append(self._observe)

    def _observe(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def take(self) -> list[tuple[int, float]]:
        pauses, self.pauses = self.pauses, []
        return pauses


def decode_steps(engine, batch: int, steps: int, vocab: int, seed: int) -> float:
    """Run `steps` engine steps, topping the batch up with new requests as waves finish -> wall seconds."""
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    for _ in range(steps):
        if not engine.has_unfinished():
            for _ in range(batch):
                engine.add_request(input_ids=torch.randint(10, vocab - 10, (PROMPT_LEN,), generator=g).tolist(),
                                   params=params)
        engine.step()
    sync(engine)
    return time.perf_counter() - start


def phase_row(name: str, steps: int, seconds: float, pauses: list[tuple[int, float]]) -> str:
    by_gen = [sum(1 for gen, _ in pauses if gen == k) for k in range(3)]
    oldest = [s for gen, s in pauses if gen == 2]
    longest = max((s for _, s in pauses), default=0.0)
    return (f"| {name} | {steps} | {seconds / steps * 1e6:.0f} | {by_gen[0]} / {by_gen[1]} / {by_gen[2]} | "
            f"{sum(oldest) * 1e3:.1f} | {sum(s for _, s in pauses) * 1e3:.1f} | {longest * 1e3:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    shape = SMOLLM2 if a.device == "cuda" else TINY
    target, _ = write_configs(tempfile.mkdtemp(), shape, 512)
    engine, _ = make_engine(target, a.device, a.batch, None, a.batch * (PROMPT_LEN + NEW_TOKENS + 16))
    log = PauseLog()
    decode_steps(engine, a.batch, 2 * NEW_TOKENS, shape["vocab_size"], seed=0)  # warm-up: compiles, first waves
    log.take()
    lines = [f"gc pauses, {a.device}, batch {a.batch} (waves of {PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens)",
             "| heap | steps | us / step | collections, gen 0 / 1 / 2 | gen 2 time (ms) | all GC time (ms) | "
             "longest pause (ms) |", "|---|---|---|---|---|---|---|"]
    young = gc.get_threshold()
    for turn in range(2):  # in turns: the heap as built (thawed again for the second turn), frozen, then deferred
        if turn:
            gc.unfreeze()
            gc.set_threshold(*young)
        tracked = len(gc.get_objects())
        seconds = decode_steps(engine, a.batch, a.steps, shape["vocab_size"], seed=3 * turn + 1)
        lines.append(phase_row(f"as built ({tracked} objects tracked)", a.steps, seconds, log.take()))
        frozen = freeze_startup_heap()
        log.take()  # the freeze's own collection
        seconds = decode_steps(engine, a.batch, a.steps, shape["vocab_size"], seed=3 * turn + 2)
        lines.append(phase_row(f"frozen ({frozen} objects)", a.steps, seconds, log.take()))
        defer_young_collections()
        seconds = decode_steps(engine, a.batch, a.steps, shape["vocab_size"], seed=3 * turn + 3)
        lines.append(phase_row(f"frozen, youngest generation at {gc.get_threshold()[0]}", a.steps, seconds,
                               log.take()))
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, "gc_pause.txt"), "w") as f:
        f.write(text + "\n")
    engine.close()


if __name__ == "__main__":
    main()
