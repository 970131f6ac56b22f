"""Speculative vs plain decoding on the same prompts, in one run.

Reports accept length, output tokens/s, and the ratio to the non-speculative baseline measured in the same
process. By default it builds its own tiny models (CPU-friendly); --model / --draft-model take real ones.

Drafters measured:
  NGRAM                prompt lookup
  STANDALONE self      the target as its own draft: the upper bound of acceptance, at twice the draft cost
  STANDALONE noisy     a perturbed copy of the target (q close to p but not equal): a stand-in for a trained draft
  STANDALONE small     a small random draft of different shape: realistic cost, near-zero acceptance
At temperature > 0 it also compares greedy drafting (q one-hot) with sampled drafting
(--speculative-use-rejection-sampling, drafts drawn from q, accepted with min(1, p/q)).

  python -m benchmarks.e2e.spec_offline       # CPU, tiny models -> benchmarks/results/spec_offline_cpu.md
  python -m benchmarks.e2e.spec_offline --device cuda --out $OUT/spec_offline_h100.md   # on a GPU

Every engine records per-phase step times (RuntimeOptions record_step_time=True, which syncs the GPU at each phase)
for the cost split.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time

import torch

from benchmarks.common import MT_BENCH, command_line, device_tag, git_commit, mt_bench_first_turns, write_results
from hyperdraft import LLM, SamplingParams
from hyperdraft.options import RuntimeOptions
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model

TARGET_SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
SMALL_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)


def load_prompts(n: int) -> list[str]:
    if os.path.exists(MT_BENCH):
        return mt_bench_first_turns()[:n]
    return [f"Question {i}: explain speculative decoding in simple words." for i in range(n)]


def noisy_copy(src: str, dst: str, noise: float, seed: int = 0) -> str:
    """Copy a checkpoint, adding relative Gaussian noise to every weight."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * p.std() * noise)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def run(model: str, prompts: list[str], sp: SamplingParams, batch: int, engine_args: dict, repeats: int) -> dict:
    """Fastest of `repeats` passes over the prompts (the machine may be shared; the minimum is the least disturbed)."""
    llm = LLM(model, runtime_options=RuntimeOptions.from_env(record_step_time=True), **engine_args)  # the cost split
    llm.generate(prompts[:batch], SamplingParams(**{**sp.__dict__, "max_new_tokens": 4}), use_tqdm=False)  # warm-up
    best = None
    for _ in range(repeats):
        tokens, seconds, verifies, completion = 0, 0.0, 0, 0
        for i in range(0, len(prompts), batch):
            start = time.perf_counter()
            outs = llm.generate(prompts[i : i + batch], sp, use_tqdm=False)
            seconds += time.perf_counter() - start
            for o in outs:
                tokens += len(o.token_ids)
                verifies += o.meta_info.get("spec_verify_ct", 0)
                completion += o.meta_info["completion_tokens"] if o.meta_info.get("spec_verify_ct") else 0
        if best is None or seconds < best["seconds"]:
            best = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                    "accept_len": completion / verifies if verifies else None}
    state = llm.get_server_info()["internal_states"][0]
    best["phases"] = state.get("spec_phase_seconds", {})
    best["verifies"] = state.get("spec_verify_forwards", 0)
    llm.shutdown()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.spec_offline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target model directory (default: a tiny random model)")
    ap.add_argument("--draft-model", help="STANDALONE draft directory (default: tiny random drafts)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7, help="for the greedy-vs-sampled-draft comparison")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per configuration; the fastest is reported")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is steadiest on a shared machine)")
    ap.add_argument("--out", help="report path (default: appended to benchmarks/results/spec_offline_<device>.md)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="hd_bench_")
    target = args.model or make_tiny_model(os.path.join(tmp, "target"), "llama", seed=3, **TARGET_SHAPE)
    drafts = {"self": target}
    if args.draft_model:
        drafts["given"] = args.draft_model
    else:
        drafts["noisy"] = noisy_copy(target, os.path.join(tmp, "noisy"), noise=0.05)
        drafts["small"] = make_tiny_model(os.path.join(tmp, "small"), "qwen3", seed=4, head_dim=32, **SMALL_SHAPE)
    prompts = load_prompts(args.num_prompts)
    base_args = dict(device=args.device, dtype=args.dtype, page_size=16)
    greedy = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    configs = [("none", {})] + [("NGRAM", dict(speculative_algorithm="NGRAM", speculative_num_steps=args.steps))]
    configs += [(f"STANDALONE {name}", dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=path,
                                           speculative_num_steps=args.steps)) for name, path in drafts.items()]
    tree = dict(speculative_num_steps=args.steps, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    configs += [(f"STANDALONE {name} tree(4,8)", dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=path, **tree))
                for name, path in drafts.items() if name != "small"]
    if not args.model:  # random heads: near-zero acceptance, so these rows measure what EAGLE costs
        heads = {"EAGLE3": write_random_eagle_checkpoint(os.path.join(tmp, "e3"), target, kind="eagle3", draft_vocab_size=256),
                 "EAGLE": write_random_eagle_checkpoint(os.path.join(tmp, "e1"), target, kind="eagle")}
        for algo, path in heads.items():
            configs.append((f"{algo} (random head) chain", dict(speculative_algorithm=algo, speculative_draft_model_path=path,
                                                              speculative_num_steps=args.steps, speculative_eagle_topk=1)))
            configs.append((f"{algo} (random head) tree(4,8)", dict(speculative_algorithm=algo, speculative_draft_model_path=path, **tree)))
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        base = None
        for name, spec in configs:
            r = run(target, prompts, greedy, bs, {**base_args, **spec}, args.repeats)
            base = base or r
            rows.append((bs, name, "greedy", r, r["tok_s"] / base["tok_s"]))
            print(bs, name, r, flush=True)
    sampled_rows = []
    hot = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=7)
    base = run(target, prompts, hot, 1, base_args, args.repeats)
    sampled_rows.append(("none", "-", base, 1.0))
    for name, path in drafts.items():
        for shape, shape_args in (("chain", {}), ("tree(4,8)", dict(speculative_eagle_topk=4, speculative_num_draft_tokens=8))):
            for sample in (False, True):
                spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=path, speculative_num_steps=args.steps,
                            speculative_use_rejection_sampling=sample, **shape_args)
                r = run(target, prompts, hot, 1, {**base_args, **spec}, args.repeats)
                mode = ("sampled q" if sample else "greedy (q one-hot)") if shape == "chain" else (
                    "children drawn from q" if sample else "top-k children (q one-hot)")
                sampled_rows.append((f"STANDALONE {name} {shape}", mode, r, r["tok_s"] / base["tok_s"]))
                print(name, shape, sample, r, flush=True)
    write_report(args, rows, sampled_rows)


def write_report(args, rows, sampled_rows) -> None:
    commit = git_commit()
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} torch threads"
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    lines = [
        "# Speculative vs plain decoding (offline)", "",
        f"- device: {device}", f"- date: {datetime.date.today()}", f"- commit: {commit}",
        f"- command: `{command_line()}`", f"- load average at the end: {os.getloadavg()[0]:.2f}; each row is the fastest of {args.repeats} passes",
        f"- {args.num_prompts} MT-bench first turns, {args.max_new_tokens} new tokens each, ignore_eos, dtype {args.dtype}, steps {args.steps}",
        "- tiny random models unless --model is given: the speed ratios show the mechanics and overheads, not real-model gains", "",
        "## Greedy", "", "| batch | drafter | accept length | tokens/s | vs no spec |", "|---|---|---|---|---|",
    ]
    lines += [f"| {bs} | {name} | {fmt(r['accept_len'])} | {r['tok_s']:.1f} | {ratio:.2f}x |" for bs, name, _, r, ratio in rows]
    lines += ["", f"## Temperature {args.temperature}, batch 1: greedy drafts vs sampled drafts", "",
              "| drafter | draft tokens | accept length | tokens/s | vs no spec |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {mode} | {fmt(r['accept_len'])} | {r['tok_s']:.1f} | {ratio:.2f}x |" for name, mode, r, ratio in sampled_rows]
    lines += ["", "## Per-step cost split (greedy, largest batch): seconds per verify forward", "",
              "STANDALONE feeds its catch-up inside the draft phase; EAGLE's catch-up (the draft extend after verify) is "
              "listed separately.", "", "| drafter | draft extend | draft | verify | accept + commit |", "|---|---|---|---|---|"]
    largest = max(bs for bs, *_ in rows)
    for bs, name, _, r, _ in rows:
        if bs == largest and r["phases"] and r["verifies"]:
            ph = {k: 1000 * v / r["verifies"] for k, v in r["phases"].items()}
            lines.append(f"| {name} | {ph.get('draft_extend', 0):.2f} ms | {ph.get('draft', 0) - ph.get('draft_extend', 0):.2f} ms | "
                         f"{ph.get('verify', 0):.2f} ms | {ph.get('accept_commit', 0):.2f} ms |")
    print("wrote", write_results(lines, args.out, "spec_offline", device_tag(args.device)))


if __name__ == "__main__":
    main()
