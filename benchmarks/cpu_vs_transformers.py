"""CPU peer comparison on SmolLM2-135M-Instruct (the embedded default model), fp32, greedy, in one run:

  (a) transformers generate
  (b) transformers generate(prompt_lookup_num_tokens=K)   -- transformers' own n-gram speculation
  (c) hyperdraft without speculation
  (d) hyperdraft with NGRAM speculation
Rows (a)-(d) run the prompts one after another at batch 1; a last pair of rows runs hyperdraft at batch 16,
which transformers' speculative paths cannot do. Each output is also checked for equality with (c).

  python benchmarks/cpu_vs_transformers.py            # writes benchmarks/results/cpu_vs_transformers.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyperdraft import LLM, SamplingParams  # noqa: E402
from hyperdraft.models.default_model import ensure_default_model  # noqa: E402

MT_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mt_bench_questions.jsonl")


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    with open(MT_BENCH) as f:
        questions = [json.loads(line)["turns"][0] for line in f][:n]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for q in questions]


def run_transformers(gguf: str, prompts, new_tokens: int, lookup: int | None) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32)
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    kw = dict(max_new_tokens=new_tokens, do_sample=False)
    if lookup:
        kw["prompt_lookup_num_tokens"] = lookup
    ids = torch.tensor([prompts[0]])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)  # warm-up
    outs, start = [], time.perf_counter()
    for p in prompts:
        ids = torch.tensor([p])
        outs.append(model.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0, len(p):].tolist())
    seconds = time.perf_counter() - start
    outs = [o[: o.index(model.generation_config.eos_token_id) + 1] if model.generation_config.eos_token_id in o else o for o in outs]
    return {"tokens": sum(map(len, outs)), "seconds": seconds, "outputs": outs, "accept": None}


def run_hyperdraft(gguf: str, prompts, new_tokens: int, batch: int, spec: dict) -> dict:
    llm = LLM(gguf, dtype="float32", **spec)
    sp = SamplingParams(temperature=0, max_new_tokens=new_tokens)
    llm.generate(input_ids=prompts[:batch], sampling_params=SamplingParams(temperature=0, max_new_tokens=4), use_tqdm=False)
    outs, start, verifies, spec_tokens = [], time.perf_counter(), 0, 0
    for i in range(0, len(prompts), batch):
        for o in llm.generate(input_ids=prompts[i : i + batch], sampling_params=sp, use_tqdm=False):
            outs.append(o.token_ids)
            if o.meta_info.get("spec_verify_ct"):
                verifies += o.meta_info["spec_verify_ct"]
                spec_tokens += o.meta_info["completion_tokens"]
    seconds = time.perf_counter() - start
    llm.shutdown()
    return {"tokens": sum(map(len, outs)), "seconds": seconds, "outputs": outs,
            "accept": spec_tokens / verifies if verifies else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens for transformers")
    ap.add_argument("--steps", type=int, default=8, help="NGRAM draft tokens per round for hyperdraft")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_vs_transformers.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = args.model or ensure_default_model()
    from hyperdraft.models.gguf import load_gguf_tokenizer

    prompts = chat_prompts(load_gguf_tokenizer(gguf), args.num_prompts)
    ngram = dict(speculative_algorithm="NGRAM", speculative_num_steps=args.steps)
    rows = {
        "(a) transformers generate": run_transformers(gguf, prompts, args.new_tokens, None),
        f"(b) transformers prompt lookup (K={args.lookup})": run_transformers(gguf, prompts, args.new_tokens, args.lookup),
        "(c) hyperdraft, no speculation": run_hyperdraft(gguf, prompts, args.new_tokens, 1, {}),
        f"(d) hyperdraft NGRAM (steps {args.steps})": run_hyperdraft(gguf, prompts, args.new_tokens, 1, ngram),
        "(c16) hyperdraft, no speculation, batch 16": run_hyperdraft(gguf, prompts, args.new_tokens, 16, {}),
        f"(d16) hyperdraft NGRAM, batch 16": run_hyperdraft(gguf, prompts, args.new_tokens, 16, ngram),
    }
    for name, r in rows.items():
        print(name, {k: v for k, v in r.items() if k != "outputs"}, flush=True)
    write(args, rows)


def write(args, rows: dict) -> None:
    names = list(rows)
    a, b, c, d = (rows[n] for n in names[:4])
    tok_s = {n: r["tokens"] / r["seconds"] for n, r in rows.items()}
    same = {n: sum(x == y for x, y in zip(r["outputs"], c["outputs"])) for n, r in rows.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), platform.machine())
    lines = ["# CPU: hyperdraft vs transformers on SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32)", "",
             f"- device: {cpu}, {args.threads} torch threads", f"- date: {datetime.date.today()}", f"- commit: {commit}",
             f"- command: `python {' '.join(sys.argv)}`",
             f"- {args.num_prompts} MT-bench first turns (chat template), greedy, up to {args.new_tokens} new tokens, stop at EOS", "",
             "| run | tokens | seconds | tokens/s | vs (a) | accept length | outputs equal to (c) |", "|---|---|---|---|---|---|---|"]
    for n, r in rows.items():
        acc = f"{r['accept']:.2f}" if r["accept"] else "-"
        lines.append(f"| {n} | {r['tokens']} | {r['seconds']:.1f} | {tok_s[n]:.1f} | {tok_s[n] / tok_s[names[0]]:.2f}x | {acc} | "
                     f"{same[n]}/{len(r['outputs'])} |")
    lines += ["", f"- d/b (both speculative, batch 1): **{tok_s[names[3]] / tok_s[names[1]]:.2f}x**",
              f"- d/c (what NGRAM buys hyperdraft at batch 1): {tok_s[names[3]] / tok_s[names[2]]:.2f}x",
              f"- d16/b (batch 16, which transformers' prompt lookup cannot do): {tok_s[names[5]] / tok_s[names[1]]:.2f}x"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
