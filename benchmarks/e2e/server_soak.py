"""Load and soak harness for `hyperdraft serve` with speculation: rounds of concurrent mixed requests with random
client disconnects, then a long soak, checking what must never happen.

Each round sends --concurrency requests at once: completions and chat, streamed and not, n of 1 or 2, greedy,
sampled and seeded; --disconnect-fraction of them are abandoned by their client after a random delay. After each
round the server must be idle with its KV pool empty. Then --soak-requests requests run --soak-concurrency at a
time. Reported: requests lost (no complete answer, not abandoned) or duplicated (a choice finished twice), KV in use
after each round, server RSS growth over the soak, p50 / p99 latency, and seeded reproducibility under load (probe
requests compared with the same requests sent alone before the load).

  python -m benchmarks.e2e.server_soak                       # tiny random model with NGRAM, CPU
      -> benchmarks/results/server_soak_cpu.md
  python -m benchmarks.e2e.server_soak --model PATH --flags "--speculative-algorithm NGRAM"

Exits 1 when anything was lost or duplicated, KV stayed in use, or a seeded probe differed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shlex
import tempfile
import time
from dataclasses import dataclass

import httpx
import numpy as np

from benchmarks.common import command_line, git_commit, write_results
from benchmarks.e2e.serving import LaunchedServer

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = "the quick brown fox jumps over the lazy dog while seven bright stars drift past a sleepy harbor".split()


@dataclass
class Outcome:
    kind: str  # "ok", "abandoned", "refused" (a 4xx/503 answer), "lost" (no complete answer), "duplicated"
    seconds: float
    text: str = ""


def tiny_chat_model() -> str:
    from transformers import AutoTokenizer

    from hyperdraft.testing.tiny import make_tiny_model

    path = make_tiny_model(os.path.join(tempfile.mkdtemp(prefix="soak-"), "tiny"), "llama")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def request_body(rng: random.Random, model: str, seeded: int | None = None) -> tuple[str, dict]:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    common = {"model": model, "max_tokens": rng.randint(4, 48), "stream": rng.random() < 0.5,
              "temperature": rng.choice([0.0, 0.7, 1.0]), "n": rng.choice([1, 1, 1, 2])}
    if seeded is not None:
        common.update(temperature=0.8, seed=seeded, n=1, max_tokens=24, stream=False)
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": words}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}]}


async def send(client: httpx.AsyncClient, url: str, path: str, body: dict) -> Outcome:
    """One request to its end; 'lost' when the answer is incomplete or the connection failed, 'duplicated' when a
    choice finished twice."""
    start = time.perf_counter()
    try:
        return await _send(client, url, path, body, start)
    except httpx.TransportError as e:
        return Outcome("lost", time.perf_counter() - start, f"{type(e).__name__}: {e}")


async def _send(client: httpx.AsyncClient, url: str, path: str, body: dict, start: float) -> Outcome:
    n = body.get("n", 1)
    if not body.get("stream"):
        r = await client.post(url + path, json=body)
        if r.status_code != 200:
            return Outcome("refused" if r.status_code < 500 else "lost", time.perf_counter() - start, r.text)
        choices = r.json()["choices"]
        ok = sorted(c["index"] for c in choices) == list(range(n)) and all(c["finish_reason"] for c in choices)
        text = choices[0]["text"] if "text" in choices[0] else choices[0]["message"]["content"]
        return Outcome("ok" if ok else "lost", time.perf_counter() - start, text)
    finished: dict[int, int] = {}
    done = False
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return Outcome("refused" if r.status_code < 500 else "lost", time.perf_counter() - start, r.text)
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for c in json.loads(line[6:]).get("choices", []):
                    if c.get("finish_reason"):
                        finished[c["index"]] = finished.get(c["index"], 0) + 1
    if any(v > 1 for v in finished.values()):
        return Outcome("duplicated", time.perf_counter() - start)
    complete = done and sorted(finished) == list(range(n))
    return Outcome("ok" if complete else "lost", time.perf_counter() - start)


async def maybe_abandon(client, url, path, body, rng: random.Random, fraction: float) -> Outcome:
    start = time.perf_counter()
    if rng.random() >= fraction:
        return await send(client, url, path, body)
    try:
        return await asyncio.wait_for(send(client, url, path, body), rng.uniform(0.01, 1.0))
    except asyncio.TimeoutError:  # the client went away mid-request
        return Outcome("abandoned", time.perf_counter() - start)


def server_state(url: str) -> dict:
    info = httpx.get(url + "/server_info", timeout=30).json()
    return info["internal_states"][0]


def wait_idle(url: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = server_state(url)
        if (state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


async def run(args, url: str, model: str, pid: int) -> tuple[list[str], bool]:
    rng = random.Random(args.seed)
    # Idle connections expire before uvicorn's 5 s keep-alive does: reusing one the server is closing would show up
    # as a transport error that no server behaviour caused.
    limits = httpx.Limits(max_connections=args.concurrency + 8, keepalive_expiry=2.0)
    lines, healthy = [], True
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        probes = [request_body(rng, model, seeded=1000 + i) for i in range(8)]
        alone = [(await send(client, url, path, body)).text for path, body in probes]
        lines += ["| round | sent | ok | abandoned | refused | lost | duplicated | KV tokens in use after | seeded probes "
                  "equal to alone |", "|---|---|---|---|---|---|---|---|---|"]
        for rnd in range(args.rounds):
            bodies = [request_body(rng, model) for _ in range(args.concurrency)]
            tasks = [maybe_abandon(client, url, p, b, rng, args.disconnect_fraction) for p, b in bodies]
            tasks += [send(client, url, p, b) for p, b in probes]
            outcomes = await asyncio.gather(*tasks)
            probe_same = sum(o.text == a for o, a in zip(outcomes[-len(probes):], alone))
            state = await asyncio.to_thread(wait_idle, url)
            kinds = [o.kind for o in outcomes]
            kv_used = state["kv_capacity_tokens"] - state["kv_free_tokens"]
            lines.append(f"| {rnd + 1} | {len(outcomes)} | {kinds.count('ok')} | {kinds.count('abandoned')} | "
                         f"{kinds.count('refused')} | {kinds.count('lost')} | {kinds.count('duplicated')} | {kv_used} | "
                         f"{probe_same}/{len(probes)} |")
            print(lines[-1], flush=True)
            healthy &= kinds.count("lost") == kinds.count("duplicated") == kv_used == 0 and probe_same == len(probes)
        rss_before = rss_mb(pid)
        sem = asyncio.Semaphore(args.soak_concurrency)

        async def limited(path, body):
            async with sem:
                return await send(client, url, path, body)

        start = time.perf_counter()
        soak = await asyncio.gather(*(limited(*request_body(rng, model)) for _ in range(args.soak_requests)))
        seconds = time.perf_counter() - start
        state = await asyncio.to_thread(wait_idle, url)
        rss_after = rss_mb(pid)
        lat = np.array([o.seconds for o in soak if o.kind == "ok"])
        kinds = [o.kind for o in soak]
        kv_used = state["kv_capacity_tokens"] - state["kv_free_tokens"]
        healthy &= kinds.count("lost") == kinds.count("duplicated") == kv_used == 0
        lines += ["", f"Soak: {args.soak_requests} requests, {args.soak_concurrency} at a time, {seconds:.1f} s: "
                      f"ok {kinds.count('ok')}, refused {kinds.count('refused')}, lost {kinds.count('lost')}, "
                      f"duplicated {kinds.count('duplicated')}; KV tokens in use after: {kv_used}; latency p50 "
                      f"{np.percentile(lat, 50) * 1e3:.0f} ms, p99 {np.percentile(lat, 99) * 1e3:.0f} ms; server RSS "
                      f"{rss_before:.0f} MB -> {rss_after:.0f} MB ({rss_after - rss_before:+.0f} MB)"]
        print(lines[-1], flush=True)
    return lines, healthy


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.server_soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: a tiny random chat model built here)")
    ap.add_argument("--flags", default="--speculative-algorithm NGRAM --speculative-num-steps 4",
                    help="server flags (default: NGRAM speculation, 4 steps)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--disconnect-fraction", type=float, default=0.3)
    ap.add_argument("--soak-requests", type=int, default=2000)
    ap.add_argument("--soak-concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="report path (default: benchmarks/results/server_soak_<device>.md)")
    args = ap.parse_args()
    model = args.model or tiny_chat_model()
    flags = shlex.split(args.flags) + ["--max-running-requests", "128"]
    server = LaunchedServer(model, flags, args.device)
    try:
        name = os.path.basename(os.path.normpath(model))
        lines, healthy = asyncio.run(run(args, server.url, name, server.proc.pid))
    finally:
        server.stop()
    header = [f"# Server load and soak ({'tiny random chat model' if not args.model else name}, {args.device})", "",
              f"- date: {datetime.date.today()}; commit: {git_commit()}; command: `{command_line()}`",
              f"- server flags: `{' '.join(flags)}`; {args.rounds} rounds of {args.concurrency} concurrent mixed "
              f"requests (+8 seeded probes), {args.disconnect_fraction:.0%} abandoned by their client after "
              f"0.01-1 s; then the soak", f"- verdict: **{'healthy' if healthy else 'FAILED'}**", ""]
    write_results(header + lines, args.out, "server_soak", args.device)
    print("\n".join(header + lines))
    raise SystemExit(0 if healthy else 1)


if __name__ == "__main__":
    main()
