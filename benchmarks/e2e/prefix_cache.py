"""Prefix caching on vs off (--disable-radix-cache) on the embedded SmolLM2-135M-Instruct, three workloads:

  multi-turn   MT-bench conversations, one at a time: turn 1 is a long reference text (other MT-bench questions, to
               about --history tokens) plus the question; turn 2 carries turn 1 and its answer (the chat template
               over [user, assistant, user]). Measured: turn 2's TTFT.
  shared       --shared-requests requests submitted together, each a --history-token system prompt plus its own
               MT-bench question. Measured: mean TTFT and output tokens/s of the burst.
  no-reuse     --plain-requests distinct MT-bench questions as raw text (no chat template, so no shared template
               prefix), submitted together. Measured: output tokens/s: what the cache costs when it never hits.

Greedy, fp32 (--dtype); every run checks that the cache-on tokens equal the cache-off tokens. Both engines are loaded side by
side and each workload runs off, then on (multi-turn: conversation by conversation), so load from anything else on
the machine hits both alike.

  python -m benchmarks.e2e.prefix_cache      # CPU -> benchmarks/results/prefix_cache_cpu.md
  python -m benchmarks.e2e.prefix_cache --device cuda --conversations 20 --shared-requests 64 --out $OUT/x.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

from benchmarks.common import MT_BENCH, command_line, cpu_name, device_tag, git_commit, write_results
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


def multi_turn(llms: dict[str, LLM], qs: list[list[str]], args) -> dict[str, dict]:
    """Conversation by conversation, cache off then on, so that anything else the machine does hits both alike."""
    rows = {name: {"ttft": [], "cached": [], "prompt": [], "outs": []} for name in llms}
    for k in range(args.conversations):
        for name, llm in llms.items():
            turn1 = [{"role": "user", "content": reference_text(llm, qs, k, args.history) + "\n\n" + qs[k][0]}]
            first = llm.chat(turn1, greedy(args.new_tokens), use_tqdm=False)
            turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": qs[k][1]}]
            ids = llm.apply_chat_template(turn2)
            second = llm.generate(input_ids=[ids], sampling_params=greedy(args.new_tokens), use_tqdm=False)[0]
            row = rows[name]
            row["ttft"].append(second.meta_info["ttft"])
            row["cached"].append(second.meta_info["cached_tokens"])
            row["prompt"].append(len(ids))
            row["outs"].append(first.token_ids + second.token_ids)
            print(f"multi-turn {k} {name}: turn-2 TTFT {row['ttft'][-1]:.3f} s, {row['cached'][-1]} cached of "
                  f"{len(ids)}", file=sys.stderr, flush=True)
    return {name: {"ttft": statistics.median(r["ttft"]), "cached": statistics.mean(r["cached"]),
                   "prompt": statistics.mean(r["prompt"]), "outs": r["outs"], "ttfts": r["ttft"]}
            for name, r in rows.items()}


def burst(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    start = time.perf_counter()
    outs = llm.generate(input_ids=prompts, sampling_params=greedy(new_tokens), use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"ttft": statistics.mean(o.meta_info["ttft"] for o in outs), "seconds": seconds,
            "tok_s": sum(len(o.token_ids) for o in outs) / seconds,
            "cached": statistics.mean(o.meta_info["cached_tokens"] for o in outs),
            "prompt": statistics.mean(len(p) for p in prompts), "outs": [o.token_ids for o in outs]}


def warm_up(llm: LLM, qs: list[list[str]]) -> None:
    """Prompts that extend one another (cache hits with the cache on), of several lengths: Triton compiles a kernel
    for each new specialisation of its integer arguments on first use, and on a GPU a compile inside a measured turn
    costs a second."""
    text = reference_text(llm, qs, 60, 300)
    for q in qs[:6]:
        text += "\n" + q[0]
        llm.generate(text, greedy(4), use_tqdm=False)
    llm.flush_cache()


def run(path: str, qs: list[list[str]], args) -> dict[str, dict]:
    """Both engines side by side; each workload runs cache off, then on."""
    # Two engines on one GPU: each gets a fixed K/V pool (the first would take mem_fraction_static of the memory).
    capacity = dict(max_total_tokens=args.max_total_tokens) if args.device != "cpu" else {}
    llms = {name: LLM(path, device=args.device, dtype=args.dtype, disable_radix_cache=name == "off", **capacity)
            for name in ("off", "on")}
    for llm in llms.values():
        warm_up(llm, qs)
    results = {name: {} for name in llms}
    for name, row in multi_turn(llms, qs, args).items():
        results[name]["multi-turn"] = row
    tok = llms["on"]
    system = reference_text(tok, qs, 40, args.history)
    shared = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q[0]}])
              for q in qs[: args.shared_requests]]
    plain = [tok.tokenizer.encode(q[0]) for q in qs[-args.plain_requests:]]
    for workload, prompts in (("shared", shared), ("no-reuse", plain)):
        for name, llm in llms.items():
            llm.flush_cache()
            results[name][workload] = burst(llm, prompts, args.new_tokens)
            print(f"{workload} {name}: {results[name][workload]['seconds']:.1f} s", file=sys.stderr, flush=True)
    for name, llm in llms.items():
        results[name]["state"] = llm.get_server_info()["internal_states"][0]
    return results


def report(on: dict, off: dict, args) -> list[str]:
    same = all(on[w]["outs"] == off[w]["outs"] for w in ("multi-turn", "shared", "no-reuse"))
    mt, sh, nr = (on[w] for w in ("multi-turn", "shared", "no-reuse"))
    mt0, sh0, nr0 = (off[w] for w in ("multi-turn", "shared", "no-reuse"))
    return [
        f"# Prefix caching on vs off (SmolLM2-135M-Instruct, {args.dtype}, {device_name(args)})", "",
        f"- device: {device_name(args)}; date: {datetime.date.today()}; commit: {git_commit()}",
        f"- command: `{command_line()}`",
        f"- greedy, {args.new_tokens} new tokens per turn/request; cache-on tokens identical to cache-off: **{same}**", "",
        "| workload | requests | prompt tokens (mean) | cached tokens (mean, on) | metric | off | on | off / on |",
        "|---|---|---|---|---|---|---|---|",
        f"| multi-turn, turn 2 | {args.conversations} one at a time | {mt['prompt']:.0f} | {mt['cached']:.0f} | "
        f"median TTFT (s) | {mt0['ttft']:.3f} | {mt['ttft']:.3f} | **{mt0['ttft'] / mt['ttft']:.1f}x** |",
        f"| shared system prompt | {args.shared_requests} together | {sh['prompt']:.0f} | {sh['cached']:.0f} | "
        f"mean TTFT (s) | {sh0['ttft']:.2f} | {sh['ttft']:.2f} | {sh0['ttft'] / sh['ttft']:.1f}x |",
        f"| | | | | output tok/s | {sh0['tok_s']:.1f} | {sh['tok_s']:.1f} | on/off {sh['tok_s'] / sh0['tok_s']:.2f}x |",
        f"| no reuse (raw questions) | {args.plain_requests} together | {nr['prompt']:.0f} | {nr['cached']:.1f} | "
        f"output tok/s | {nr0['tok_s']:.1f} | {nr['tok_s']:.1f} | on/off {nr['tok_s'] / nr0['tok_s']:.2f}x |",
        "",
        f"Cache counters of the cache-on engine over all three workloads (flushes do not reset them): hit rate "
        f"{on['state']['cache_hit_rate']:.2f}, evicted tokens {on['state']['cache_evicted_tokens']}. TTFT runs from "
        "a request's arrival to its first token; a burst's requests share prefill steps, so its TTFT includes "
        "waiting for the others. Both engines are loaded side by side and every workload runs cache off, then on "
        "(conversation by conversation for multi-turn).", "",
        "Turn-2 TTFT per conversation (s), off / on: "
        + ", ".join(f"{a:.2f} / {b:.3f}" for a, b in zip(off["multi-turn"]["ttfts"], on["multi-turn"]["ttfts"])) + ".",
    ]


def device_name(args) -> str:
    if args.device == "cpu":
        return f"{cpu_name()}, {args.threads} torch threads"
    import torch

    return torch.cuda.get_device_name()


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
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-total-tokens", type=int, default=200_000, help="each engine's K/V pool on a GPU")
    ap.add_argument("--out", help="report path (default: benchmarks/results/prefix_cache_<device>.md)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    path, qs = ensure_default_model(), questions()
    results = run(path, qs, args)
    lines = report(results["on"], results["off"], args)
    write_results(lines, args.out, "prefix_cache", device_tag(args.device))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
