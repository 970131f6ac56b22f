"""A decode round's wall time on the real default model, per row: the median engine step of chains and trees at batch
1 over MT-bench turns (real_accept_h200.md, session 41: a tree 5x4/8 round against a chain-5 round).

real_accept gives tok/s, which folds acceptance and round cost together; this gives the round cost alone. Rows run
in the order given, each in a fresh engine of this process (name a row twice to run it again, in turns):

  python -m benchmarks.probes.step_walls --head HEAD_DIR --turns 24 --rows plain c5 t54 t426 c5 t54 [--no-deterministic]
      [--new-tokens 128] [--no-ignore-eos] [--out $OUT]

Rows: plain, c3, c5 (EAGLE-3 chains), t54 (tree 5 steps, topk 4, 8 tokens), t426 (4 steps, topk 2, 6 tokens),
ngram (chain 4; needs no head). A step counts as a prefill step when it admits a request or one was still
prefilling before it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from benchmarks.common import mt_bench_first_turns
from hyperdraft import LLM, SamplingParams
from hyperdraft.models.default_model import ensure_default_model


def rows(head: str | None) -> dict[str, dict]:
    eagle = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head)
    return {"plain": {}, "ngram": dict(speculative_algorithm="NGRAM", speculative_num_steps=4),
            "c3": dict(eagle, speculative_num_steps=3), "c5": dict(eagle, speculative_num_steps=5),
            "t54": dict(eagle, speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8),
            "t426": dict(eagle, speculative_num_steps=4, speculative_eagle_topk=2, speculative_num_draft_tokens=6)}


def time_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One request at a time is batch 1: every request queued, the engine stepped by hand, each step timed."""
    engine = llm.engine
    for ids in prompts:
        engine.add_request(input_ids=ids, params=params)
    decode, prefill, start = [], [], time.perf_counter()
    while engine.has_unfinished():
        running = engine.scheduler.running  # none: this step admits the next request
        prefilling = not running or any(not r.is_decoding for r in running)
        t = time.perf_counter()
        engine.step()
        (prefill if prefilling else decode).append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    tokens = len(prompts) * (params.max_new_tokens - 1) if params.ignore_eos else None  # a prefill gives the first
    return {"decode_steps": len(decode), "decode_median_ms": round(1e3 * statistics.median(decode), 3),
            "decode_mean_ms": round(1e3 * statistics.fmean(decode), 3), "prefill_steps": len(prefill),
            "wall_s": round(wall, 3), "tokens_per_decode_step": tokens and round(tokens / len(decode), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", help="EAGLE-3 head directory (train-draft); the EAGLE rows need it")
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--rows", nargs="+", default=["plain", "c5", "t54"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                    help="batch-invariant kernels (default: on for CUDA)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    model = ensure_default_model(progress=False)
    chat = LLM(model, device="cpu", dtype="float32")
    prompts = [chat.apply_chat_template([{"role": "user", "content": q}])
               for q in mt_bench_first_turns()[:a.turns]]
    chat.shutdown()
    params = SamplingParams(temperature=0, max_new_tokens=a.new_tokens, ignore_eos=a.ignore_eos)
    specs, report = rows(a.head), []
    deterministic = cuda if a.deterministic is None else a.deterministic
    for i, name in enumerate(a.rows):
        llm = LLM(model, device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
                  max_running_requests=1, enable_deterministic_inference=deterministic, **specs[name])
        llm.generate(input_ids=prompts[:2], sampling_params=SamplingParams(temperature=0, max_new_tokens=8),
                     use_tqdm=False)  # warm-up: first-use compiles and captures
        llm.flush_cache()
        row = {"row": f"{name}#{i}", **time_steps(llm, prompts, params)}
        print(json.dumps(row), flush=True)
        report.append(row)
        llm.shutdown()
    with open(os.path.join(a.out, "step_walls.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
