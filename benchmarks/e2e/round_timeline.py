"""Where a batch-1 speculative round's wall time goes, from CUDA events (no profiler, PDL as in the real run).

Events are recorded on the compute stream at host points of each step: step entry, before and after the verify
forward, before and after draft-ahead. An event's GPU timestamp is when the stream reached it: if the host enqueued
it late, the GPU idled until then. So "step entry - previous draft end" is GPU time lost waiting for the host to come
back from the previous step's results (plus a few us of event overhead), and the other spans are GPU work.

Run on a GPU machine: python -m benchmarks.e2e.round_timeline [--steps 5] [--no-pdl] [--out $OUT] ; prints medians
in us per round and writes OUT/round_timeline<PROFILE_TAG>.txt (PROFILE_TAG from the environment, default empty).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from benchmarks.common import require_cuda
from benchmarks.e2e.engines import LLAMA_8B, SMOLLM2, eagle3_spec, make_engine, write_configs
from hyperdraft.sampling_params import SamplingParams
from hyperdraft.speculative.verify.chain import ChainRound
from hyperdraft.speculative.verify.tree import TreeRound

SHAPES = {"llama-8b": (LLAMA_8B, 32000), "smollm2": (SMOLLM2, 8192)}
SPANS = (("host wait before step", "draft_end", "entry"), ("pre-verify work", "entry", "verify_start"),
         ("verify forward", "verify_start", "verify_end"), ("accept", "verify_end", "draft_start"),
         ("draft-ahead", "draft_start", "draft_end"))


class Marks:
    """Named events per step, each with the host time at which it was enqueued; the wrapped methods call mark(name).
    An event's lead (GPU time at which the stream reached it minus the host time at which it was enqueued, both from
    one synced origin) is how far the host ran ahead of the GPU there: near zero, the GPU was waiting for the host."""

    def __init__(self):
        self.steps: list[dict] = []
        self.host: list[dict] = []
        torch.cuda.synchronize()
        self.origin = torch.cuda.Event(enable_timing=True)
        self.origin.record()
        self.t0 = time.perf_counter()

    def mark(self, name: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.steps[-1][name] = ev
        self.host[-1][name] = time.perf_counter() - self.t0

    def leads(self) -> dict[str, tuple[float, float, float]]:
        """-> {mark: (median lead, median host time since the step's entry, median GPU time since it)} in us."""
        out: dict[str, list[tuple[float, float, float]]] = {}
        for evs, host in zip(self.steps, self.host):
            entry_gpu, entry_host = self.origin.elapsed_time(evs["entry"]) * 1000, host["entry"] * 1e6
            for name, ev in evs.items():
                gpu, cpu = self.origin.elapsed_time(ev) * 1000, host[name] * 1e6
                out.setdefault(name, []).append((gpu - cpu, cpu - entry_host, gpu - entry_gpu))
        return {k: tuple(statistics.median(x[i] for x in v) for i in range(3)) for k, v in out.items()}


def instrument(engine, marks: Marks) -> None:
    """Wrap the step's host points so each records a mark first (timing only; what they do is unchanged): this engine's
    SpecWorker.run, its target runner's forward (the verify) and its proposer's draft_ahead (instance attributes), and
    the round's constructor and accept (ChainRound or TreeRound: the class, for the rest of the process: this script
    runs one engine)."""
    worker, runner, proposer = engine.worker, engine.worker.runner, engine.worker.proposer
    run, forward, ahead = worker.run, runner.forward, proposer.draft_ahead

    def run_marked(batch):
        marks.steps.append({})
        marks.host.append({})
        marks.mark("entry")
        return run(batch)

    def forward_marked(fb, **kw):
        marks.mark("verify_start")
        out = forward(fb, **kw)
        marks.mark("verify_end")
        return out

    def ahead_marked(*a, **kw):
        marks.mark("draft_start")
        out = ahead(*a, **kw)
        marks.mark("draft_end")
        return out

    worker.run, runner.forward, proposer.draft_ahead = run_marked, forward_marked, ahead_marked
    round_cls = TreeRound if engine.worker.spec.is_tree else ChainRound
    init, accept = round_cls.__init__, round_cls.accept

    def init_marked(self, *a, **kw):
        init(self, *a, **kw)
        marks.mark("round_built")

    def accept_marked(self, *a, **kw):
        marks.mark("accept_start")
        out = accept(self, *a, **kw)
        marks.mark("accept_end")
        return out

    round_cls.__init__, round_cls.accept = init_marked, accept_marked


def spans(marks: Marks) -> dict[str, float]:
    rows: dict[str, list[float]] = {name: [] for name, _, _ in SPANS}
    rows["round"] = []
    for prev, cur in zip(marks.steps, marks.steps[1:]):
        if "draft_end" not in prev or not all(b in cur for _, _, b in SPANS):
            continue
        for name, a, b in SPANS:
            start = (prev if b == "entry" else cur)[a]  # only the host wait spans two steps
            rows[name].append(start.elapsed_time(cur[b]) * 1000)
        rows["round"].append(prev["draft_end"].elapsed_time(cur["draft_end"]) * 1000)
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    if rows["round"]:  # the tail: rounds the host made the GPU wait for (a collection, a descheduled thread)
        ordered = sorted(rows["round"])
        med["round mean"] = statistics.fmean(ordered)
        med["round p90"] = ordered[int(0.9 * (len(ordered) - 1))]
        med["round max"] = ordered[-1]
    return med


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.round_timeline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--topk", type=int, default=1, help="> 1: a tree of --draft-tokens nodes (gpu_bench's tree5x4/8: "
                    "--steps 5 --topk 4 --draft-tokens 8)")
    ap.add_argument("--draft-tokens", type=int, default=None, help="verify width (default: steps + 1)")
    ap.add_argument("--sibling-rate", type=float, default=None, help="trees: simulated sibling acceptance")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b",
                    help="target shape (random weights): llama-8b (EAGLE-3 head, 32k draft vocabulary) or smollm2 "
                         "(SmolLM2-135M, 8k draft vocabulary, as train-draft's head)")
    ap.add_argument("--alpha", type=float, default=0.8, help="simulated acceptance rate")
    ap.add_argument("--no-pdl", action="store_true", help="build the engine with RuntimeOptions pdl=False")
    ap.add_argument("--profile", action="store_true",
                    help="then cProfile as many more rounds: where the host's time per round goes (round_profile.txt)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output directory (default: $OUT or .)")
    a = ap.parse_args()
    require_cuda()
    shape, draft_vocab = SHAPES[a.shape]
    target, head = write_configs(tempfile.mkdtemp(), shape, draft_vocab)
    switches = {"pdl": False} if a.no_pdl else {}
    plain_us = plain_step_us(target, shape, a.rounds, switches)
    width = a.draft_tokens or a.steps + 1
    spec = eagle3_spec(head, steps=a.steps, topk=a.topk, num_draft_tokens=width, alpha=a.alpha,
                       sibling_rate=a.sibling_rate)
    engine, _ = make_engine(target, "cuda", 8, spec, 8 * 4096, **switches)
    params = SamplingParams(temperature=0.0, max_new_tokens=((1 + a.profile) * a.rounds + 30) * (a.steps + 1),
                            ignore_eos=True)
    req = engine.add_request(input_ids=prompt(shape), params=params)
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    marks = Marks()
    instrument(engine, marks)
    for _ in range(a.rounds):
        engine.step()
    torch.cuda.synchronize()
    profile = host_profile(engine, a.rounds) if a.profile else ""
    engine.abort(req.rid)
    med = spans(marks)
    draft = f"chain {a.steps}" if a.topk == 1 else f"tree {a.steps}x{a.topk}/{width}"
    lines = [f"{a.shape}, {draft}, alpha {a.alpha}, batch 1, {a.rounds} rounds: median us per round (CUDA events)"]
    lines += [f"{k:<24} {v:9.1f}" for k, v in med.items()]
    lines += [f"{'plain decode step':<24} {plain_us:9.1f}   (wall, same shape and process; round / step = "
              f"{med.get('round', float('nan')) / plain_us:.2f})"]
    lines += ["", "per mark, median us: lead of the host over the GPU (near 0: the GPU waited for the host), "
              "host time and GPU time since the step's entry"]
    lines += [f"{k:<24} {lead:9.1f} {cpu:9.1f} {gpu:9.1f}" for k, (lead, cpu, gpu) in marks.leads().items()]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, f"round_timeline{os.environ.get('PROFILE_TAG', '')}.txt"), "w") as f:
        f.write(text + "\n")
    if profile:
        print(profile)
        with open(os.path.join(a.out, "round_profile.txt"), "w") as f:
            f.write(profile + "\n")


def prompt(shape: dict) -> list[int]:
    return torch.randint(10, shape["vocab_size"] - 10, (512,)).tolist()


def plain_step_us(target: str, shape: dict, steps: int, switches: dict) -> float:
    """Wall time of a plain batch-1 decode step (graph replay plus the engine's host work), for the round's ratio."""
    engine, _ = make_engine(target, "cuda", 8, None, 8 * 4096, **switches)
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 40, ignore_eos=True)
    req = engine.add_request(input_ids=prompt(shape), params=params)
    for _ in range(20):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    engine.abort(req.rid)
    del engine
    torch.cuda.empty_cache()
    return seconds / steps * 1e6


def host_profile(engine, rounds: int, top: int = 40) -> str:
    """cProfile of `rounds` engine steps: host functions by cumulative, then own, time (the CUDA-event marks stay
    installed; their cost is a few us per round)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(rounds):
        engine.step()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    out.write(f"host profile of {rounds} rounds (divide by it for per-round times)\n")
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


if __name__ == "__main__":
    main()
