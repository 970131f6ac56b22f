"""Prefix caching on vs off (--disable-radix-cache) on the embedded SmolLM2-135M-Instruct, three workloads:

  multi-turn   MT-bench conversations, one at a time: turn 1 is a long reference text (other MT-bench questions, to
               about --history tokens) plus the question; turn 2 carries turn 1 and its answer (the chat template
               over [user, assistant, user]). Measured: turn 2's TTFT.
  shared       --shared-requests requests submitted together, each a --history-token system prompt plus its own
               MT-bench question. Measured: mean TTFT and output tokens/s of the burst.
  no-reuse     --plain-requests distinct MT-bench questions as raw text (no chat template, so no shared template
               prefix), submitted together. Measured: output tokens/s: what the cache costs when it never hits.

Greedy, fp32; every run checks that the cache-on tokens equal the cache-off tokens.

  python -m benchmarks.e2e.prefix_cache      # CPU -> benchmarks/results/prefix_cache_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

from benchmarks.common import MT_BENCH, command_line, cpu_name, device_tag, git_commit, results_path
from hyperdraft import LLM, SamplingParams
from hyperdraft.models.default_model import ensure_default_model


def questions() -> list[list[str]]:
    with open(MT_BENCH) as f:
        return [json.loads(line)["turns"] for line in f]


def reference_text(llm: LLM, qs: list[list[str]], skip: int, tokens: int) -> str:
    """Other MT-bench questions, joined until the text is about `tokens` tokens long."""
    parts, n, i = [], 0, skip + 1
    while n < tokens:
        q = qs[i % len(qs)][0]
        parts.append(q)
        n += len(llm.tokenizer.encode(q)) + 1
        i += 1
    return "Reference material:\n" + "\n".join(parts)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)


def multi_turn(llm: LLM, qs: list[list[str]], args) -> dict:
    ttft, cached, history, outs = [], [], [], []
    for k in range(args.conversations):
        turn1 = [{"role": "user", "content": reference_text(llm, qs, k, args.history) + "\n\n" + qs[k][0]}]
        first = llm.chat(turn1, greedy(args.new_tokens), use_tqdm=False)
        turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": qs[k][1]}]
        ids = llm.apply_chat_template(turn2)
        second = llm.generate(input_ids=[ids], sampling_params=greedy(args.new_tokens), use_tqdm=False)[0]
        ttft.append(second.meta_info["ttft"])
        cached.append(second.meta_info["cached_tokens"])
        history.append(len(ids))
        outs.append(first.token_ids + second.token_ids)
    return {"ttft": statistics.mean(ttft), "cached": statistics.mean(cached), "prompt": statistics.mean(history),
            "outs": outs}


def burst(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    start = time.perf_counter()
    outs = llm.generate(input_ids=prompts, sampling_params=greedy(new_tokens), use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"ttft": statistics.mean(o.meta_info["ttft"] for o in outs), "seconds": seconds,
            "tok_s": sum(len(o.token_ids) for o in outs) / seconds,
            "cached": statistics.mean(o.meta_info["cached_tokens"] for o in outs),
            "prompt": statistics.mean(len(p) for p in prompts), "outs": [o.token_ids for o in outs]}


def run(path: str, disabled: bool, qs: list[list[str]], args) -> dict:
    llm = LLM(path, device=args.device, dtype="float32", disable_radix_cache=disabled)
    llm.generate("warm-up", greedy(4), use_tqdm=False)
    llm.flush_cache()
    results = {"multi-turn": multi_turn(llm, qs, args)}
    llm.flush_cache()
    system = reference_text(llm, qs, 40, args.history)
    shared = [llm.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q[0]}])
              for q in qs[: args.shared_requests]]
    results["shared"] = burst(llm, shared, args.new_tokens)
    llm.flush_cache()
    plain = [llm.tokenizer.encode(q[0]) for q in qs[-args.plain_requests:]]
    results["no-reuse"] = burst(llm, plain, args.new_tokens)
    results["state"] = llm.get_server_info()["internal_states"][0]
    return results


def report(on: dict, off: dict, args) -> list[str]:
    same = all(on[w]["outs"] == off[w]["outs"] for w in ("multi-turn", "shared", "no-reuse"))
    mt, sh, nr = (on[w] for w in ("multi-turn", "shared", "no-reuse"))
    mt0, sh0, nr0 = (off[w] for w in ("multi-turn", "shared", "no-reuse"))
    return [
        "# Prefix caching on vs off (SmolLM2-135M-Instruct, fp32, CPU)", "",
        f"- device: {cpu_name()}, {args.threads} torch threads; date: {datetime.date.today()}; commit: {git_commit()}",
        f"- command: `{command_line()}`",
        f"- greedy, {args.new_tokens} new tokens per turn/request; cache-on tokens identical to cache-off: **{same}**", "",
        "| workload | requests | prompt tokens (mean) | cached tokens (mean, on) | metric | off | on | off / on |",
        "|---|---|---|---|---|---|---|---|",
        f"| multi-turn, turn 2 | {args.conversations} one at a time | {mt['prompt']:.0f} | {mt['cached']:.0f} | "
        f"TTFT (s) | {mt0['ttft']:.3f} | {mt['ttft']:.3f} | **{mt0['ttft'] / mt['ttft']:.1f}x** |",
        f"| shared system prompt | {args.shared_requests} together | {sh['prompt']:.0f} | {sh['cached']:.0f} | "
        f"mean TTFT (s) | {sh0['ttft']:.2f} | {sh['ttft']:.2f} | {sh0['ttft'] / sh['ttft']:.1f}x |",
        f"| | | | | output tok/s | {sh0['tok_s']:.1f} | {sh['tok_s']:.1f} | on/off {sh['tok_s'] / sh0['tok_s']:.2f}x |",
        f"| no reuse (raw questions) | {args.plain_requests} together | {nr['prompt']:.0f} | {nr['cached']:.1f} | "
        f"output tok/s | {nr0['tok_s']:.1f} | {nr['tok_s']:.1f} | on/off {nr['tok_s'] / nr0['tok_s']:.2f}x |",
        "",
        f"Cache counters of the cache-on engine over all three workloads (flushes do not reset them): hit rate "
        f"{on['state']['cache_hit_rate']:.2f}, evicted tokens {on['state']['cache_evicted_tokens']}. TTFT runs from "
        "a request's arrival to its first token; a burst's requests share prefill steps, so its TTFT includes "
        "waiting for the others.",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.prefix_cache", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--history", type=int, default=2000, help="tokens of reference text / system prompt")
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--shared-requests", type=int, default=16)
    ap.add_argument("--plain-requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="report path (default: benchmarks/results/prefix_cache_<device>.md)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    path, qs = ensure_default_model(), questions()
    off = run(path, True, qs, args)
    on = run(path, False, qs, args)
    lines = report(on, off, args)
    out = args.out or results_path("prefix_cache", device_tag(args.device))
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
