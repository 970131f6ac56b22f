"""Where the host's time goes in NGRAM's rounds on the real default model (SmolLM2-135M-Instruct), stage by stage: the
prompt-lookup chain with its lookups queued on the device a round ahead, the same chain looked up on the host, and
SGLang 0.5.23's trie tree (BFS and PROB), against plain decoding, at batch 1.

Each row runs MT-bench first turns (greedy, --new-tokens each, EOS ignored) once to warm up (first-use compiles), puts
NGRAM's history back as it was (so no turn finds its own earlier answer), then runs them again under round_host.py's
stage timers (inclusive wall-clock time per engine step, no syncs added; Triton launches counted on CUDA). Use it to
see which stage a row pays for, not for speed ratios (the timers cost a little on every call):
real_accept.py measures those.

  python -m benchmarks.probes.ngram_round [--device cuda] [--rows plain chain chain-host trie-bfs trie-prob]
      [--turns 20] [--new-tokens 128] [--count-ops] [--out $OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import time

import torch

from benchmarks.common import chat_turns, mt_bench_first_turns, require_cuda
from benchmarks.probes.round_host import Sections, instrument
from hyperdraft.config import EngineArgs
from hyperdraft.engine.engine import Engine
from hyperdraft.llm import LLM
from hyperdraft.models.default_model import ensure_default_model
from hyperdraft.options import RuntimeOptions
from hyperdraft.sampling_params import SamplingParams

ROWS = {  # name -> (speculative flags, RuntimeOptions fields)
    "plain": ({}, {}),
    "chain": ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 4}, {}),
    "chain-host": ({"speculative_algorithm": "NGRAM", "speculative_num_steps": 4}, {"draft_ahead": False}),
    "trie-bfs": ({"speculative_algorithm": "NGRAM", "speculative_ngram_match_type": "BFS"}, {}),
    "trie-prob": ({"speculative_algorithm": "NGRAM", "speculative_ngram_match_type": "PROB"}, {}),
}


def profile_row(model: str, prompts: list[list[int]], row: str, device: str, new_tokens: int, count_ops: bool) -> str:
    spec, switches = ROWS[row]
    if device == "cpu":
        switches = dict(switches, emulate_cuda_graphs=True)  # the CUDA path's Python, with torch references
    args = EngineArgs.from_kwargs(model_path=model, device=device, dtype="bfloat16" if device == "cuda" else "float32",
                                  max_running_requests=1, max_total_tokens=65536, log_level="warning", **spec)
    engine = Engine(args, dataclasses.replace(RuntimeOptions.from_args(args), **switches))
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run_all() -> None:
        for ids in prompts:  # batch 1: one request at a time
            engine.add_request(input_ids=ids, params=params)
            while engine.has_unfinished():
                engine.step()

    proposer = engine.worker.proposer if spec else None
    saved = proposer.save_history() if proposer is not None else None
    run_all()
    if proposer is not None:
        proposer.restore_history(saved)
    sections = Sections()
    instrument(engine, sections)
    if device == "cuda":
        sections.count_launches()
    sync()
    start = time.perf_counter()
    with sections.count_ops() if count_ops else contextlib.nullcontext():
        run_all()
    sync()
    wall = time.perf_counter() - start
    steps = sections.calls["Engine.step"]
    text = (f"### {row}\n\n{steps} steps, {wall / steps * 1e6:.0f} us a step, "
            f"{new_tokens * len(prompts) / wall:.1f} tok/s\n\n```\n{sections.report(steps)}\n")
    return text + (sections.op_report(steps) + "\n" if count_ops else "") + "```\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (fp32, emulated graphs)")
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--count-ops", action="store_true", help="count torch operators per stage (slows the run)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if a.device == "cuda":
        require_cuda()
    model = ensure_default_model(progress=False)
    chat = LLM(model, device="cpu", dtype="float32")
    prompts = chat_turns(chat, mt_bench_first_turns()[: a.turns])
    chat.shutdown()
    texts = []
    for row in a.rows:
        texts.append(profile_row(model, prompts, row, a.device, a.new_tokens, a.count_ops))
        gc.collect()  # the row's engine, before the next one sizes its K/V cache from free memory
        if a.device == "cuda":
            torch.cuda.empty_cache()
    report = "\n".join(texts)
    print(report)
    with open(os.path.join(a.out, "ngram_round.md"), "w") as f:
        f.write(report)


if __name__ == "__main__":
    main()
