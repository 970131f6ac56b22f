"""Triton kernels compiled inside timed runs, after a warm-up: each is about a second of stall (the attention kernel),
which a benchmark counts as decoding time and a server as a request's latency.

The SmolLM2-135M shape (dummy bf16 weights) with a random EAGLE-3 head; 80 prompts of 20-600 random tokens, at most
64 running (so later prompts join running batches), simulated acceptance 0.5 (catch-ups of every width). Per row
(plain, chain 5, tree of topk 4 and 8 tokens): a warm-up of 8 tokens per prompt, then three timed runs of 128 tokens
per prompt; for each, tok/s and the kernels whose compiled binaries appeared in Triton's cache directory meanwhile.
Start it with a fresh cache to see every first use: `TRITON_CACHE_DIR=$(mktemp -d)`.

  python -m benchmarks.probes.first_use_compiles [--deterministic] [--out $OUT]
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import tempfile
import time

import torch

from benchmarks.common import require_cuda
from benchmarks.e2e.engines import SMOLLM2, write_configs
from hyperdraft import LLM, SamplingParams


def cache_dir() -> str:
    return os.environ.get("TRITON_CACHE_DIR", os.path.expanduser("~/.triton/cache"))


def entries() -> set[str]:
    return set(os.listdir(cache_dir())) if os.path.isdir(cache_dir()) else set()


def kernel_names(new: set[str]) -> list[str]:
    return [os.path.basename(f)[: -len(".json")] for entry in sorted(new)
            for f in glob.glob(os.path.join(cache_dir(), entry, "*.json")) if "__grp__" not in f]


def rows(head: str) -> dict[str, dict]:
    eagle = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_num_steps=5,
                 speculative_simulate_accept_rate=0.5)
    return {"plain": {}, "chain 5": eagle, "tree (topk 4, 8 tokens)": dict(eagle, speculative_eagle_topk=4,
                                                                          speculative_num_draft_tokens=8)}


def measure(target: str, spec: dict, prompts: list[list[int]], deterministic: bool) -> list[str]:
    llm = LLM(target, load_format="dummy", dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
              log_level="error", max_running_requests=64, enable_deterministic_inference=deterministic, **spec)
    seen = entries()
    llm.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=8), use_tqdm=False)
    cells = [f"warm-up: {len(entries() - seen)}"]
    params = SamplingParams(temperature=0, max_new_tokens=128, ignore_eos=True)
    for _ in range(3):
        llm.flush_cache()
        seen = entries()
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
        torch.cuda.synchronize()
        rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
        cells.append(f"{rate:.0f} tok/s, {' '.join(kernel_names(entries() - seen)) or 'none'}")
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    require_cuda()
    target, head = write_configs(tempfile.mkdtemp(), SMOLLM2, 8192)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 40000, (n,), generator=g).tolist()
               for n in torch.randint(20, 600, (80,), generator=g).tolist()]
    lines = ["| row | compiles in the warm-up | run 1: tok/s, compiled | run 2 | run 3 |", "|---|---|---|---|---|"]
    for name, spec in rows(head).items():
        lines.append(f"| {name} | " + " | ".join(measure(target, spec, prompts, a.deterministic)) + " |")
        print(lines[-1], flush=True)
    with open(os.path.join(a.out, "first_use_compiles.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
