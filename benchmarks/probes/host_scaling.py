"""Host work that should not grow with how long a request is or how many wait: each case timed at a small and a large
size of the one factor it varies (an audit of session 40 found these growing; CPU, one thread, tiny random models).

  detokenizer push    one token pushed to a request's text after 1k / 32k / 128k tokens (4 stop strings)
  prefix-cache save   the save after a 2048-token prefill chunk, at the prompt's start, middle and end (128k tokens)
  stream step         LLM.stream's own work a step (outside engine.step), 64 running and 0 / 20k queued
  abort               closing a stream whose requests are mostly queued: 2k / 32k of them
  penalty change      a running batch's sampling rows rebuilt when one request leaves and one joins (256 x 2000 tokens)

  python -m benchmarks.probes.host_scaling [--cases detok save stream abort penalty] [--out FILE]
Public APIs only, so an older tree runs it too (PYTHONPATH=<its checkout> with this file copied in).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from benchmarks.common import command_line, git_commit, write_results
from hyperdraft import LLM, SamplingParams
from hyperdraft.detokenizer import IncrementalDetokenizer
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.kvcache.prefix_cache import PrefixCache
from hyperdraft.kvcache.radix_tree import RadixTree
from hyperdraft.request import Request
from hyperdraft.sample.batch_cache import SamplingBatchCache
from hyperdraft.testing.tiny import make_tiny_model

STOPS = ["a stop string that never appears", "### nor this one", "END OF ANSWER", "\n\n\n\n\n"]


def _tiny(root: str) -> str:
    return make_tiny_model(root, "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=70000)


def detok(model: str) -> list[tuple[str, float]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok.encode("The quick brown fox jumps over the lazy dog; naïve café Ω. " * 50)
    rows = []
    for n in (1000, 32000, 128000):
        seq = (ids * (n // len(ids) + 2))[: n + 1002]
        d = IncrementalDetokenizer(tok, STOPS)
        d.push(seq[:n])
        d.push(seq[n:n + 2])  # the first push after a bulk one decodes its window once
        blocks = []  # the median of five blocks of 200 pushes: a block with a GC pause is an outlier
        for b in range(5):
            start = time.perf_counter()
            for i in range(n + 2 + 200 * b, n + 202 + 200 * b):
                d.push(seq[i:i + 1])
            blocks.append((time.perf_counter() - start) / 200 * 1e6)
        rows.append((f"detokenizer push at {n // 1000}k tokens", statistics.median(blocks)))
    return rows


def save(_model: str) -> list[tuple[str, float]]:
    length, chunk = 131072, 2048
    tree = RadixTree(1)
    table = PageTable(length + 10, 1, 4, length + 8, torch.device("cpu"), cache=tree)
    cache = PrefixCache(tree, table, lookahead=0, draft_kv=False)
    rng = random.Random(0)
    req = Request("r", [rng.randrange(50000) for _ in range(length)], SamplingParams(), 0)
    req.row = table.acquire_row()
    times = {}
    for end in range(chunk, length + 1, chunk):
        table.reserve(req.row, end)
        table.take_pending()
        req.num_computed = end
        start = time.perf_counter()
        cache.save(req)
        table.take_pending()  # the entries the save queued, as the next forward sends them
        times[end] = (time.perf_counter() - start) * 1e6
    return [(f"prefix-cache save, chunk ending at {end // 1024}k of 128k", times[end])
            for end in (chunk, length // 2, length)]


def _stream_llm(model: str) -> LLM:
    return LLM(model, device="cpu", max_total_tokens=100_000, context_length=2048, max_running_requests=64,
               log_level="warning")


def stream(model: str) -> list[tuple[str, float]]:
    llm = _stream_llm(model)
    inside = {"seconds": 0.0, "steps": 0}
    step = llm.engine.step

    def timed_step():
        start = time.perf_counter()
        try:
            return step()
        finally:
            inside["seconds"] += time.perf_counter() - start
            inside["steps"] += 1

    llm.engine.step = timed_step  # the probe's own timer around the real step
    rows, rng = [], random.Random(0)
    for n in (64, 20064):
        prompts = [[rng.randrange(300) for _ in range(8)] for _ in range(n)]
        deltas = llm.stream(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=400,
                                                                              ignore_eos=True))
        for _ in range(3 * 64):  # every running request decoding
            next(deltas)
        inside.update(seconds=0.0, steps=0)
        start = time.perf_counter()
        while inside["steps"] < 200:
            next(deltas)
        wall = time.perf_counter() - start
        rows.append((f"stream's own work a step, {n - 64} queued", (wall - inside["seconds"]) / inside["steps"] * 1e6))
        deltas.close()
    return rows


def abort(model: str) -> list[tuple[str, float]]:
    llm = _stream_llm(model)
    rows, rng = [], random.Random(1)
    for n in (2000, 32000):
        prompts = [[rng.randrange(300) for _ in range(8)] for _ in range(n)]
        deltas = llm.stream(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=50))
        next(deltas)
        start = time.perf_counter()
        deltas.close()
        rows.append((f"closing a stream with {n - 64} queued (ms)", (time.perf_counter() - start) * 1e3))
    return rows


def penalty(_model: str) -> list[tuple[str, float]]:
    vocab, rng = 49152, random.Random(2)
    params = SamplingParams(temperature=0.7, repetition_penalty=1.1)
    reqs = [Request(f"r{i}", [rng.randrange(vocab) for _ in range(1000)], params, seed=i) for i in range(257)]
    for r in reqs:
        r.output_ids = [rng.randrange(vocab) for _ in range(1000)]
    cache = SamplingBatchCache(vocab, "cpu")
    cache.get(reqs[:256])
    times = []
    for k in range(5):
        start = time.perf_counter()
        cache.get(reqs[(k + 1) % 2: 256 + (k + 1) % 2])  # one leaves, one joins
        times.append(time.perf_counter() - start)
    return [("penalty rows rebuilt on a batch change, 256 x 2000 tokens (ms)", statistics.median(times) * 1e3)]


CASES = {"detok": detok, "save": save, "stream": stream, "abort": abort, "penalty": penalty}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--out", help="results file (default: appended to results/host_scaling_cpu.md)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = _tiny(tempfile.mkdtemp())
    lines = [f"## {command_line()}", "", f"- commit: {git_commit()}", "", "| case | us (ms where named) |", "|---|---|"]
    for name in a.cases:
        for label, value in CASES[name](model):
            lines.append(f"| {label} | {value:.1f} |")
            print(lines[-1], flush=True)
    print(write_results(lines, a.out, "host_scaling", "cpu"))


if __name__ == "__main__":
    main()
