"""Adaptive speculation vs static tiers over batch sizes, in one run.

Workload: NGRAM drafts on a tiny "bigram" model (attention outputs zeroed, so greedy text falls into short
cycles that prompt lookup predicts: cheap drafts, high acceptance). For each batch size it runs every static tier
(steps 0 = no speculation), the SGLang-compatible EMA policy and the goodput policy, and reports tokens/s as a ratio
to the best static tier at that batch size. Appends its report to benchmarks/results/adaptive_cpu.md and redraws
adaptive_cpu.png beside it (--out-dir DIR writes both there instead).

  python -m benchmarks.e2e.adaptive        # CPU; needs matplotlib for the plot
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time

import torch

from benchmarks.common import command_line, git_commit, write_results
from hyperdraft import LLM, SamplingParams
from hyperdraft.testing.tiny import make_tiny_model

STATIC = [0, 1, 3, 5, 7]
LADDER = {"1": {"candidate_steps": STATIC}}


def bigram_model(root: str) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = make_tiny_model(os.path.join(root, "src"), "llama", seed=3, hidden_size=256, intermediate_size=768,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    dst = os.path.join(root, "bigram")
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def measure(model, prompts, new_tokens, repeats, engine_args) -> dict:
    llm = LLM(model, **engine_args)
    sp = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    llm.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True), use_tqdm=False)
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(input_ids=prompts, sampling_params=sp, use_tqdm=False)
        seconds = time.perf_counter() - start
        best = seconds if best is None else min(best, seconds)
    tokens = sum(len(o.token_ids) for o in outs)
    state = llm.get_server_info()["internal_states"][0]
    llm.shutdown()
    return {"tok_s": tokens / best, "tiers": state.get("spec_steps_per_tier", {}), "accept": state.get("avg_spec_accept_length")}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.adaptive", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out-dir", default=None,
                    help="a directory for adaptive_cpu.md/.png, replacing them (default: the report is appended to "
                         "benchmarks/results/adaptive_cpu.md, which keeps earlier runs; the plot is replaced)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="hd_adaptive_")
    model = bigram_model(tmp)
    configs = {f"static {s}": dict(speculative_algorithm="NGRAM", speculative_num_steps=s) if s else {} for s in STATIC}
    for name, cfg in (("EMA", dict(LADDER, ema_alpha=0.3, warmup_batches=4, update_interval=2)),
                      ("goodput", dict(LADDER, strategy="goodput", goodput={"warmup": 4, "decide_every": 2, "explore_every": 10}))):
        path = os.path.join(tmp, f"{name}.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        configs[name] = dict(speculative_algorithm="NGRAM", speculative_adaptive=True, speculative_adaptive_config=path)
    g = torch.Generator().manual_seed(0)
    results = {}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = [torch.randint(0, 384, (24,), generator=g).tolist() for _ in range(bs)]
        for name, cfg in configs.items():
            results[(bs, name)] = measure(model, prompts, args.new_tokens, args.repeats, dict(device="cpu", **cfg))
            print(bs, name, results[(bs, name)], flush=True)
    write(args, results, configs)


def write(args, results, configs) -> None:
    commit = git_commit()
    sizes = sorted({bs for bs, _ in results})
    lines = ["# Adaptive speculation vs static tiers", "",
             f"- device: {platform.machine()} CPU, {args.threads} torch thread(s)", f"- date: {datetime.date.today()}",
             f"- commit: {commit}", f"- command: `{command_line()}`",
             f"- workload: NGRAM on a tiny bigram model (cyclic greedy text), {args.new_tokens} new tokens per request, "
             f"fastest of {args.repeats} passes; ladder {STATIC} for every batch size", "",
             "tokens/s, and the ratio to the best static tier at that batch size:", "",
             "| batch | " + " | ".join(configs) + " |", "|---" * (len(configs) + 1) + "|"]
    for bs in sizes:
        best = max(results[(bs, n)]["tok_s"] for n in configs if n.startswith("static"))
        cells = [f"{results[(bs, n)]['tok_s']:.0f} ({results[(bs, n)]['tok_s'] / best:.2f}x)" for n in configs]
        lines.append(f"| {bs} | " + " | ".join(cells) + " |")
    lines += ["", "Steps run per tier by the adaptive policies:", ""]
    for bs in sizes:
        for n in ("EMA", "goodput"):
            lines.append(f"- batch {bs}, {n}: {results[(bs, n)]['tiers']}")
    out = None if args.out_dir is None else os.path.join(args.out_dir, "adaptive_cpu.md")
    report = write_results(lines, out, "adaptive", "cpu")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in configs:
        style = "-o" if not n.startswith("static") else ":."
        ax.plot(sizes, [results[(bs, n)]["tok_s"] for bs in sizes], style, label=n, linewidth=2.5 if style == "-o" else 1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Adaptive speculation vs static tiers (CPU, NGRAM, tiny bigram model)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(report[:-len(".md")] + ".png", dpi=110)
    print("wrote", report)


if __name__ == "__main__":
    main()
