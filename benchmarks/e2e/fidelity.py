"""bf16 fidelity on the real default model: how often batched, eager and speculative decoding reproduce plain
batch-1 decoding token for token, in the default mode and with --enable-deterministic-inference.

Subject: SmolLM2-135M-Instruct (the default GGUF), bf16, MT-bench first turns through the chat template, greedy,
--max-new-tokens each (EOS ignored). The reference of each mode is its own plain decoding, one request at a time.
Rows: plain batched, eager, small prefill chunks, NGRAM, a self-drafting STANDALONE model (chain, tree, adaptive; the
draft is the target, so every draft should be accepted), and random EAGLE-3 / EAGLE heads (chain, tree). Columns:
identical outputs, the first differing positions, the drafts' acceptance rate.

  python -m benchmarks.e2e.fidelity --out $OUT       # GPU -> $OUT/fidelity_<device>.md and .json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile

from benchmarks.common import command_line, device_tag, git_commit, mt_bench_first_turns, require_cuda
from hyperdraft import LLM, SamplingParams
from hyperdraft.models.default_model import ensure_default_model
from hyperdraft.testing.fidelity import CONFIGS, Subject, compare, generate, random_heads

MODES = (("default", False), ("deterministic", True))


def chat_prompts(target: str, count: int) -> list[list[int]]:
    llm = LLM(target, device="cpu", dtype="float32", max_total_tokens=256)
    ids = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in mt_bench_first_turns()[:count]]
    llm.shutdown()
    return ids


def measure(subject: Subject, max_new_tokens: int, engine: dict) -> list[dict]:
    greedy = [SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)] * subject.count
    rows = []
    for mode, flag in MODES:
        reference = generate(subject, flag, {}, greedy, batched=False, **engine)
        for name, config in CONFIGS.items():
            run = generate(subject, flag, config, greedy, **engine)
            rows.append({"mode": mode, "config": name, **compare(reference.outputs, run.outputs),
                         "acceptance_rate": run.state.get("spec_acceptance_rate"), "pool_free": run.pool_free})
            print(rows[-1], flush=True)
    return rows


def render(rows: list[dict], args, device: str) -> str:
    lines = [f"# bf16 fidelity: default against deterministic mode (SmolLM2-135M-Instruct, {device})", "",
             f"- date: {datetime.date.today()}; commit: {git_commit()}; command: `{command_line()}`",
             f"- {args.num_prompts} MT-bench first turns (chat template), greedy, {args.max_new_tokens} new tokens each "
             "(EOS ignored); each mode's reference is its own plain decoding, one request at a time",
             "- identical: outputs equal to the reference token for token; first differing: median and minimum "
             "position of the first difference among the differing outputs", "",
             "| row | default: identical | default: first differing (median / min) | deterministic: identical | "
             "deterministic: first differing | acceptance default / deterministic |", "|---|---|---|---|---|---|"]
    by = {(r["mode"], r["config"]): r for r in rows}
    for name in CONFIGS:
        cells = []
        for mode, _ in MODES:
            r = by[(mode, name)]
            firsts = r["first_differing_positions"]
            cells += [f"{r['identical']}/{r['total']}",
                      f"{statistics.median(firsts):.0f} / {min(firsts)}" if firsts else "-"]
        acc = [by[(m, name)]["acceptance_rate"] for m, _ in MODES]
        acc_text = " / ".join(f"{a:.4f}" for a in acc) if acc[0] is not None else "-"
        lines.append(f"| {name} | {' | '.join(cells)} | {acc_text} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.fidelity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    args = ap.parse_args()
    require_cuda()
    target = ensure_default_model()
    root = tempfile.mkdtemp(prefix="fidelity_")
    subject = Subject(target, dict(input_ids=chat_prompts(target, args.num_prompts)), random_heads(target, root))
    engine = dict(device="cuda", dtype="bfloat16", max_total_tokens=1 << 16, cuda_graph_max_bs=32)
    rows = measure(subject, args.max_new_tokens, engine)
    tag = device_tag("cuda")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"fidelity_{tag}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    path = os.path.join(args.out, f"fidelity_{tag}.md")
    with open(path, "w") as f:
        f.write(render(rows, args, tag.upper()))
    print("wrote", path)


if __name__ == "__main__":
    main()
