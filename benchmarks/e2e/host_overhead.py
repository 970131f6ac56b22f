"""Host (Python) time per engine step outside the model forwards, on CPU with a tiny random model.

On a GPU a decode step is one graph replay; everything else in Engine.step (schedule, building the forward batch
and the sampling batch, dispatching the sampling / verify ops, the result copy, commit) is host time the GPU may sit
idle through. This measures that host time on CPU: each step's wall time minus the time spent inside
GraphedRunner.forward (target, draft model and EAGLE head forwards), through a timing wrapper installed here only.
The model is tiny (3 layers, hidden 32), so the ops outside the forwards run at their dispatch cost.

Cases: plain decode, EAGLE-3 chain, NGRAM chain (and EAGLE-3 tree), at batch 1 and 16, greedy. Speculative cases use
a simulated accept rate (0.8 by default, as e2e/gpu_bench.py does), so a step commits several tokens the way a
trained drafter's would. Not run by default (--cases): the EAGLE-3 chain under adaptive tiers that can only pick it,
and NGRAM with its tiers parked at step 0 (EMA and goodput), each against its fixed counterpart or plain decoding.

  python -m benchmarks.e2e.host_overhead                                 # this tree, one table
  python -m benchmarks.e2e.host_overhead --compare /tmp/base --repeats 5 --write   # old tree vs this one, interleaved
  python -m benchmarks.e2e.host_overhead --profile eagle3-chain --bs 16  # cProfile of the measured steps

--write: benchmarks/results/host_overhead_cpu.md. Each (tree, case, batch) runs in a fresh process: this file, run by
path with PYTHONPATH set to the tree, so the same measuring code imports each tree's hyperdraft. The timing and
counting wrappers below are instrumentation only (they change no engine behaviour).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import hashlib
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

# The repository root. Not benchmarks.common.REPO_ROOT: the worker processes import nothing from benchmarks/.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16)
CASES = {
    "plain": {},
    "eagle3-chain": dict(speculative_algorithm="EAGLE3", speculative_num_steps=5, speculative_eagle_topk=1,
                         speculative_num_draft_tokens=6, draft="eagle3"),
    "ngram-chain": dict(speculative_algorithm="NGRAM", speculative_num_steps=5, speculative_num_draft_tokens=6),
    "eagle3-tree": dict(speculative_algorithm="EAGLE3", speculative_num_steps=4, speculative_eagle_topk=4,
                        speculative_num_draft_tokens=8, draft="eagle3"),
    # adaptive tiers parked at step 0 (SGLang's ladder from 64 requests; goodput's choice where drafts do not pay):
    # every step is the plain worker's, so what it costs over "plain" is the speculative worker's wrapper
    "ngram-step0": dict(speculative_algorithm="NGRAM", speculative_adaptive=True,
                        speculative_adaptive_config='{"1": [0]}'),
    # the chain above under adaptive tiers that can only pick it: what adaptive bookkeeping costs a drafting step
    "eagle3-adaptive-chain": dict(speculative_algorithm="EAGLE3", speculative_adaptive=True, draft="eagle3",
                                  speculative_adaptive_config='{"1": [5]}'),
    "ngram-step0-goodput": dict(speculative_algorithm="NGRAM", speculative_adaptive=True,
                                speculative_adaptive_config='{"strategy": "goodput", "1": [0]}'),
}
DEFAULT_CASES = ("plain", "eagle3-chain", "ngram-chain", "eagle3-tree")
PROMPT_LEN = 64


def build_models(root: str) -> dict[str, str]:
    from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
    from hyperdraft.testing.tiny import make_tiny_model

    target = make_tiny_model(os.path.join(root, "target"), "llama", seed=0, **SHAPE)
    return {"target": target, "eagle3": write_random_eagle_checkpoint(os.path.join(root, "eagle3"), target, "eagle3")}


# ---- worker: one case on one tree ------------------------------------------------------------------------------
COUNTED_STEPS = 10


def TorchCallCounter(one_launch=None):
    """Counts the torch calls made from Python that return tensors (ops and views; on a GPU each is host dispatch
    work, and each op a kernel launch), outside the forwards (the forward wrapper clears `active`). Calls made inside
    `one_launch` (a function that is one Triton launch on CUDA and ~60 torch ops on the CPU: the counter-based RNG's
    torch reference) count as one call per call of it, named "uniform"; found on the call stack, not by patching."""
    from collections import Counter

    import torch
    from torch.overrides import TorchFunctionMode

    one_launch_code = getattr(one_launch, "__code__", None)

    class _Counter(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.active, self.total, self.by_name, self.by_caller = True, 0, Counter(), Counter()
            self.last_launch = None  # the frame of the one_launch call counted last

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not self.active:
                return out
            launch = self._inside_one_launch()
            if launch is not None:
                if launch is not self.last_launch:
                    self.last_launch = launch
                    self.total += 1
                    self.by_name["uniform"] += 1
            elif isinstance(out, (torch.Tensor, tuple, list)) and (
                    isinstance(out, torch.Tensor) or any(isinstance(o, torch.Tensor) for o in out)):
                self.total += 1
                self.by_name[getattr(func, "__name__", str(func))] += 1
                self.by_caller[self._caller()] += 1
            return out

        @staticmethod
        def _caller() -> str:
            """The innermost hyperdraft function on the stack, as module:function."""
            frame = sys._getframe(2)
            while frame is not None and f"{os.sep}hyperdraft{os.sep}" not in frame.f_code.co_filename:
                frame = frame.f_back
            if frame is None:
                return "?"
            return f"{os.path.basename(frame.f_code.co_filename)[:-3]}:{frame.f_code.co_name}"

        @staticmethod
        def _inside_one_launch():
            frame = sys._getframe(2)
            while frame is not None and one_launch_code is not None:
                if frame.f_code is one_launch_code:
                    return frame
                frame = frame.f_back
            return None

    return _Counter()


def run_case(models: dict[str, str], case: str, bs: int, steps: int, warmup: int, alpha: float,
             profile_top: int = 0, temperature: float = 0.0) -> dict:
    import torch

    from hyperdraft.config import EngineArgs
    from hyperdraft.engine.engine import Engine
    try:
        from hyperdraft.runner.model_runner import GraphedRunner
    except ImportError:  # a --compare tree from before the runners moved from engine/ to runner/
        from hyperdraft.engine.model_runner import GraphedRunner
    from hyperdraft.sampling_params import SamplingParams

    torch.set_num_threads(1)
    spec = dict(CASES[case])
    draft = spec.pop("draft", None)
    if draft:
        spec["speculative_draft_model_path"] = models[draft]
    if spec and alpha >= 0:  # alpha < 0: real verification (a random model accepts little, but the host path is real)
        spec["speculative_simulate_accept_rate"] = alpha
    total = warmup + steps
    ctx = PROMPT_LEN + 8 * (total + 4) + 64
    engine = Engine(EngineArgs.from_kwargs(
        model_path=models["target"], device="cpu", dtype="float32", skip_tokenizer_init=True,
        max_running_requests=bs, max_total_tokens=bs * (ctx + 64), context_length=ctx, log_level="warning", **spec))

    # Instrumentation: every runner's forward (target, draft model, EAGLE head) is timed, and hides its own work from
    # the profile and the call count; restored below.
    inside = [0.0]
    original = GraphedRunner.forward
    prof = cProfile.Profile() if profile_top else None
    profiling = [False]

    counting = [None]

    def timed_forward(self, *args, **kwargs):
        if profiling[0]:
            prof.disable()  # the profile shows host work outside the forwards only
        if counting[0] is not None:
            counting[0].active = False  # and the call count too
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - start
            if profiling[0]:
                prof.enable()
            if counting[0] is not None:
                counting[0].active = True

    GraphedRunner.forward = timed_forward
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=temperature, top_p=0.9 if temperature else 1.0, seed=1,
                            max_new_tokens=8 * (total + 4), ignore_eos=True)
    for b in range(bs):
        pattern = torch.randint(0, vocab, (5 + b % 3,), generator=g).tolist()  # repetitive: NGRAM finds matches
        engine.add_request(input_ids=(pattern * PROMPT_LEN)[:PROMPT_LEN], params=params)
    while any(r.num_computed == 0 or not r.output_ids for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill
    for _ in range(warmup):
        engine.step()
    assert len(engine.scheduler.running) == bs and not engine.scheduler.waiting
    # Instrumentation: the scheduler's two calls per step are timed too (schedule; commit, which runs the stop checks)
    phase_time = {"schedule": 0.0, "commit": 0.0}

    def timed_phase(name, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                phase_time[name] += time.perf_counter() - start
        return timed

    engine.scheduler.schedule = timed_phase("schedule", engine.scheduler.schedule)
    engine.scheduler.commit = timed_phase("commit", engine.scheduler.commit)
    walls, forwards, tokens, phases = [], [], 0, {"schedule": [], "commit": []}
    for _ in range(steps):
        inside[0] = 0.0
        phase_time.update(schedule=0.0, commit=0.0)
        if prof:
            profiling[0] = True
            prof.enable()
        start = time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - start
        if prof:
            prof.disable()
            profiling[0] = False
        walls.append(wall)
        forwards.append(inside[0])
        for name, seconds in phase_time.items():
            phases[name].append(seconds)
        tokens += sum(len(o.new_token_ids) for o in outs)
        assert len(outs) == bs and not any(o.finished for o in outs), "a request finished inside the measured steps"
    import hyperdraft.sample.rng as rng

    counter = TorchCallCounter(one_launch=rng.uniform_reference)  # on CUDA rng.uniform is one Triton launch
    counting[0] = counter
    with counter:
        for _ in range(COUNTED_STEPS):
            engine.step()
    counting[0] = None
    GraphedRunner.forward = original
    host = [w - f for w, f in zip(walls, forwards)]
    result = {"case": case, "bs": bs, "steps": steps, "host_ms": 1e3 * statistics.median(host),
              "host_ms_mean": 1e3 * statistics.fmean(host), "wall_ms": 1e3 * statistics.median(walls),
              "forward_ms": 1e3 * statistics.median(forwards), "tokens_per_step": tokens / steps,
              "schedule_ms": 1e3 * statistics.median(phases["schedule"]),
              "commit_ms": 1e3 * statistics.median(phases["commit"]),
              "torch_calls_per_step": counter.total / COUNTED_STEPS,
              "top_calls": {k: v / COUNTED_STEPS for k, v in counter.by_name.most_common(40)},
              "top_callers": {k: v / COUNTED_STEPS for k, v in counter.by_caller.most_common(25)}}
    if prof:
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(profile_top)
        stats.sort_stats("cumulative").print_stats(profile_top)
        result["profile"] = out.getvalue()
    # the outputs themselves, so two trees' runs can be checked for identical behaviour
    result["outputs_hash"] = hashlib.sha256(repr([r.output_ids for r in engine.scheduler.running]).encode()).hexdigest()[:16]
    for r in list(engine.scheduler.running):
        engine.abort(r.rid)
    return result


def worker_main(a) -> None:
    import hyperdraft  # from the tree: run_in puts it first on PYTHONPATH

    assert os.path.abspath(hyperdraft.__file__).startswith(os.path.abspath(a.tree)), "imported the wrong tree"
    models = json.loads(a.models)
    print(json.dumps(run_case(models, a.worker, a.bs[0], a.steps, a.warmup, a.alpha, temperature=a.temperature)))


def run_in(tree: str, models: dict, case: str, bs: int, a) -> dict:
    """One measurement in a fresh process that imports hyperdraft from `tree`: this file run by its path (so it is
    the same measuring code for every tree, and it imports nothing from benchmarks/), with PYTHONPATH=tree."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", case, "--tree", tree, "--models", json.dumps(models),
           "--bs", str(bs), "--steps", str(a.steps), "--warmup", str(a.warmup), "--alpha", str(a.alpha),
           "--temperature", str(a.temperature)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree})
    if proc.returncode:
        raise RuntimeError(f"{case} bs {bs} on {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- driver -----------------------------------------------------------------------------------------------------
def commit_of(tree: str) -> str:
    try:
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.host_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES), choices=list(CASES))
    ap.add_argument("--bs", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--steps", type=int, default=60, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.8,
                    help="simulated accept rate of the speculative cases; negative: real verification")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (top_p 0.9, seeded)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per (tree, case, batch); the minimum median is reported")
    ap.add_argument("--compare", metavar="OLD_TREE", help="also run an older source tree, interleaved with this one")
    ap.add_argument("--base-commit", default=None, help="commit the --compare tree was exported from (for the report)")
    ap.add_argument("--profile", metavar="CASE", help="cProfile the measured steps of one case (this tree, in process)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--verbose", action="store_true", help="print the most frequent torch calls of each run")
    ap.add_argument("--write", action="store_true", help="write benchmarks/results/host_overhead_cpu.md")
    ap.add_argument("--append", action="store_true", help="with --write: add a section to the file instead")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=ROOT, help=argparse.SUPPRESS)
    ap.add_argument("--models", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker_main(a)
    models = build_models(tempfile.mkdtemp(prefix="host_overhead_"))
    if a.profile:
        for bs in a.bs:
            r = run_case(models, a.profile, bs, a.steps, a.warmup, a.alpha, profile_top=a.top, temperature=a.temperature)
            print(f"== {a.profile} bs {bs}: host {r['host_ms']:.3f} ms/step (median), forward {r['forward_ms']:.3f} ms, "
                  f"{r['torch_calls_per_step']:.0f} torch calls/step: {r['top_calls']}")
            print(r["profile"])
        return
    trees = [("new", ROOT)] + ([("old", os.path.abspath(a.compare))] if a.compare else [])
    best: dict[tuple, dict] = {}
    for rep in range(a.repeats):
        for case in a.cases:
            for bs in a.bs:
                order = trees if rep % 2 == 0 else trees[::-1]  # alternate which tree runs first
                for name, tree in order:
                    r = run_in(tree, models, case, bs, a)
                    key = (name, case, bs)
                    if key not in best or r["host_ms"] < best[key]["host_ms"]:
                        best[key] = r
                    print(f"rep {rep} {name:>3} {case:<13} bs {bs:>2}: host {r['host_ms']:.3f} ms/step, "
                          f"{r['torch_calls_per_step']:.0f} torch calls/step, forward {r['forward_ms']:.3f} ms, "
                          f"{r['tokens_per_step']:.2f} tok/step", flush=True)
                    if a.verbose:
                        print("   top calls/step:", r["top_calls"])
                        print("   top callers/step:", r["top_callers"])
    lines = table(best, a, trees)
    print("\n".join(lines))
    if a.write:
        write_report(lines, a)


def table(best: dict, a, trees) -> list[str]:
    with_old = len(trees) > 1
    head = ("| case | batch | host ms/step | schedule ms | commit ms (stop checks included) | worker host ms | "
            "torch calls/step | forward ms/step | tokens/step |")
    sep = "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    if with_old:
        head = ("| case | batch | host ms/step (old) | host ms/step (new) | new / old | torch calls/step (old) | "
                "torch calls/step (new) | forward ms/step (new) | tokens/step | same outputs |")
        sep = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    lines = [head, sep]
    for case in a.cases:
        for bs in a.bs:
            new = best[("new", case, bs)]
            if with_old:
                old = best[("old", case, bs)]
                lines.append(f"| {case} | {bs} | {old['host_ms']:.3f} | {new['host_ms']:.3f} | "
                             f"{new['host_ms'] / old['host_ms']:.2f} | {old['torch_calls_per_step']:.0f} | "
                             f"{new['torch_calls_per_step']:.0f} | {new['forward_ms']:.3f} | {new['tokens_per_step']:.2f} | "
                             f"{'yes' if old['outputs_hash'] == new['outputs_hash'] else 'NO'} |")
            else:
                worker = new["host_ms"] - new["schedule_ms"] - new["commit_ms"]  # medians: an approximate split
                lines.append(f"| {case} | {bs} | {new['host_ms']:.3f} | {new['schedule_ms']:.3f} | "
                             f"{new['commit_ms']:.3f} | {worker:.3f} | {new['torch_calls_per_step']:.0f} | "
                             f"{new['forward_ms']:.3f} | {new['tokens_per_step']:.2f} |")
    return lines


def write_report(lines: list[str], a) -> None:
    cmd = "python -m benchmarks.e2e.host_overhead " + " ".join(sys.argv[1:])
    text = [
        "# Host time per engine step, outside the model forwards (CPU)",
        "",
        f"- date: {datetime.date.today()}; device: CPU ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, 1 torch thread), load average {os.getloadavg()[0]:.2f} at the end",
        f"- command: `{cmd}`",
        f"- new tree: commit {commit_of(ROOT)} (plus uncommitted changes, if any)"
        + (f"; old tree: {a.base_commit or 'see command'}" if a.compare else ""),
        f"- model: tiny random llama ({SHAPE}), vocab 384, fp32; EAGLE-3 head random; prompts of {PROMPT_LEN} tokens; "
        f"{'greedy' if not a.temperature else f'temperature {a.temperature}, top_p 0.9'}; speculative cases at "
        f"simulated accept rate {a.alpha}",
        f"- host ms/step = median over {a.steps} steps of (step wall time - time inside GraphedRunner.forward), "
        f"best of {a.repeats} runs per tree, the two trees' runs interleaved",
        "",
        *lines,
        "",
    ]
    path = os.path.join(ROOT, "benchmarks", "results", "host_overhead_cpu.md")
    if a.append:
        text = ["", f"## temperature {a.temperature}"] + text[1:]
    with open(path, "a" if a.append else "w") as f:
        f.write("\n".join(text))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
