"""Offline decode throughput (generated tokens/s) at several batch sizes, on a tiny random model on CPU.

Makes its own model (make_tiny_model with a somewhat larger config, so timing means something) in a
temp dir, runs a warm-up, then for each batch size submits that many prompts at once with greedy
sampling and ignore_eos, and times llm.generate. Writes a markdown report.

    python -m benchmarks.e2e.offline_throughput [--batch-sizes 1,16] [--max-new-tokens 128] [--repeats 10] [--threads N]
    (writes benchmarks/results/offline_throughput_cpu.md)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import tempfile
import time

import torch

from benchmarks.common import command_line, cpu_name, git_commit, write_results
from hyperdraft import LLM, SamplingParams
from hyperdraft.testing.tiny import make_tiny_model

MODEL_OVERRIDES = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=8,
                       num_key_value_heads=2, max_position_embeddings=1024)


def load_average() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "unknown"


def run_batch(llm: LLM, batch: int, prompt_len: int, new_tokens: int, seed: int) -> tuple[int, float]:
    rng = random.Random(seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    assert tokens == batch * new_tokens, f"expected {batch * new_tokens} tokens, got {tokens}"
    return tokens, seconds


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.offline_throughput", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes (default: 1,16)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (default: 128)")
    ap.add_argument("--prompt-len", type=int, default=16, help="prompt length in tokens (default: 16)")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs per batch size; the fastest counts (default: 10)")
    ap.add_argument("--page-size", type=int, default=16, help="KV-cache page size (default: 16)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--out", help="markdown report path (default: appended to "
                                  "benchmarks/results/offline_throughput_cpu.md)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = load_average()

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(os.path.join(tmp, "model"), kind="llama", **MODEL_OVERRIDES)
        llm = LLM(model=path, device="cpu", dtype="float32", page_size=args.page_size,
                  max_running_requests=max(batches), max_total_tokens=max(batches) * (args.prompt_len + args.max_new_tokens + 64))
        model = getattr(getattr(llm.engine, "runner", None), "model", None)  # an engine internal: optional
        params = sum(p.numel() for p in model.parameters()) if isinstance(model, torch.nn.Module) else None
        for batch in batches:  # warm-up
            run_batch(llm, batch, args.prompt_len, 16, seed=-batch)
        rows = []
        for batch in batches:
            runs = [run_batch(llm, batch, args.prompt_len, args.max_new_tokens, seed=batch * 100 + r) for r in range(args.repeats)]
            tokens, seconds = min(runs, key=lambda r: r[1])
            rows.append((batch, tokens, seconds, tokens / seconds, [s for _, s in runs]))
            print(f"batch {batch:3d}: {tokens} tokens in {seconds:.3f}s = {tokens / seconds:.1f} tok/s", flush=True)

    base, load_after = rows[0][3], load_average()
    cfg = ", ".join(f"{k}={v}" for k, v in MODEL_OVERRIDES.items())
    lines = [
        "# Offline decode throughput, CPU",
        "",
        f"- Device: {cpu_name()}; {os.cpu_count()} logical CPUs; torch threads: {torch.get_num_threads()}",
        f"- Software: torch {torch.__version__}, Python {platform.python_version()}",
        f"- Date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- Command: `{command_line()}`",
        f"- Git commit: {git_commit()}",
        f"- Load average (1, 5, 15 min) before / after: {load_before} / {load_after} "
        "(other processes on the machine slow CPU timings down, sometimes by several times)",
        f"- Model: tiny random llama (make_tiny_model, {cfg}"
        + (f"; {params / 1e6:.1f}M parameters" if params else "") + "), float32",
        f"- Workload: greedy, ignore_eos, {args.prompt_len}-token prompts, {args.max_new_tokens} new tokens per prompt, "
        f"page_size={args.page_size}; a warm-up run per batch size; fastest of {args.repeats} timed runs per batch size. "
        "Seconds are the wall time of one `LLM.generate` call (prefill included).",
        "",
        "| batch | prompts | tokens generated | seconds | tokens/s | ratio vs batch 1 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [f"| {b} | {b} | {t} | {s:.3f} | {tps:.1f} | {tps / base:.2f}x |" for b, t, s, tps, _ in rows]
    lines += ["", "All timed runs, seconds: " + "; ".join(f"batch {b}: {', '.join(f'{x:.3f}' for x in runs)}"
                                                       for b, _, _, _, runs in rows) + "."]
    print(f"wrote {write_results(lines, args.out, 'offline_throughput', 'cpu')}")


if __name__ == "__main__":
    main()
