"""Where a batch-1 decode step's time goes: GPU kernel time vs wall time, top kernels (8B- or SmolLM2-shaped dummy
target).

Run on a GPU machine: python -m benchmarks.e2e.gpu_profile [--spec [--tree]] [--shape smollm2] [--out $OUT] ; prints a table and writes
OUT/gpu_profile_{plain,spec}<PROFILE_TAG>.txt. Environment: PROFILE_TOP=N (kernels listed, default 25),
PROFILE_SEQUENCE=1 (also OUT/gpu_sequence_{plain,spec}.txt: the last step's kernels in launch order), PROFILE_TAG
(a file name suffix).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import require_cuda
from benchmarks.e2e.engines import LLAMA_8B, SMOLLM2, eagle3_spec, make_engine, write_configs
from benchmarks.e2e.hybrid_bench import mtp_spec, write_config, write_token_map
from hyperdraft.sampling_params import SamplingParams


# dense target shapes and their heads' draft vocabularies (SmolLM2's as train-draft writes it)
SHAPES = {"llama8b": (LLAMA_8B, 32000), "smollm2": (SMOLLM2, 8192)}


def trace_events(prof) -> list[dict]:
    """The profile's chrome-trace events (a trace can be exported only once, so every reader shares these)."""
    import json

    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    return json.load(open(path))["traceEvents"]


def graph_launch_timing(events: list[dict]) -> str:
    """When does a replayed graph's first kernel start, relative to its cudaGraphLaunch call? If it starts only
    after the call returns, the launch's host time is GPU idle time."""
    import statistics

    launches = {e["args"]["correlation"]: e for e in events
                if e.get("name") == "cudaGraphLaunch" and "correlation" in e.get("args", {})}
    first: dict = {}
    for e in events:
        c = e.get("args", {}).get("correlation")
        if e.get("cat") == "kernel" and c in launches:
            first[c] = min(first.get(c, float("inf")), e["ts"])
    if not first:
        return "graph launches: none correlated"
    delay = [first[c] - launches[c]["ts"] for c in first]
    dur = [launches[c]["dur"] for c in first]
    return (f"graph launches: {len(first)}; host call median {statistics.median(dur):.0f} us; first kernel starts "
            f"median {statistics.median(delay):.0f} us after the call began (min {min(delay):.0f}, max {max(delay):.0f})")


def idle_gaps(events: list[dict], steps: int, top: int = 12) -> str:
    """GPU idle time between consecutive kernels/copies, grouped by the (previous, next) pair: which launch the GPU
    waited for. Gaps under 5 us are launch spacing inside a graph and are not counted."""
    from collections import defaultdict

    events = sorted((e for e in events
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    by_pair: dict = defaultdict(float)
    total, end = 0.0, None
    for prev, nxt in zip(events, events[1:]):
        end = max(end or 0.0, prev["ts"] + prev["dur"])
        gap = nxt["ts"] - end
        if gap >= 5:
            by_pair[(prev["name"][:40], nxt["name"][:40])] += gap
            total += gap
    lines = [f"GPU idle between kernels: {total / 1e3 / steps:.3f} ms/step (gaps >= 5 us)",
             f"{'previous kernel -> next kernel':<86} {'us/step':>8}"]
    for (a, b), us in sorted(by_pair.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{a:<40} -> {b:<42} {us / steps:8.1f}")
    return "\n".join(lines)


def kernel_sequence(events: list[dict], steps: int) -> str:
    """The last step's GPU work in launch order (start offset, duration, name): which small kernels a step runs."""
    work = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])
    last = work[-(len(work) // steps):]
    t0 = last[0]["ts"]
    return "\n".join(f"{e['ts'] - t0:9.1f} {e['dur']:7.1f}  {e['name'][:110]}" for e in last)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.gpu_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", action="store_true", help="EAGLE-3 chain 5 at simulated alpha 0.8 instead of plain decode")
    ap.add_argument("--tree", action="store_true", help="with --spec: EAGLE-3 tree 5x4/8 instead of chain 5")
    ap.add_argument("--hybrid", action="store_true", help="the Qwen3.5-9B-shaped hybrid (MTP chain 5 with --spec)")
    ap.add_argument("--token-map", action="store_true", help="with --hybrid --spec: the MTP head drafts from a 32k-token map")
    ap.add_argument("--deterministic", action="store_true", help="--enable-deterministic-inference's kernels")
    ap.add_argument("--shape", choices=list(SHAPES), default="llama8b", help="the dense target's shape")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=512, help="the request's prompt tokens (the context each "
                    "profiled round attends to, plus what earlier steps decoded)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output directory (default: $OUT or .)")
    a = ap.parse_args()
    require_cuda()
    if a.hybrid:
        root = tempfile.mkdtemp()
        target = write_config(root)
        spec = mtp_spec(5, 0.8, write_token_map(root) if a.token_map else None) if a.spec else None
    else:
        shape, draft_vocab = SHAPES[a.shape]
        target, head = write_configs(tempfile.mkdtemp(), shape, draft_vocab)
        topk, width = (4, 8) if a.tree else (1, 6)
        spec = eagle3_spec(head, steps=5, topk=topk, num_draft_tokens=width, alpha=0.8) if a.spec else None
    engine, _ = make_engine(target, "cuda", 8, spec, None if a.hybrid else 8 * 2048,  # hybrid: states by memory fraction
                            deterministic=a.deterministic)
    params = SamplingParams(temperature=0.0, max_new_tokens=(2 * a.steps + 20) * 8 + 16, ignore_eos=True)
    vocab = 120000 if a.hybrid else SHAPES[a.shape][0]["vocab_size"] - 10
    req = engine.add_request(input_ids=torch.randint(10, vocab, (a.prompt_len,)).tolist(), params=params)
    for _ in range(20):  # warm-up: Triton specialisations compile on first use of each shape class
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(a.steps):  # the same steps unprofiled first: the profiler's own overhead inflates wall time
        engine.step()
    torch.cuda.synchronize()
    clean_wall = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(a.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    engine.abort(req.rid)
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    gpu_total = sum(e.self_device_time_total for e in kernels) / 1e3  # ms
    lines = [f"{'spec' if a.spec else 'plain'} batch 1: wall {1000 * clean_wall / a.steps:.2f} ms/step unprofiled, "
             f"{1000 * wall / a.steps:.2f} ms/step profiled, "
             f"GPU kernel time {gpu_total / a.steps:.2f} ms/step",
             f"{'kernel':<90} {'ms/step':>8} {'calls/step':>10}"]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:int(os.environ.get("PROFILE_TOP", "25"))]:
        lines.append(f"{e.key[:90]:<90} {e.self_device_time_total / 1e3 / a.steps:8.3f} {e.count / a.steps:10.1f}")
    host = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    lines += ["", f"{'host op (self CPU time)':<90} {'ms/step':>8} {'calls/step':>10}"]
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:25]:
        lines.append(f"{e.key[:90]:<90} {e.self_cpu_time_total / 1e3 / a.steps:8.3f} {e.count / a.steps:10.1f}")
    events = trace_events(prof)
    lines += ["", graph_launch_timing(events), "", idle_gaps(events, a.steps)]
    text = "\n".join(lines)
    print(text)
    if os.environ.get("PROFILE_SEQUENCE"):
        with open(os.path.join(a.out, f"gpu_sequence_{'spec' if a.spec else 'plain'}.txt"), "w") as f:
            f.write(kernel_sequence(events, a.steps) + "\n")
    with open(os.path.join(a.out, f"gpu_profile_{'spec' if a.spec else 'plain'}{os.environ.get('PROFILE_TAG', '')}.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
