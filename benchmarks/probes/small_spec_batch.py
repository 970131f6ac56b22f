"""Why speculation on a small model loses to plain decoding as the batch grows (SmolLM2-135M shape, random bf16
weights, EAGLE-3 head at simulated acceptance).

real_accept_h100.md measured SmolLM2 with its trained head at batch 16: every speculative row ran at 0.20x-0.53x of
plain decoding, and a chain-5 round took ~13 ms against ~2.5 ms at batch 1. This probe times plain decoding and
EAGLE-3 chain 5 at several batch sizes, with and without the deterministic mode, counts how many forwards of each
runner replayed a graph, and profiles one configuration's steps (kernels and host ops).

  python -m benchmarks.probes.small_spec_batch --out $OUT [--batches 1 16] [--profile 16] [--deterministic both]
  python -m benchmarks.probes.small_spec_batch --llm [--batches 1 16]   # real_accept's harness: LLM.generate over
      80 prompts of 40-400 tokens, max_running_requests = batch, timed twice in a row (the second call has no
      first-use costs)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import require_cuda
from benchmarks.e2e.engines import SMOLLM2, decode_run, eagle3_spec, free, make_engine, write_configs



def graph_counts(engine) -> dict:
    runners = {"target": engine.worker.runner}
    proposer = getattr(engine.worker, "proposer", None)
    if proposer is not None and getattr(proposer, "runner", None) is not None:
        runners["draft"] = proposer.runner
    out = {name: (r.graphs.num_replays if r.graphs is not None else None) for name, r in runners.items()}
    loop = getattr(proposer, "draft_loop", None)
    if loop is not None:
        out["draft_rounds"] = loop.num_replays
    return out


def profile_steps(engine, bs: int, steps: int = 20) -> str:
    vocab = engine.model_config.vocab_size
    from hyperdraft.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_new_tokens=4 * steps + 64, ignore_eos=True)
    reqs = [engine.add_request(input_ids=torch.randint(10, vocab - 10, (256,)).tolist(), params=params)
            for _ in range(bs)]
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    for r in reqs:
        engine.abort(r.rid)
    events = prof.key_averages()
    lines = [f"{'kernel':<80} {'us/step':>9} {'calls':>7}"]
    for e in sorted((e for e in events if e.device_time_total > 0), key=lambda e: -e.self_device_time_total)[:25]:
        lines.append(f"{e.key[:80]:<80} {e.self_device_time_total / steps:9.1f} {e.count / steps:7.1f}")
    lines += ["", f"{'host op (self CPU)':<80} {'us/step':>9} {'calls':>7}"]
    for e in sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)[:25]:
        lines.append(f"{e.key[:80]:<80} {e.self_cpu_time_total / steps:9.1f} {e.count / steps:7.1f}")
    return "\n".join(lines)


def llm_rows(target: str, head: str, batches: list[int], deterministic: bool) -> None:
    import time

    from hyperdraft import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 49000, (int(n),), generator=g).tolist()
               for n in torch.randint(40, 400, (80,), generator=g)]
    params = SamplingParams(temperature=0, max_new_tokens=128, ignore_eos=True)
    for name, spec in (("plain", {}), ("eagle3 chain5", eagle3_spec(head, 5, 1, 6, alpha=0.8))):
        for bs in batches:
            llm = LLM(target, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_running_requests=bs,
                      enable_deterministic_inference=deterministic, log_level="warning", **spec)
            llm.generate(input_ids=prompts[:bs], sampling_params=SamplingParams(temperature=0, max_new_tokens=8),
                         use_tqdm=False)
            rates = []
            for _ in range(2):
                start = time.perf_counter()
                outs = llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
                rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
            llm.shutdown()
            print(json.dumps({"llm": name, "batch": bs, "deterministic": deterministic,
                              "tok_per_s first, second call": [round(r) for r in rates]}), flush=True)


def step_split(target: str, head: str, bs: int, deterministic: bool, spec_on: bool) -> None:
    """The same 80 prompts through one engine, max_running_requests = bs: every step timed (synchronised) and
    classified by what it ran (decodes only, or decodes with prefill chunks riding along), then a profile of the
    slowest kind."""
    import time

    from hyperdraft.sampling_params import SamplingParams

    spec = eagle3_spec(head, 5, 1, 6, alpha=0.8) if spec_on else None
    engine, _ = make_engine(target, "cuda", bs, spec, bs * 2048, deterministic=deterministic)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 49000, (int(n),), generator=g).tolist()
               for n in torch.randint(40, 400, (80,), generator=g)]
    params = SamplingParams(temperature=0, max_new_tokens=128, ignore_eos=True)
    worker, kinds = engine.worker, {}
    run = worker.run
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()

    def timed_run(batch):
        kind = "mixed" if batch.prefills and batch.decodes else ("prefill" if batch.prefills else "decode")
        torch.cuda.synchronize()
        start = time.perf_counter()
        if kind != "decode" and profiling:
            prof.enable()
        out = run(batch)
        torch.cuda.synchronize()
        prof.disable()
        kinds.setdefault(kind, []).append(time.perf_counter() - start)
        return out

    worker.run = timed_run  # instrumentation only
    from collections import Counter

    from triton.runtime.jit import JITFunction
    compiles, compile_s = Counter(), [0.0]
    do_compile = JITFunction._do_compile

    def counted_compile(self, key, signature, device, constexprs, *rest):  # instrumentation: what compiles when
        start = time.perf_counter()
        try:
            return do_compile(self, key, signature, device, constexprs, *rest)
        finally:
            compile_s[0] += time.perf_counter() - start
            compiles[f"{self.fn.__qualname__} {sorted((k[0] if isinstance(k, tuple) else k, v) for k, v in constexprs.items())}"[:160]] += 1

    JITFunction._do_compile = counted_compile
    profiling = False
    for rep in range(3):
        profiling = rep == 2
        kinds.clear()
        for p in prompts:
            engine.add_request(input_ids=p, params=params)
        while engine.has_unfinished():
            engine.step()
        print(f"call {rep}: {sum(compiles.values())} Triton compiles, {compile_s[0]:.2f} s:", dict(compiles.most_common(12)))
        compiles.clear()
        compile_s[0] = 0.0
        print(json.dumps({"spec": spec_on, "batch": bs, "call": rep, **{
            k: {"steps": len(v), "median_ms": round(1e3 * statistics.median(v), 2), "total_s": round(sum(v), 3)}
            for k, v in kinds.items()}}), flush=True)
    worker.run = run
    JITFunction._do_compile = do_compile
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(35)
    print(f"cProfile of the prefill and mixed steps of call 2 (spec {spec_on}):", out.getvalue()[-9000:])
    free(engine)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.small_spec_batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--deterministic", choices=["off", "on", "both"], default="both")
    ap.add_argument("--profile", type=int, default=16, help="profile chain 5 at this batch size (0: none)")
    ap.add_argument("--split", action="store_true", help="step times by kind (decode, mixed, prefill) at the largest batch")
    ap.add_argument("--llm", action="store_true", help="time LLM.generate as real_accept does (see above)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    require_cuda()
    target, head = write_configs(tempfile.mkdtemp(), SMOLLM2, 32000)
    if a.split:
        for spec_on in (False, True):
            step_split(target, head, max(a.batches), a.deterministic != "off", spec_on)
        return
    if a.llm:
        for det in {"off": [False], "on": [True], "both": [False, True]}[a.deterministic]:
            llm_rows(target, head, a.batches, det)
        return
    rows = []
    modes = {"off": [False], "on": [True], "both": [False, True]}[a.deterministic]
    for det in modes:
        for name, spec in (("plain", None), ("eagle3 chain5", eagle3_spec(head, 5, 1, 6, alpha=0.8))):
            engine, info = make_engine(target, "cuda", max(a.batches), spec, max(a.batches) * 1024,
                                       deterministic=det)
            for bs in a.batches:
                decode_run(engine, bs, 256, 16, seed=1)  # warm-up: compiles each shape's kernels
                before = graph_counts(engine)
                runs = [decode_run(engine, bs, 256, a.output_len, seed=2 + i) for i in range(a.repeats)]
                after = graph_counts(engine)
                steps = sum(r["engine_steps"] for r in runs)
                row = {"deterministic": det, "row": name, "batch": bs,
                       "tok_per_s": statistics.median(r["tok_per_s"] for r in runs),
                       "step_ms": statistics.median(r["step_ms"] for r in runs),
                       "accept_length": runs[0]["accept_length"], "steps": steps,
                       "graph_replays_per_step": {k: (None if v is None else round((after[k] - before[k]) / steps, 2))
                                                  for k, v in after.items()}}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if spec is not None and a.profile and det == modes[0]:
                text = profile_steps(engine, a.profile)
                print(text)
                with open(os.path.join(a.out, f"small_spec_profile_bs{a.profile}.txt"), "w") as f:
                    f.write(text + "\n")
            free(engine)
    with open(os.path.join(a.out, "small_spec_batch.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
