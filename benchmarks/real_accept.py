"""Real acceptance on a real model: MT-bench first turns on SmolLM2-135M-Instruct (the default model), plain decoding
against NGRAM and an EAGLE-3 head trained by `hyperdraft train-draft`, as chains, trees and adaptive tiers (SGLang's
default EMA ladder, and the goodput strategy over ladders that include step 0).

For each row: tok/s (and the ratio to plain decoding, measured in the same run), accept length, acceptance per
draft position, and how many outputs equal plain decoding's (greedy; token for token in fp32 on CPU, and on a GPU
in bf16 with --deterministic, the default there: --enable-deterministic-inference, docs/numerics.md).

  hyperdraft train-draft --out /tmp/smol-eagle3 --prompts sharegpt.jsonl --draft-vocab-size 8192
  python -m benchmarks.real_accept --head /tmp/smol-eagle3 --device cpu --turns 10 --batch 1
      -> benchmarks/results/real_accept_cpu.md
  python -m benchmarks.real_accept --head /tmp/smol-eagle3 --device cuda --dtype bfloat16 --turns 80 --batch 1 16
  ... --rows "chain 3" "head, adaptive"       # plain and the rows whose names contain one of these
  ... --repeats 3                              # every row three times, in turns: medians and paired ratios
  ... --switch fused_norm_gemv                 # every row also with that RuntimeOptions switch flipped
  ... --no-ignore-eos --new-tokens 1024        # SGLang's MT-bench count (benchmark/mtbench/bench_sglang_eagle.py)
  ... --per-category 2                         # the first 2 turns of each MT-bench category (CPU runs)

Two counts of MT-bench. The default runs every answer to 128 tokens, past EOS: equal work per row, and the head
drafts text the model writes after its answer ends. SGLang's benchmark stops at EOS and allows 1024 tokens: what a
user gets, but on a 135M target half the answers then run to the cap in repetition loops, which any drafter,
prompt lookup too, predicts well (real_accept_h200.md, session 35). Report which count a number comes from.

--repeats: a GPU host's speed drifts between rows of one run (an H200's host ran the same chain-5 row at 1.35 and
1.81 ms a step, real_accept_h200.md session 32), so a row against plain is best read as the median of ratios taken
in the same turn, plain first in each.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from typing import NamedTuple

from benchmarks.common import (chat_turns, code_edit_requests, command_line, device_tag, git_commit,
                               mt_bench_first_turns, mt_bench_per_category, timed_generate, write_results)
from hyperdraft import LLM, SamplingParams
from hyperdraft.options import RuntimeOptions
from hyperdraft.models.default_model import ensure_default_model


# The goodput strategy picks each slot's tier from measured step times and acceptance, so it can run step 0 (or one
# draft) wherever deeper rounds cost more than they accept; the ladders leave it those choices at every batch size.
GOODPUT_LADDER = '{"strategy": "goodput", "1": [0, 1, 2, 3, 5], "8": [0, 1, 2, 3], "32": [0, 1, 2], "64": [0, 1]}'


def rows(head: str | None) -> dict[str, dict]:
    ngram = dict(speculative_algorithm="NGRAM")
    out = {"plain": {}, "NGRAM, chain 4": dict(ngram, speculative_num_steps=4),
           "NGRAM, adaptive (goodput)": dict(ngram, speculative_adaptive=True, speculative_adaptive_config=GOODPUT_LADDER),
           # SGLang 0.5.23's NGRAM at its defaults: a trie tree of 12 tokens, up to 10 children a node
           "NGRAM, trie tree (BFS, 12 tokens)": dict(ngram, speculative_ngram_match_type="BFS"),
           "NGRAM, trie tree (PROB, 12 tokens)": dict(ngram, speculative_ngram_match_type="PROB")}
    if head:
        eagle = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head)
        out["trained head, chain 5"] = dict(eagle, speculative_num_steps=5)
        # the tier SGLang's ladder settles on at batch 1 on chat: the adaptive rows against it, fixed
        out["trained head, chain 3"] = dict(eagle, speculative_num_steps=3)
        out["trained head, tree (topk 4, 8 tokens)"] = dict(eagle, speculative_num_steps=5, speculative_eagle_topk=4,
                                                           speculative_num_draft_tokens=8)
        # chain 5's verify width with one draft step fewer: on the CPU it accepted 2.16 against the chain's 1.98
        out["trained head, tree (4 steps, topk 2, 6 tokens)"] = dict(eagle, speculative_num_steps=4,
                                                                    speculative_eagle_topk=2,
                                                                    speculative_num_draft_tokens=6)
        # Wider trees: a 135M target's batch-1 step is launch-bound, so a verify of 16 rows may cost little more than
        # one of 8 (not yet measured); these rows ask whether the extra candidates are accepted (session 41: topk 4 /
        # 8 tokens accepts 10-18% more than chain 5, too little for its 1.2-1.35x round).
        out["trained head, tree (topk 8, 16 tokens)"] = dict(eagle, speculative_num_steps=5, speculative_eagle_topk=8,
                                                            speculative_num_draft_tokens=16)
        out["trained head, tree (6 steps, topk 4, 16 tokens)"] = dict(eagle, speculative_num_steps=6,
                                                                     speculative_eagle_topk=4,
                                                                     speculative_num_draft_tokens=16)
        out["trained head, adaptive"] = dict(eagle, speculative_adaptive=True)
        out["trained head, adaptive (goodput)"] = dict(eagle, speculative_adaptive=True,
                                                       speculative_adaptive_config=GOODPUT_LADDER)
    return out


class RowRun(NamedTuple):
    """One timed run of a row (benchmarks/common.timed_generate)."""

    ids: list[list[int]]  # output tokens per prompt
    rate: float  # output tokens per second
    before: dict  # the engine's internal state before the timed run, and after it
    after: dict


def run(model: str, prompts: list[list[int]], batch: int, new_tokens: int, device: str, dtype: str, spec: dict,
        deterministic: bool = False, ignore_eos: bool = True, switches: dict | None = None) -> RowRun:
    """switches: RuntimeOptions fields set over the environment's (--switch)."""
    options = RuntimeOptions.from_env(deterministic=deterministic, **switches) if switches else None
    llm = LLM(model, device=device, dtype=dtype, max_running_requests=batch, enable_deterministic_inference=deterministic,
              runtime_options=options, **spec)
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=ignore_eos)
    return RowRun(*timed_generate(llm, prompts, params, warm_up=len(prompts) if device == "cuda" else batch))


def tier_steps(before: dict, after: dict) -> str:
    """Steps the timed run spent at each tier ("3: 300, 0: 12; 9 switches", most first), from two internal states;
    "-" without speculation. Why an adaptive row lands where it does: each switch discards the work queued ahead
    for the old tier, so the new tier's first step runs cold."""
    earlier = before.get("spec_steps_per_tier", {})
    seen = {k: d for k, n in after.get("spec_steps_per_tier", {}).items() if (d := n - earlier.get(k, 0)) > 0}
    steps = ", ".join(f"{k}: {n}" for k, n in sorted(seen.items(), key=lambda kv: -kv[1]))
    if len(seen) > 1:
        steps += f"; {after.get('spec_tier_switches', 0) - before.get('spec_tier_switches', 0)} switches"
    return steps or "-"


def row_line(name: str, row_runs: list[RowRun], plain_runs: list[RowRun]) -> str:
    """A table row from a row's turns against plain's in the same turns: median tok/s, the median of the paired
    ratios (ranges with more than one turn), acceptance and tiers from the last turn, and outputs equal to plain's
    first run counted over every turn."""
    rates = [r.rate for r in row_runs]
    ratios = [r.rate / p.rate for r, p in zip(row_runs, plain_runs)]
    ids, _, before, state = row_runs[-1]
    same = sum(a == b for r in row_runs for a, b in zip(r.ids, plain_runs[0].ids))
    spread = len(rates) > 1
    rate = f"{statistics.median(rates):.1f}" + (f" ({min(rates):.1f}-{max(rates):.1f})" if spread else "")
    ratio = f"{statistics.median(ratios):.2f}x" + (f" ({min(ratios):.2f}-{max(ratios):.2f})" if spread else "")
    accept = state.get("avg_spec_accept_length")
    by_pos = state.get("spec_acceptance_by_position") or []
    return (f"| {name} | {rate} | {ratio} | {'-' if not accept else f'{accept:.2f}'} | "
            f"{' '.join(f'{a:.2f}' for a in by_pos) or '-'} | {same}/{len(ids) * len(row_runs)} | "
            f"{tier_steps(before, state)} |")


def goodput_slots(state: dict) -> list[str]:
    """The goodput slots' final estimates, one line per slot that ran: per tier, tokens a verify (E), seconds a step
    as the slot priced it, and goodput. Why a goodput row picked its tiers (it prices tiers from its own timings)."""
    lines = []
    for key, slot in state.get("speculative_adaptive_slots", {}).items():
        if slot.get("strategy") == "goodput" and slot.get("counted"):
            per_tier = ", ".join(f"{t}: E {e:.2f}, {slot['cost_ms'][t]:.3f} ms, goodput {slot['goodput'][t]:.0f}"
                                 for t, e in slot["expected_tokens"].items())
            lines.append(f"  - slot {key} (at tier {slot['tier']} after {slot['counted']} steps): {per_tier}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.real_accept", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", help="EAGLE-3 head directory written by hyperdraft train-draft")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--turns", type=int, default=80, help="prompts (MT-bench first turns, or code edits)")
    ap.add_argument("--per-category", type=int, default=None,
                    help="chat: instead of the first --turns, the first this many turns of each of MT-bench's eight "
                         "categories")
    ap.add_argument("--task", choices=["chat", "code-edit"], default="chat",
                    help="code-edit: requests to edit a function of hyperdraft's own source, quoted in full (answers "
                         "copy their prompt: prompt lookup's workload; the source changes, so compare within a run)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="max running requests (each a row set)")
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                    help="batch-invariant kernels, so bf16 speculative outputs equal plain ones bitwise (default: on "
                         "for CUDA)")
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="every answer runs to --new-tokens (the default: equal work per row); --no-ignore-eos stops "
                         "at the end of the answer, so no row drafts the text a model writes past its end")
    ap.add_argument("--rows", nargs="+", default=None,
                    help="run only the rows whose names contain one of these (plain, the baseline, always runs)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every row this many times, in turns (plain first in each): the table gives the median "
                         "tok/s and the median of each turn's ratio to plain, with their ranges")
    ap.add_argument("--switch", help="a RuntimeOptions switch (e.g. fused_norm_gemv): every row, plain too, also runs "
                                     "with it flipped from its default, as a row of its own named 'ROW [switch]' "
                                     "(against plain with the default)")
    ap.add_argument("--out", help="results file, or a directory for real_accept_<device>.md (default: appended to "
                                  "benchmarks/results/real_accept_<device>.md)")
    args = ap.parse_args()
    if args.per_category is not None and args.per_category < 1:
        ap.error(f"--per-category must be >= 1, got {args.per_category}")
    deterministic = args.deterministic if args.deterministic is not None else args.device.startswith("cuda")
    model = ensure_default_model()
    chat = LLM(model, device="cpu", dtype="float32")
    if args.task == "code-edit":
        questions = code_edit_requests(args.turns)
    elif args.per_category is not None:
        questions = mt_bench_per_category(args.per_category)
    else:
        questions = mt_bench_first_turns()[:args.turns]
    prompts = chat_turns(chat, questions)
    chat.shutdown()
    tag = device_tag(args.device)
    what = ("code-edit requests (benchmarks/common.code_edit_requests)" if args.task == "code-edit" else
            f"MT-bench first turns ({args.per_category} a category)" if args.per_category is not None else
            "MT-bench first turns")
    lines = [f"# Real acceptance: SmolLM2-135M-Instruct, {len(prompts)} {what} ({tag.upper()}, {args.dtype})",
             "", f"- date: {datetime.date.today()}; commit: {git_commit()}; command: `{command_line()}`",
             f"- greedy, {args.new_tokens} new tokens{' (ignore_eos)' if args.ignore_eos else ', or fewer at EOS'}; head: `{os.path.basename(str(args.head))}`; "
             f"deterministic mode: {'on' if deterministic else 'off'}", ""]
    for batch in args.batch:
        lines += [f"## batch {batch}", "", "| row | tok/s | vs plain | accept length | acceptance by position | "
                  "outputs equal to plain | steps per tier |", "|---|---|---|---|---|---|---|"]
        chosen = {name: spec for name, spec in rows(args.head).items()
                  if name == "plain" or args.rows is None or any(r in name for r in args.rows)}
        flipped = {args.switch: not RuntimeOptions.__dataclass_fields__[args.switch].default} if args.switch else {}
        variants = [(name, spec, None) for name, spec in chosen.items()]
        variants += [(f"{name} [{args.switch}]", spec, flipped) for name, spec in chosen.items() if flipped]
        runs: dict[str, list[RowRun]] = {name: [] for name, _, _ in variants}
        for turn in range(args.repeats):
            for name, spec, switches in variants:
                runs[name].append(run(model, prompts, batch, args.new_tokens, args.device, args.dtype, spec,
                                      deterministic, args.ignore_eos, switches))
                print(f"turn {turn + 1}: {name}: {runs[name][-1].rate:.1f} tok/s", flush=True)
        slot_lines = []
        for name, row_runs in runs.items():
            lines.append(row_line(name, row_runs, runs["plain"]))
            slots = goodput_slots(row_runs[-1].after)
            if slots:
                slot_lines += [f"- {name}, the goodput slots at the end:"] + slots
        lines += [""] + slot_lines + ([""] if slot_lines else [])
    out = write_results(lines, args.out, "real_accept", tag)
    print("\n".join(lines))
    print(json.dumps({"written": out}))


if __name__ == "__main__":
    main()
