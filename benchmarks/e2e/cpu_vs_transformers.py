"""CPU peer comparison on SmolLM2-135M-Instruct (the embedded default model), fp32, greedy, in one process:

  (a) transformers generate
  (b) transformers generate(prompt_lookup_num_tokens=K)   -- transformers' own n-gram speculation
  (c) hyperdraft without speculation
  (d) hyperdraft with NGRAM speculation
Rows (a)-(d) run at batch 1, interleaved: prompt 1 through a, b, c, d (the order rotating per prompt), then prompt
2, ..., so load from other processes on a shared machine hits all four alike; with --repeats R each prompt runs R
times per configuration and the per-prompt minimum is reported beside the plain total. A last pair of rows runs
hyperdraft at batch 16, which transformers' speculative paths cannot do. Every output is checked for equality
with (c).

  python -m benchmarks.e2e.cpu_vs_transformers        # writes benchmarks/results/cpu_vs_transformers_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from benchmarks.common import command_line, cpu_name, git_commit, mt_bench_first_turns, write_results
from hyperdraft import LLM, SamplingParams
from hyperdraft.models.default_model import ensure_default_model


@dataclass
class Row:
    name: str
    seconds: list[list[float]] = field(default_factory=list)  # [prompt][repeat]
    outputs: list[list[int]] = field(default_factory=list)
    verifies: int = 0  # speculative rounds (hyperdraft NGRAM only)
    spec_tokens: int = 0

    @property
    def tokens(self) -> int:
        return sum(map(len, self.outputs))

    def total(self, pick=None) -> float:
        """Seconds over all prompts: every run divided by the repeats, or the per-prompt minimum."""
        return sum(min(s) if pick == "min" else sum(s) / len(s) for s in self.seconds)

    @property
    def accept(self) -> float | None:
        return self.spec_tokens / self.verifies if self.verifies else None


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    questions = mt_bench_first_turns()[:n]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for q in questions]


class Transformers:
    def __init__(self, gguf: str, new_tokens: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                          dtype=torch.float32)
        self.eos = self.model.generation_config.eos_token_id
        self.model.generation_config.pad_token_id = self.eos
        self.new_tokens = new_tokens

    def run(self, prompt: list[int], lookup: int | None, new_tokens: int | None = None) -> tuple[list[int], dict]:
        ids = torch.tensor([prompt])
        kw = dict(max_new_tokens=new_tokens or self.new_tokens, do_sample=False)
        if lookup:
            kw["prompt_lookup_num_tokens"] = lookup
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0, len(prompt):].tolist()
        return (out[: out.index(self.eos) + 1] if self.eos in out else out), {}


class NgramState:
    """NGRAM's cross-request history (finished requests' tokens). A repeat must start from the history its first run
    saw: otherwise it finds its own earlier answer there and drafts it perfectly."""

    def __init__(self, llm: LLM | None):
        proposer = getattr(llm.engine.worker, "proposer", None) if llm is not None else None
        self.proposer = proposer if getattr(proposer, "history", None) is not None else None

    def save(self):
        return self.proposer.save_history() if self.proposer else None

    def restore(self, saved) -> None:
        if self.proposer:
            self.proposer.restore_history(saved)

    def clear(self) -> None:
        if self.proposer:
            self.proposer.restore_history((self.proposer.history.tokens[:0], {}))


def hyperdraft_run(llm: LLM, new_tokens: int):
    sp = SamplingParams(temperature=0, max_new_tokens=new_tokens)

    def run(prompt: list[int]) -> tuple[list[int], dict]:
        o = llm.generate(input_ids=[prompt], sampling_params=sp, use_tqdm=False)[0]
        return o.token_ids, o.meta_info

    run.state = NgramState(llm)
    return run


def interleaved(runners: dict, prompts, repeats: int) -> dict[str, Row]:
    rows = {name: Row(name) for name in runners}
    names = list(runners)
    states = {name: getattr(runners[name], "state", NgramState(None)) for name in names}
    for i, prompt in enumerate(prompts):
        times = {name: [] for name in names}
        saved = {name: states[name].save() for name in names}
        for r in range(repeats):
            for name in names[i % len(names):] + names[: i % len(names)]:  # rotate who goes first
                if r:
                    states[name].restore(saved[name])
                start = time.perf_counter()
                out, meta = runners[name](prompt)
                times[name].append(time.perf_counter() - start)
                if r == 0:
                    rows[name].outputs.append(out)
                    if meta.get("spec_verify_ct"):
                        rows[name].verifies += meta["spec_verify_ct"]
                        rows[name].spec_tokens += meta["completion_tokens"]
        for name in names:
            rows[name].seconds.append(times[name])
        print(f"prompt {i + 1}/{len(prompts)}: " + "  ".join(
            f"{n.split(')')[0]}) {len(rows[n].outputs[-1]) / min(times[n]):.1f}" for n in names) + " tok/s", flush=True)
    return rows


def batched(llm: LLM, name: str, prompts, batch: int, new_tokens: int, repeats: int) -> Row:
    sp = SamplingParams(temperature=0, max_new_tokens=new_tokens)
    row = Row(name)
    seconds = []
    state = NgramState(llm)
    for r in range(repeats):
        state.clear()  # every repeat starts from an empty history, as at batch 1 before the first prompt
        start, outs = time.perf_counter(), []
        for i in range(0, len(prompts), batch):
            for o in llm.generate(input_ids=prompts[i : i + batch], sampling_params=sp, use_tqdm=False):
                outs.append(o.token_ids)
                if r == 0 and o.meta_info.get("spec_verify_ct"):
                    row.verifies += o.meta_info["spec_verify_ct"]
                    row.spec_tokens += o.meta_info["completion_tokens"]
        seconds.append(time.perf_counter() - start)
        row.outputs = row.outputs or outs
    row.seconds = [seconds]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.cpu_vs_transformers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens for transformers")
    ap.add_argument("--steps", type=int, default=3,
                    help="NGRAM draft tokens per round for hyperdraft (on CPU a verify of up to 4 rows costs about "
                         "what a 1-token decode does, so 3 is the cheapest useful width)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per prompt and configuration (the minimum is reported)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="report path (default: appended to benchmarks/results/cpu_vs_transformers_cpu.md)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = args.model or ensure_default_model()
    from hyperdraft.models.gguf import load_gguf_tokenizer

    prompts = chat_prompts(load_gguf_tokenizer(gguf), args.num_prompts)
    pool = 16 * (max(map(len, prompts)) + args.new_tokens + args.steps + 16)  # batch 16's worth of KV, not 64k tokens
    hf = Transformers(gguf, args.new_tokens)
    plain = LLM(gguf, device="cpu", dtype="float32", max_total_tokens=pool)
    ngram = LLM(gguf, device="cpu", dtype="float32", max_total_tokens=pool, speculative_algorithm="NGRAM",
                speculative_num_steps=args.steps)
    for p in prompts[:1]:  # warm-up: first-call allocations and kernel choices stay out of the timings
        hf.run(p, None, 4), hf.run(p, args.lookup, 4)
        for llm in (plain, ngram):
            llm.generate(input_ids=[p], sampling_params=SamplingParams(temperature=0, max_new_tokens=4), use_tqdm=False)
    NgramState(ngram).clear()  # the warm-up's tokens must not help the first prompt
    load_before = os.getloadavg()
    runners = {
        "(a) transformers generate": lambda p: hf.run(p, None),
        f"(b) transformers prompt lookup (K={args.lookup})": lambda p: hf.run(p, args.lookup),
        "(c) hyperdraft, no speculation": hyperdraft_run(plain, args.new_tokens),
        f"(d) hyperdraft NGRAM (steps {args.steps})": hyperdraft_run(ngram, args.new_tokens),
    }
    rows = interleaved(runners, prompts, args.repeats)
    rows["(c16) hyperdraft, no speculation, batch 16"] = batched(plain, "c16", prompts, 16, args.new_tokens, args.repeats)
    rows["(d16) hyperdraft NGRAM, batch 16"] = batched(ngram, "d16", prompts, 16, args.new_tokens, args.repeats)
    load_after = os.getloadavg()
    for name, r in rows.items():
        print(name, r.tokens, f"{r.total():.1f}s", f"min {r.total('min'):.1f}s", r.accept, flush=True)
    write(args, rows, (load_before, load_after))


def write(args, rows: dict[str, Row], loads) -> None:
    names = list(rows)
    c = rows[names[2]]
    tok_s = {n: r.tokens / r.total() for n, r in rows.items()}
    tok_s_min = {n: r.tokens / r.total("min") for n, r in rows.items()}
    same = {n: sum(x == y for x, y in zip(r.outputs, c.outputs)) for n, r in rows.items()}
    commit = git_commit()
    cpu = cpu_name()
    per_prompt = [(len(rows[names[3]].outputs[i]) / min(rows[names[3]].seconds[i]))
                  / (len(rows[names[1]].outputs[i]) / min(rows[names[1]].seconds[i])) for i in range(len(c.outputs))]
    lines = ["# CPU: hyperdraft vs transformers on SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32)", "",
             f"- device: {cpu}, {args.threads} torch threads", f"- date: {datetime.date.today()}", f"- commit: {commit}",
             f"- command: `{command_line()}`",
             f"- {args.num_prompts} MT-bench first turns (chat template), greedy, up to {args.new_tokens} new tokens, stop at "
             f"EOS; (a)-(d) interleaved per prompt, {args.repeats} run(s) per prompt and configuration",
             "- (d) drafts from the request itself and from a history of the earlier prompts' answers (NGRAM's "
             "cross-request history); every repeat of a prompt starts from the history its first run saw, and each "
             "batch-16 run from an empty one",
             f"- load average (1 min) before / after the timed runs: {loads[0][0]:.2f} / {loads[1][0]:.2f} (a shared machine)",
             "", "| run | tokens | seconds | tokens/s | vs (a) | tokens/s, per-prompt min | accept length | outputs equal to (c) |",
             "|---|---|---|---|---|---|---|---|"]
    for n, r in rows.items():
        acc = f"{r.accept:.2f}" if r.accept else "-"
        lines.append(f"| {n} | {r.tokens} | {r.total():.1f} | {tok_s[n]:.1f} | {tok_s[n] / tok_s[names[0]]:.2f}x | "
                     f"{tok_s_min[n]:.1f} | {acc} | {same[n]}/{len(r.outputs)} |")
    lines += ["", f"- d/b (both speculative, batch 1): **{tok_s[names[3]] / tok_s[names[1]]:.2f}x** "
                  f"(per-prompt minimum times: {tok_s_min[names[3]] / tok_s_min[names[1]]:.2f}x; per prompt: min "
                  f"{min(per_prompt):.2f}x, median {statistics.median(per_prompt):.2f}x, max {max(per_prompt):.2f}x)",
              f"- d/c (what NGRAM buys hyperdraft at batch 1): {tok_s[names[3]] / tok_s[names[2]]:.2f}x",
              f"- c/a (plain decoding, batch 1): {tok_s[names[2]] / tok_s[names[0]]:.2f}x",
              f"- d16/b (batch 16, which transformers' prompt lookup cannot do): {tok_s[names[5]] / tok_s[names[1]]:.2f}x"]
    write_results(lines, args.out, "cpu_vs_transformers", "cpu")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
