"""Coupled verification against rejection sampling, on the embedded SmolLM2-135M-Instruct and MT-bench first turns
at temperature 0.7: acceptance, accept length, tokens per second against plain decoding in the same run, and how
many seeded outputs equal plain decoding's.

Drafters: NGRAM (deterministic drafts: both rules accept a draft d with probability p(d)), and a STANDALONE draft
that is the target with Gaussian noise on its weights (a draft close to, but not equal to, the target: the case
where the two rules differ, (1 - TV) / (1 + TV) <= coupled <= 1 - TV = rejection per position).

  python -m benchmarks.e2e.coupled_vs_rejection [--questions 12] [--draft-noise 0.05]
      -> benchmarks/results/coupled_vs_rejection_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

from benchmarks.common import command_line, device_tag, git_commit, mt_bench_first_turns, write_results
from hyperdraft import LLM, SamplingParams
from hyperdraft.models.default_model import ensure_default_model
from hyperdraft.models.gguf import gguf_config_dict, load_gguf_tokenizer
from hyperdraft.models.loader import load_model


def noisy_copy(gguf_path: str, out_dir: str, noise: float, seed: int = 0) -> str:
    """The GGUF model as a Hugging Face checkpoint whose matrices carry noise * std(W) Gaussian noise."""
    model = load_model(gguf_path, "float32", torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, w in model.state_dict().items():
        if name == "lm_head.weight" or not name.startswith("model."):
            continue  # tied to the embedding; RoPE tables are not checkpoint tensors
        w = w.clone()
        if w.dim() == 2:
            w += noise * w.std() * torch.randn(w.shape, generator=gen)
        tensors[name] = w.contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(gguf_config_dict(gguf_path), f)
    load_gguf_tokenizer(gguf_path).save_pretrained(out_dir)
    return out_dir


def run(path: str, prompts: list[list[int]], params: list[SamplingParams], **engine_args) -> dict:
    llm = LLM(path, dtype="float32", **engine_args)
    start = time.perf_counter()
    outs = llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    seconds = time.perf_counter() - start
    state = llm.get_server_info()["internal_states"][0]
    llm.shutdown()
    tokens = sum(len(o.token_ids) for o in outs)
    return {"ids": [o.token_ids for o in outs], "tok_s": tokens / seconds, "state": state}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.coupled_vs_rejection", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--draft-noise", type=float, default=0.05, help="noise std as a fraction of each matrix's std")
    ap.add_argument("--out", help="report path (default: benchmarks/results/coupled_vs_rejection_cpu.md)")
    args = ap.parse_args()
    target = ensure_default_model()
    draft = noisy_copy(target, tempfile.mkdtemp(prefix="noisy-smollm2-"), args.draft_noise)
    chat = LLM(target, dtype="float32", skip_tokenizer_init=False)
    prompts = [chat.apply_chat_template([{"role": "user", "content": q}]) for q in mt_bench_first_turns()[:args.questions]]
    chat.shutdown()
    params = [SamplingParams(temperature=args.temperature, max_new_tokens=args.new_tokens, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    plain = run(target, prompts, params)
    drafters = {"NGRAM, 4 steps": dict(speculative_algorithm="NGRAM", speculative_num_steps=4),
                f"STANDALONE noisy self-copy ({args.draft_noise:g}), chain 3":
                    dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft, speculative_num_steps=3)}
    rows = []
    for name, spec in drafters.items():
        for mode in ("rejection", "coupled"):
            r = run(target, prompts, params, speculative_sampling=mode, **spec)
            s = r["state"]
            same = sum(a == b for a, b in zip(r["ids"], plain["ids"]))
            rows.append(f"| {name} | {mode} | {s['spec_accepted_tokens'] / max(1, s['spec_draft_tokens']):.3f} | "
                        f"{s['avg_spec_accept_length']:.2f} | {r['tok_s']:.1f} | {r['tok_s'] / plain['tok_s']:.2f}x | "
                        f"{same}/{len(prompts)} |")
            print(rows[-1], flush=True)
    lines = [f"# Coupled verification vs rejection sampling (SmolLM2-135M-Instruct, fp32, {device_tag('cpu').upper()}, "
             f"T = {args.temperature})", "",
             f"- date: {datetime.date.today()}; commit: {git_commit()}; command: `{command_line()}`",
             f"- {len(prompts)} MT-bench first turns through the chat template, submitted at once; {args.new_tokens} "
             f"new tokens each (ignore_eos); seed i for question i; plain decoding: {plain['tok_s']:.1f} tok/s", "",
             "| drafter | verification | acceptance (accepted / drafted) | accept length | tok/s | vs plain | "
             "outputs equal to plain decoding |", "|---|---|---|---|---|---|---|", *rows]
    write_results(lines, args.out, "coupled_vs_rejection", "cpu")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
