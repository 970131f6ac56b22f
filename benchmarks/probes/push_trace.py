"""Why does a Llama-8B-shaped TP 2 engine with the push all-reduce hang at build on two H100s (results/tp_bench_h100.md,
2026-11-27)? Each rank logs every push call (time, shape, dtype, device, current device and stream, whether a graph is
being captured, the caller) to /tmp/push_trace/<pid>.txt, line by line; the engine is built with a short dist_timeout so
the kernel traps instead of hanging; the logs land in $OUT. Rank 0's call k and rank 1's call k must agree: the first
line where they do not is the divergence, and a rank whose log simply stops early was late (start-up skew).

A benchmark-only MONKEYPATCH of PushAllReduce.__call__, applied at import: the followers are spawned processes that
import this module as their main module (__mp_main__), so they patch themselves too.

  python -m benchmarks.probes.push_trace [--dist-timeout 120]     # two GPUs -> stdout and $OUT/push_trace/
  TRITON_INTERPRET=1 python -m benchmarks.probes.push_trace --tiny   # CPU smoke test
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import traceback

import torch

import hyperdraft.distributed.push_all_reduce as push_module

TRACE_DIR = "/tmp/push_trace"
_untraced_call = push_module.PushAllReduce.__call__


class _Log:
    """This process's trace file, opened at the first call (the parent process only writes if it pushes)."""

    file = None
    calls = 0


def _traced_call(self, x: torch.Tensor) -> torch.Tensor:
    if _Log.file is None:
        os.makedirs(TRACE_DIR, exist_ok=True)
        _Log.file = open(os.path.join(TRACE_DIR, f"rank{self.rank}-{os.getpid()}.txt"), "w", buffering=1)
    _Log.calls += 1
    caller = "/".join(f"{f.name}:{f.lineno}" for f in traceback.extract_stack(limit=6)[:-1])
    where = (f"cur={torch.cuda.current_device()} stream={torch.cuda.current_stream().cuda_stream} "
             f"capturing={torch.cuda.is_current_stream_capturing()}") if x.is_cuda else "cpu"
    fields = (_Log.calls, f"{time.time():.3f}", tuple(x.shape), x.dtype, x.device, where, caller)
    _Log.file.write(" | ".join(map(str, fields)) + "\n")
    return _untraced_call(self, x)


push_module.PushAllReduce.__call__ = _traced_call


def main() -> None:
    from benchmarks.e2e.engines import LLAMA_8B, TINY, make_engine, median_run, write_configs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dist-timeout", type=float, default=120.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test (TRITON_INTERPRET=1): tiny shapes, gloo")
    args = ap.parse_args()
    shutil.rmtree(TRACE_DIR, ignore_errors=True)
    target, _ = write_configs(os.path.join(tempfile.mkdtemp(), "8b"), TINY if args.tiny else LLAMA_8B,
                              512 if args.tiny else 32000)
    start = time.time()
    try:
        engine, info = make_engine(target, "cpu" if args.tiny else "cuda", 8,
                                   {"tp_size": 2, "dist_timeout": args.dist_timeout}, 4096 if args.tiny else 16384,
                                   push_all_reduce=True)
        print(f"built in {time.time() - start:.1f} s: {info}", flush=True)
        print(median_run(engine, 1, 512, 256, seed=1, repeats=1), flush=True)
        engine.close()
    finally:
        if os.path.isdir(TRACE_DIR):
            shutil.copytree(TRACE_DIR, os.path.join(args.out, "push_trace"), dirs_exist_ok=True)
            logs = {}
            for name in sorted(os.listdir(TRACE_DIR)):
                with open(os.path.join(TRACE_DIR, name)) as f:
                    logs[name] = f.readlines()
                print(name, len(logs[name]), "calls; last:", logs[name][-1][:300] if logs[name] else "-")
            print(first_difference(list(logs.values())))


def first_difference(logs: list[list[str]]) -> str:
    """The first call whose shape, dtype or caller differs between the ranks' logs (time, stream and device differ
    by nature)."""
    def key(line: str) -> str:
        fields = line.split(" | ")
        return " | ".join(fields[2:4] + fields[-1:])

    for k, lines in enumerate(zip(*logs)):
        if len({key(line) for line in lines}) > 1:
            return f"call {k + 1} differs:\n" + "".join(lines)
    return f"the first {min(map(len, logs), default=0)} calls agree on every rank"


if __name__ == "__main__":
    main()
