"""Tokens/s against batch size, 1 to 256, on the default model (SmolLM2-135M-Instruct, bf16, GPU): plain decoding
with the graph bound derived from free memory (up to 256) against the old fixed bound of 64, and NGRAM, a STANDALONE
self-draft and (with --head) a trained EAGLE-3 head under adaptive tiers (`--rows NAME ...` runs a subset). A batch
of B is B MT-bench first turns (repeated past 80) submitted at once, greedy, --new-tokens each, on one engine per row
(room for 256 requests), all engines alive at once and timed in turns; tok/s = output tokens / wall time of the
generate call, the median of three, after an unmeasured run of the same batch.

  python -m benchmarks.e2e.batch_curve --out $OUT       # GPU -> $OUT/batch_curve_<device>.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from dataclasses import dataclass

from benchmarks.common import command_line, device_tag, git_commit, mt_bench_first_turns, require_cuda
from benchmarks.real_accept import GOODPUT_LADDER
from hyperdraft import LLM, SamplingParams
from hyperdraft.engine.gc_policy import adopt_serving_policy
from hyperdraft.models.default_model import ensure_default_model
from hyperdraft.options import RuntimeOptions

BATCHES = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256)
SELF = "<the model>"  # a row's draft path that stands for the model itself
HEAD = "<the head>"  # ... for --head, an EAGLE-3 head for the model (rows with it run only when it is given)
REPEATS = 3  # timed runs per batch size; the median is reported (a batch-1 run is a few tenths of a second)
ROWS = {  # name -> engine arguments over the common ones
    "plain, graphs to 64 (the old default)": dict(cuda_graph_max_bs=64),
    "plain, graphs as memory allows": {},
    "NGRAM, adaptive": dict(speculative_algorithm="NGRAM", speculative_adaptive=True),
    # SGLang's default ladder keeps at least one draft below batch 8; the goodput strategy may run step 0 there too
    "NGRAM, adaptive (goodput)": dict(speculative_algorithm="NGRAM", speculative_adaptive=True,
                                      speculative_adaptive_config=GOODPUT_LADDER),
    # A model drafter under adaptive tiers (no smaller SmolLM2 exists: the model drafts for itself, so every draft is
    # accepted and the curve shows what the tiers cost, not what a draft gains).
    "STANDALONE self-draft, adaptive": dict(speculative_algorithm="STANDALONE", speculative_adaptive=True,
                                            speculative_draft_model_path=SELF),
    "EAGLE-3 trained head, adaptive": dict(speculative_algorithm="EAGLE3", speculative_adaptive=True,
                                           speculative_draft_model_path=HEAD),
    # the same with the head's step-0 steps as rounds (speculative/proposers/slot_hidden.py parks it by default)
    "EAGLE-3 trained head, adaptive, step 0 as rounds": dict(speculative_algorithm="EAGLE3", speculative_adaptive=True,
                                                             speculative_draft_model_path=HEAD,
                                                             runtime=dict(park_head=False)),
}


@dataclass(frozen=True)
class Point:
    tok_s: float  # median of the timed runs
    accept_length: float | None  # speculative rows, the last timed run: output tokens per verify round
    drafted: float | None  # draft tokens per round (the adaptive tier's depth, averaged over the run)


def speculation(outs) -> tuple[float | None, float | None]:
    """-> (accept length, draft tokens per round) over a generate call's outputs; (None, None) without speculation."""
    rounds = sum(o.meta_info.get("spec_verify_ct", 0) for o in outs)
    if not rounds:
        return None, None
    drafted = sum(o.meta_info["spec_draft_tokens"] for o in outs if "spec_draft_tokens" in o.meta_info)
    return sum(len(o.token_ids) for o in outs) / rounds, drafted / rounds


def curves(model: str, prompts: list[list[int]], new_tokens: int, engines: dict[str, dict],
           batches=BATCHES, serving_gc: bool = False) -> dict[str, list[Point]]:
    """One engine per row, all alive at once (room for 256 requests each), measured in turns: at each batch size B
    every engine runs once unmeasured (Triton compiles, NGRAM matches and adaptive tiers met for the first time; a
    shorter warm-up left batch 1 at 170 tok/s against 1147 later), then REPEATS timed runs of each engine in turn, so
    a slow minute of the host lands on every row alike (rows run one after another drifted by 30-60% between runs:
    batch_curve_h100.md). engines[name]["runtime"]: RuntimeOptions fields over the environment's. serving_gc: once
    the engines are built, this process takes the server's GC settings (engine/gc_policy.py)."""
    llms = {}
    for name, engine in engines.items():
        engine = dict(engine)
        options = RuntimeOptions.from_env(**engine.pop("runtime", {}))
        llms[name] = LLM(model, max_running_requests=max(BATCHES), runtime_options=options, **engine)
    if serving_gc:
        adopt_serving_policy()
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    points: dict[str, list[Point]] = {name: [] for name in llms}
    for batch in batches:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        runs: dict[str, list[float]] = {name: [] for name in llms}
        last = {}
        for llm in llms.values():
            llm.generate(input_ids=batch_prompts, sampling_params=params, use_tqdm=False)
        for _ in range(REPEATS):
            for name, llm in llms.items():
                llm.flush_cache()  # each run computes its prompts, and NGRAM cannot draft the previous run's answers
                start = time.perf_counter()
                last[name] = llm.generate(input_ids=batch_prompts, sampling_params=params, use_tqdm=False)
                runs[name].append(sum(len(o.token_ids) for o in last[name]) / (time.perf_counter() - start))
        for name in llms:
            points[name].append(Point(statistics.median(runs[name]), *speculation(last[name])))
            print(batch, name, points[name][-1], flush=True)
    for llm in llms.values():
        llm.shutdown()
    return points


def table(points: dict[str, list[Point]]) -> list[str]:
    """The rows' markdown lines: tok/s, and for a drafter its accept length and drafts per round (why it bends)."""
    lines = []
    for name, row in points.items():
        lines.append(f"| {name} | " + " | ".join(f"{p.tok_s:.0f}" for p in row) + " |")
        if row and row[0].accept_length is not None:
            lines.append(f"| {name}: accept length | " + " | ".join(f"{p.accept_length:.2f}" for p in row) + " |")
            lines.append(f"| {name}: drafted per round | " + " | ".join(f"{p.drafted:.2f}" for p in row) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.batch_curve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rows", nargs="*", default=None, help="run only the rows whose names contain one of these")
    ap.add_argument("--batches", type=int, nargs="*", default=list(BATCHES), help="batch sizes (default 1 to 256)")
    ap.add_argument("--head", help="EAGLE-3 head for the model (hyperdraft train-draft); its row runs only with it")
    ap.add_argument("--serving-gc", action="store_true",
                    help="the server's GC settings once the engines are built (frozen startup heap, young threshold)")
    args = ap.parse_args()
    require_cuda()
    model = ensure_default_model()
    chat = LLM(model, device="cpu", dtype="float32", max_total_tokens=256)
    prompts = [chat.apply_chat_template([{"role": "user", "content": q}]) for q in mt_bench_first_turns()]
    chat.shutdown()
    common = dict(device="cuda", dtype="bfloat16", max_total_tokens=256 * (args.new_tokens + 512))
    tag = device_tag("cuda")
    lines = [f"# Tokens/s against batch size (SmolLM2-135M-Instruct, bf16, {tag.upper()})", "",
             f"- date: {datetime.date.today()}; commit: {git_commit()}; command: `{command_line()}`",
             f"- B MT-bench first turns at once (chat template), greedy, {args.new_tokens} new tokens each; "
             "tok/s = output tokens / wall time of the generate call, median of 3 after an unmeasured run; the rows' "
             "engines timed in turns", "",
             "| row | " + " | ".join(f"B={b}" for b in args.batches) + " |", "|---|" + "---|" * len(args.batches)]
    engines = {}
    for name, extra in ROWS.items():
        if args.rows is not None and not any(r in name for r in args.rows):
            continue
        if HEAD in extra.values() and not args.head:
            continue
        extra = {k: {SELF: model, HEAD: args.head}.get(v, v) if isinstance(v, str) else v for k, v in extra.items()}
        engines[name] = {**common, **extra}
    lines += table(curves(model, prompts, args.new_tokens, engines, args.batches, args.serving_gc))
    print("\n".join(lines), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"batch_curve_{tag}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
