"""Online serving benchmark, in the manner of `sglang.bench_serving`: N chat requests with Poisson arrivals at a given
rate, streamed over HTTP, against `hyperdraft serve`. Reports request and token throughput, TTFT, ITL and TPOT
percentiles, and the speculative accept length (from /server_info, over the benchmark's requests only).

By default it starts the server itself, once per configuration (no speculation, then NGRAM), runs the same
workload against each, checks the outputs are identical (greedy; speculation is lossless), and writes a table:

  python -m benchmarks.e2e.serving              # SmolLM2 default model, CPU -> benchmarks/results/serving_cpu.md
  python -m benchmarks.e2e.serving --num-prompts 64 --request-rate 4 16 inf --max-tokens 128
  python -m benchmarks.e2e.serving --device cuda --dtype bfloat16 --deterministic --draft-model-path HEAD \
      --configs none,ngram,eagle3,eagle3-adaptive --request-rate 4 16     # a GPU, with a trained EAGLE-3 head
  ... --passes 3        # each rate measured three times (flushed before each), the median-throughput pass reported
  python -m benchmarks.e2e.serving --base-url http://127.0.0.1:30000   # a server you started; prints one row
  (--device cuda writes serving_<gpu>.md, e.g. serving_h100.md)

Prompts: first turns of MT-bench (shared/data/mt_bench_questions.jsonl beside the checkout).
TTFT: request sent -> first content chunk. ITL: gap between consecutive content chunks (a speculative step may
deliver several tokens in one chunk). TPOT: (e2e - TTFT) / (completion tokens - 1), per request.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from benchmarks.common import (REPO_ROOT, command_line, cpu_name, device_tag, git_commit, mt_bench_first_turns,
                               write_results)

CONFIGS = {
    "none": [],
    "ngram": ["--speculative-algorithm", "NGRAM", "--speculative-num-steps", "8"],
    "ngram-adaptive": ["--speculative-algorithm", "NGRAM", "--speculative-adaptive"],
}
# These draft with an EAGLE-3 head (--draft-model-path, e.g. one `hyperdraft train-draft` wrote).
HEAD_CONFIGS = {
    "eagle3": ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "5", "--speculative-eagle-topk", "1"],
    "eagle3-adaptive": ["--speculative-algorithm", "EAGLE3", "--speculative-adaptive"],
}


@dataclass
class RequestResult:
    ok: bool
    text: str = ""
    completion_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def load_questions(n: int) -> list[str]:
    questions = mt_bench_first_turns()
    return [questions[i % len(questions)] for i in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, question: str, max_tokens: int) -> RequestResult:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res, last = RequestResult(ok=False), None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    content = choice["delta"].get("content")
                    if content:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.text += content
        res.e2e = time.perf_counter() - start
        res.ok = True
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(url: str, model: str, questions: list[str], rate: float, max_tokens: int, seed: int):
    """Send every question once, with exponential inter-arrival gaps (Poisson process) at `rate` requests/s."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(questions) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        await one_request(client, url, model, "Hello", 4)  # warm-up, not measured
        tasks, start = [], time.perf_counter()
        for q in questions:
            tasks.append(asyncio.create_task(one_request(client, url, model, q, max_tokens)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def spec_counters(url: str) -> tuple[float, float]:
    """(request-verifies, tokens they emitted) so far; (0, 0) without speculation."""
    state = httpx.get(url + "/server_info", timeout=60).json()["internal_states"][0]
    verifies = state.get("spec_verifies", 0)
    return verifies, verifies * state.get("avg_spec_accept_length", 0.0)


def summarize(results: list[RequestResult], seconds: float, accept: float | None) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    ttft = np.array([r.ttft for r in ok]) * 1000
    itl = np.array([g for r in ok for g in r.itl]) * 1000
    tpot = np.array([(r.e2e - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]) * 1000
    e2e = np.array([r.e2e for r in ok]) * 1000

    def pct(a, q):
        return float(np.percentile(a, q)) if len(a) else float("nan")

    return {
        "completed": len(ok), "failed": len(results) - len(ok), "seconds": seconds, "output_tokens": out_tokens,
        "request_throughput": len(ok) / seconds, "output_throughput": out_tokens / seconds,
        "ttft_mean": float(ttft.mean()) if len(ttft) else float("nan"), "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99), "itl_mean": float(itl.mean()) if len(itl) else float("nan"),
        "itl_p50": pct(itl, 50), "itl_p95": pct(itl, 95), "itl_p99": pct(itl, 99),
        "tpot_mean": float(tpot.mean()) if len(tpot) else float("nan"), "tpot_p50": pct(tpot, 50),
        "e2e_mean": float(e2e.mean()) if len(e2e) else float("nan"), "e2e_p99": pct(e2e, 99),
        "accept_length": accept, "errors": sorted({r.error for r in results if not r.ok})[:3],
    }


def benchmark(url: str, args, rate: float) -> tuple[dict, list[str]]:
    model = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]
    questions = load_questions(args.num_prompts)
    if args.warmup:  # the whole workload once, all at once, unmeasured: every batch and prefill shape is compiled
        asyncio.run(run_load(url, model, questions, math.inf, args.max_tokens, args.seed))
    passes = []
    for _ in range(args.passes):
        # Every pass repeats the same prompts on one server: without a flush the prefix cache skips their prefills
        # and NGRAM drafts the earlier passes' answers (accept length 8.5 against 1.2 once measured on an H100).
        httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
        v0, e0 = spec_counters(url)
        results, seconds = asyncio.run(run_load(url, model, questions, rate, args.max_tokens, args.seed))
        v1, e1 = spec_counters(url)
        accept = (e1 - e0) / (v1 - v0) if v1 > v0 else None
        passes.append((summarize(results, seconds, accept), [r.text for r in results]))
    # The pass of median throughput stands for the rate (one pass at a saturating rate swung 1.8x between two runs of
    # one configuration on an H100); every pass's throughput is kept beside it.
    summary = sorted((p[0] for p in passes), key=lambda s: s["output_throughput"])[len(passes) // 2]
    summary["pass_throughputs"] = [p[0]["output_throughput"] for p in passes]
    return summary, [text for p in passes for text in p[1]]  # every pass's outputs: all must agree across configs


class LaunchedServer:
    """`hyperdraft serve` on a free loopback port, stopped with SIGTERM."""

    def __init__(self, model: str, flags: list[str], device: str, dtype: str = "float32"):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile("w+")
        cmd = [sys.executable, "-m", "hyperdraft", "serve", "--model", model, "--port", str(port), "--device", device,
               "--dtype", dtype, *flags]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited during start-up:\n{self.log.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError("server did not start within 300 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def row(name: str, s: dict, base: dict | None) -> str:
    ratio = f"{s['output_throughput'] / base['output_throughput']:.2f}x" if base else "-"
    accept = f"{s['accept_length']:.2f}" if s["accept_length"] else "-"
    return (f"| {name} | {s['completed']}/{s['completed'] + s['failed']} | {s['output_tokens']} | {s['seconds']:.1f} | "
            f"{s['request_throughput']:.2f} | {s['output_throughput']:.1f} | {ratio} | {s['ttft_mean']:.0f} / "
            f"{s['ttft_p50']:.0f} / {s['ttft_p99']:.0f} | {s['itl_mean']:.0f} / {s['itl_p50']:.0f} / {s['itl_p95']:.0f}"
            f" / {s['itl_p99']:.0f} | {s['tpot_mean']:.0f} / {s['tpot_p50']:.0f} | {s['e2e_mean']:.0f} / "
            f"{s['e2e_p99']:.0f} | {accept} |")


HEADER = ("| config | ok | output tokens | seconds | req/s | output tok/s | vs none | TTFT ms mean / p50 / p99 | "
          "ITL ms mean / p50 / p95 / p99 | TPOT ms mean / p50 | E2E ms mean / p99 | accept length |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def config_flags(args) -> dict[str, list[str]]:
    """The launched configurations' server flags, by name (the head ones only with --draft-model-path)."""
    extra = (["--enable-deterministic-inference"] if args.deterministic else []) + shlex.split(args.server_args)
    known = {name: flags + extra for name, flags in CONFIGS.items()}
    if args.draft_model_path:
        known.update({name: flags + ["--speculative-draft-model-path", args.draft_model_path] + extra
                      for name, flags in HEAD_CONFIGS.items()})
    names = args.configs.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; allowed: {sorted(known)} (eagle3 ones need "
                         "--draft-model-path)")
    return {n: known[n] for n in names}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.serving", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="benchmark this running server instead of launching one per configuration")
    ap.add_argument("--model", help="model for launched servers (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--configs", default="none,ngram",
                    help=f"launched configurations, from {sorted(CONFIGS)} and, with --draft-model-path, "
                         f"{sorted(HEAD_CONFIGS)}")
    ap.add_argument("--draft-model-path", help="EAGLE-3 head for the eagle3 configurations")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--request-rate", type=float, nargs="+", default=[1.0],
                    help="requests/s, Poisson arrivals; inf = all at once; several values: one table each, every "
                         "server measured at each rate in turn")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="the launched servers' dtype")
    ap.add_argument("--deterministic", action="store_true",
                    help="launch servers with --enable-deterministic-inference (bitwise equal outputs in bf16)")
    ap.add_argument("--warmup", action="store_true",
                    help="run the workload once, unmeasured, before each measurement: the first server on a fresh "
                         "GPU machine compiles its Triton kernels for each new shape during its first requests")
    ap.add_argument("--passes", type=int, default=1,
                    help="measured passes per rate (each after a flush); the median-throughput pass is reported")
    ap.add_argument("--server-args", default="", help="more `hyperdraft serve` flags for every launched server")
    ap.add_argument("--out", help="report path (default: benchmarks/results/serving_<device>.md)")
    args = ap.parse_args()

    if args.base_url:
        print(HEADER)
        for rate in args.request_rate:
            summary, _ = benchmark(args.base_url.rstrip("/"), args, rate)
            print(row(f"{args.base_url} at {rate} req/s", summary, None))
        return
    write_report(args, *run_configs(args))


def run_configs(args) -> tuple[str, dict, dict, dict]:
    """Each configuration's server, measured at every rate -> (model, flags, summaries and texts by (rate, name))."""
    from hyperdraft.models.default_model import ensure_default_model

    model = args.model or ensure_default_model()
    flags = config_flags(args)
    summaries, texts = {}, {}
    for name, config in flags.items():
        server = LaunchedServer(model, config, args.device, args.dtype)
        try:
            for rate in args.request_rate:
                summaries[rate, name], texts[rate, name] = benchmark(server.url, args, rate)
                print(f"{rate} req/s", row(name, summaries[rate, name], summaries.get((rate, "none"))), flush=True)
        finally:
            server.stop()
    return model, flags, summaries, texts


def write_report(args, model: str, flags: dict, summaries: dict, texts: dict) -> None:
    names = list(flags)
    same = all(texts[key] == texts[args.request_rate[0], names[0]] for key in texts)
    tag = device_tag(args.device)
    if tag == "cpu":
        where, device = "CPU", f"{cpu_name()}, {os.cpu_count()} cores (shared)"
    else:
        import torch

        where = device = torch.cuda.get_device_name(args.device)
    lines = [
        f"# Online serving on {where}: {os.path.basename(model)}, MT-bench chat, Poisson arrivals",
        "",
        f"- device: {device}; server: {args.dtype}, `hyperdraft serve` on 127.0.0.1",
        f"- date: {datetime.date.today().isoformat()}",
        f"- commit: {git_commit()}",
        f"- command: `{command_line()}`",
        f"- workload: {args.num_prompts} MT-bench first turns via /v1/chat/completions (streamed), Poisson arrivals "
        f"(seed {args.seed}), temperature 0, max_tokens {args.max_tokens}",
        "- configs: " + "; ".join(f"{n}: `{' '.join(flags[n]) or 'no speculation'}`" for n in names),
        f"- outputs identical across configs and rates: {'yes' if same else 'NO'}",
    ]
    for rate in args.request_rate:
        lines += ["", f"## {rate} requests/s", "", HEADER,
                  *(row(n, summaries[rate, n], summaries.get((rate, "none"))) for n in names)]
        if args.passes > 1:
            per_pass = "; ".join(f"{n} " + " ".join(f"{t:.0f}" for t in summaries[rate, n]["pass_throughputs"])
                                 for n in names)
            lines += ["", "Output tok/s of every pass (the row shows the median pass; of an even number, the faster "
                      f"middle one): {per_pass}"]
    lines += [
        "",
        "TTFT: request sent to first content chunk. ITL: gap between content chunks (one chunk per engine step; a "
        "speculative step can carry several tokens). TPOT: (E2E - TTFT) / (tokens - 1). Accept length: tokens "
        "emitted per request-verify over this run's requests (/server_info).",
    ]
    print(f"wrote {write_results(lines, args.out, 'serving', tag)}; outputs identical: {same}")


if __name__ == "__main__":
    main()
