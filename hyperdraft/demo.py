"""`hyperdraft demo`: chat prompts on a real model, with speculation and without, and the speed-up.

Greedy decoding, one prompt at a time (the latency case speculation is for). The speculative run streams its
answers; the plain run repeats the same prompts, and the two must produce identical token ids (lossless). It drafts
with NGRAM (prompt lookup, nothing to train), or with an EAGLE-3 head from `hyperdraft train-draft` (`--draft-head`):
a chain of --speculative-num-steps drafts a round.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

# MT-bench first turns whose answers copy from the question (a paragraph to correct, code to review, text to
# extract from): prompt lookup (NGRAM) shines there. Read from ../shared/data next to the repository if present.
MT_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench_questions.jsonl"
MT_BENCH_IDS = (90, 124, 135, 122)
BUILTIN_PROMPTS = (
    "Correct the grammar of this paragraph and write out the corrected paragraph:\nMe and him goes to the market "
    "every sundays, and we buys apples, oranges and bread. The apples was fresh but the bread were old, so we "
    "returns it to the baker, who say sorry to we.",
    "Explain what this Python function does, then write it again with comments:\n```\ndef count_words(text):\n"
    "    counts = {}\n    for word in text.split():\n        counts[word] = counts.get(word, 0) + 1\n"
    "    return counts\n```",
    "List the countries and their capitals mentioned in these sentences, one per line as 'country: capital':\n"
    "Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of Spain. "
    "Rome is the capital of Italy.",
    "Write a Python function that returns the n-th Fibonacci number, and show how to call it.",
)


def demo_prompts(n: int) -> list[str]:
    if MT_BENCH.is_file():
        first_turns = {}
        for line in MT_BENCH.read_text().splitlines():
            if line.strip():
                q = json.loads(line)
                first_turns[q["question_id"]] = q["turns"][0]
        prompts = [first_turns[i] for i in MT_BENCH_IDS if i in first_turns]
        if len(prompts) >= n:
            return prompts[:n]
    return list(BUILTIN_PROMPTS[:n])


def _run(model: str, prompts: list[str], params, spec: dict, device: str, show: bool) -> dict:
    """Load the model with the given speculative settings, chat each prompt in turn, return ids, times and stats."""
    from hyperdraft.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(model, device=device, **spec)
    label = f"{_drafter(spec)} speculation ({spec['speculative_num_steps']} draft tokens)" if spec else "no speculation"
    print(f"==> {label}: model loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    try:
        chat = bool(llm.tokenizer.chat_template)  # a base model without one gets the raw prompts
        ids = [llm.apply_chat_template([{"role": "user", "content": p}]) if chat else llm.engine.tokenize(p)
               for p in prompts]
        warm_up = dataclasses.replace(params, max_new_tokens=1)
        llm.generate(input_ids=ids[:1], sampling_params=warm_up, use_tqdm=False)
        token_ids, seconds = [], 0.0
        for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
            if show:
                print(f"\n### Prompt {i + 1}/{len(prompts)}\n{prompt}\n\n### Answer", flush=True)
            t = time.perf_counter()
            for delta in llm.stream(input_ids=[prompt_ids], sampling_params=params):
                if show:
                    print(delta.text, end="", flush=True)
                if delta.finished:
                    token_ids.append(delta.output.token_ids)
                    info = delta.output.meta_info
            seconds += (dt := time.perf_counter() - t)
            n = len(token_ids[-1])
            accept = f", accept length {info['spec_accept_length']:.2f}" if "spec_accept_length" in info else ""
            line = f"[{label}, prompt {i + 1}: {n} tokens in {dt:.1f} s, {n / dt:.1f} tokens/s{accept}]"
            print(("\n" if show else "") + line, file=sys.stdout if show else sys.stderr, flush=True)
        state = llm.get_server_info()["internal_states"][0]
    finally:
        llm.shutdown()
    tokens = sum(map(len, token_ids))
    return dict(label=label, token_ids=token_ids, tokens=tokens, seconds=seconds, tps=tokens / seconds,
                accept=state.get("avg_spec_accept_length"))


def _drafter(spec: dict) -> str:
    return "EAGLE-3 head" if spec["speculative_algorithm"] == "EAGLE3" else spec["speculative_algorithm"]


def speculation(num_steps: int, draft_head: str | None) -> dict:
    """The speculative run's engine arguments: NGRAM, or a chain from an EAGLE-3 head directory."""
    if draft_head is None:
        return dict(speculative_algorithm="NGRAM", speculative_num_steps=num_steps)
    return dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=draft_head, speculative_num_steps=num_steps,
                speculative_eagle_topk=1, speculative_num_draft_tokens=num_steps + 1)


def run_demo(model: str, max_new_tokens: int = 128, num_prompts: int = 3, num_steps: int = 3,
             compare: bool = True, device: str = "auto", draft_head: str | None = None) -> int:
    import torch

    from hyperdraft.sampling_params import SamplingParams

    torch.set_num_threads(os.cpu_count() or 1)
    prompts = demo_prompts(num_prompts)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    spec_args = speculation(num_steps, draft_head)
    print(f"==> hyperdraft demo: {len(prompts)} chat prompts, greedy, up to {max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, model {model}", file=sys.stderr, flush=True)
    runs = [_run(model, prompts, params, spec_args, device, show=True)]
    if compare:
        runs.append(_run(model, prompts, params, {}, device, show=False))

    print(f"\n{'run':<40} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'accept len':>11}")
    for r in runs:
        accept = f"{r['accept']:.2f}" if r["accept"] else "-"
        print(f"{r['label']:<40} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tps']:>9.1f} {accept:>11}")
    print("(seconds include prefill; accept len = tokens emitted per target-model forward)")
    if not compare:
        return 0
    spec, plain = runs
    same = [a == b for a, b in zip(spec["token_ids"], plain["token_ids"])]
    print(f"speed-up: {spec['tps'] / plain['tps']:.2f}x (tokens/s, {_drafter(spec_args)} vs no speculation)")
    if all(same):
        print(f"lossless: identical token ids with and without speculation ({len(same)}/{len(same)} prompts)")
        return 0
    print(f"NOT lossless: token ids differ for prompt(s) {[i + 1 for i, s in enumerate(same) if not s]}")
    return 1
