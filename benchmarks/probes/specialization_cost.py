"""What the kernels lose by not specializing batch-following integers (kernels/_triton.jit's do_not_specialize:
GEMV's row count, attention's split count and tree-mask shape, the round kernels' counts), which keeps them from
compiling again in the middle of serving (first_use_compiles.py).

Two variants in one process, measured in alternating turns: as shipped, and with those kernels jitted again without
do_not_specialize (Triton then folds a count equal to 1 or divisible by 16 into the binary). Rows over the
SmolLM2-135M shape (dummy bf16 weights, CUDA graphs): plain decoding at 1 and 64 requests, and an EAGLE-3 chain of 5
(random head, simulated acceptance 0.5) at 16. Each engine generates its prompts once to warm up (so both variants
have compiled everything they use), then is timed; tok/s, median over turns.

  python -m benchmarks.probes.specialization_cost [--turns 3] [--out $OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile

import triton

from benchmarks.common import close_llm, generate_rate, ragged_prompts, require_cuda
from benchmarks.e2e.engines import SMOLLM2, write_configs
from hyperdraft import LLM, SamplingParams
import hyperdraft.kernels.attention as attention
import hyperdraft.kernels.draft_plan as draft_plan
import hyperdraft.kernels.gemv as gemv

UNSPECIALIZED = {attention: ("_attn_stage1", "_attn_merge"), gemv: ("_gemv_dot",),
                 draft_plan: ("_round_plan", "_pack_catch_up", "_accept_chain")}


@contextlib.contextmanager
def specialized():
    """Those kernels as plain triton.jit of the same functions, for the duration."""
    shipped = {(mod, name): getattr(mod, name) for mod, names in UNSPECIALIZED.items() for name in names}
    for (mod, name), kernel in shipped.items():
        setattr(mod, name, triton.jit(kernel.fn))
    try:
        yield
    finally:
        for (mod, name), kernel in shipped.items():
            setattr(mod, name, kernel)


def tok_per_s(target: str, spec: dict, batch: int, prompts: list[list[int]]) -> float:
    llm = LLM(target, load_format="dummy", dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
              log_level="error", max_running_requests=batch, **spec)
    params = SamplingParams(temperature=0, max_new_tokens=128, ignore_eos=True)
    llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    llm.flush_cache()
    rate = generate_rate(llm, prompts, params)
    close_llm(llm)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    require_cuda()
    target, head = write_configs(tempfile.mkdtemp(), SMOLLM2, 8192)
    prompts = ragged_prompts(64)
    chain = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_num_steps=5,
                 speculative_simulate_accept_rate=0.5)
    rows = {"plain, 1 request": ({}, 1, prompts[:4]), "plain, 64 requests": ({}, 64, prompts),
            "chain 5, 16 requests": (chain, 16, prompts[:32])}
    lines = ["| row | shipped tok/s | specialized tok/s | shipped / specialized | turns (shipped; specialized) |",
             "|---|---|---|---|---|"]
    for row, (spec, batch, these) in rows.items():
        shipped, folded = [], []
        for _ in range(a.turns):
            shipped.append(tok_per_s(target, spec, batch, these))
            with specialized():
                folded.append(tok_per_s(target, spec, batch, these))
        s, f = statistics.median(shipped), statistics.median(folded)
        lines.append(f"| {row} | {s:.0f} | {f:.0f} | {s / f:.3f} | {' '.join(f'{x:.0f}' for x in shipped)}; "
                     f"{' '.join(f'{x:.0f}' for x in folded)} |")
        print(lines[-1], flush=True)
    with open(os.path.join(a.out, "specialization_cost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
