"""Tokens/s against batch size, 1 to 256, on the default model (SmolLM2-135M-Instruct, bf16, GPU): plain decoding
with the graph bound derived from free memory (up to 256) against the old fixed bound of 64, and NGRAM, a STANDALONE
self-draft and (with --head) a trained EAGLE-3 head under adaptive tiers (`--rows NAME ...` runs a subset). A batch
of B is B MT-bench first turns (repeated past 80) submitted at once, greedy, --new-tokens each, on one engine per row
(room for 256 requests); tok/s = output tokens / wall time of the generate call, the median of three, after an
unmeasured run of the same batch.

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
from hyperdraft import LLM, SamplingParams
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


def curve(model: str, prompts: list[list[int]], new_tokens: int, engine: dict, batches=BATCHES) -> list[Point]:
    """One engine (room for 256 requests); each batch size B runs once unmeasured (Triton compiles, NGRAM matches and
    adaptive tiers met for the first time; a shorter warm-up left batch 1 at 170 tok/s against 1147 later), then
    timed. engine["runtime"]: RuntimeOptions fields over the environment's."""
    engine = dict(engine)
    options = RuntimeOptions.from_env(**engine.pop("runtime", {}))
    llm = LLM(model, max_running_requests=max(BATCHES), runtime_options=options, **engine)
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    points = []
    for batch in batches:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        llm.generate(input_ids=batch_prompts, sampling_params=params, use_tqdm=False)
        runs = []
        for _ in range(REPEATS):
            llm.flush_cache()  # each run computes its prompts, and NGRAM cannot draft the previous run's answers
            start = time.perf_counter()
            outs = llm.generate(input_ids=batch_prompts, sampling_params=params, use_tqdm=False)
            runs.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
        points.append(Point(statistics.median(runs), *speculation(outs)))
        print(batch, points[-1], flush=True)
    llm.shutdown()
    return points


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.batch_curve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rows", nargs="*", default=None, help="run only the rows whose names contain one of these")
    ap.add_argument("--batches", type=int, nargs="*", default=list(BATCHES), help="batch sizes (default 1 to 256)")
    ap.add_argument("--head", help="EAGLE-3 head for the model (hyperdraft train-draft); its row runs only with it")
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
             "tok/s = output tokens / wall time of the generate call, median of 3 after an unmeasured run", "",
             "| row | " + " | ".join(f"B={b}" for b in args.batches) + " |", "|---|" + "---|" * len(args.batches)]
    for name, extra in ROWS.items():
        if args.rows is not None and not any(r in name for r in args.rows):
            continue
        if HEAD in extra.values() and not args.head:
            continue
        extra = {k: {SELF: model, HEAD: args.head}.get(v, v) if isinstance(v, str) else v for k, v in extra.items()}
        points = curve(model, prompts, args.new_tokens, {**common, **extra}, args.batches)
        lines.append(f"| {name} | " + " | ".join(f"{p.tok_s:.0f}" for p in points) + " |")
        if points[0].accept_length is not None:  # why a drafter's curve bends: the tier it ran and what it accepted
            lines.append(f"| {name}: accept length | " + " | ".join(f"{p.accept_length:.2f}" for p in points) + " |")
            lines.append(f"| {name}: drafted per round | " + " | ".join(f"{p.drafted:.2f}" for p in points) + " |")
        print("\n".join(lines[-3:]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"batch_curve_{tag}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
