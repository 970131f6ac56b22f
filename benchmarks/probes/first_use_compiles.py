"""Triton kernels compiled inside timed runs, after a warm-up: each is about a second of stall (the attention kernel),
which a benchmark counts as decoding time and a server as a request's latency.

The SmolLM2-135M shape (dummy bf16 weights) with a random EAGLE-3 head; 80 prompts of 20-600 random tokens, at most
64 running (so later prompts join running batches), simulated acceptance 0.5 (catch-ups of every width). Per row
(plain, chain 5, tree of topk 4 and 8 tokens, adaptive): a warm-up of 8 tokens per prompt, then three timed runs of
128 tokens per prompt; for each, tok/s and the kernels that took a new specialization key meanwhile (each a compile,
or a load when Triton's disk cache has it: start with `TRITON_CACHE_DIR=$(mktemp -d)` to time every first use), and
which arguments' specialization made the key new.

  python -m benchmarks.probes.first_use_compiles [--deterministic] [--out $OUT]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import traceback

import triton

from benchmarks.common import close_llm, generate_rate, ragged_prompts, require_cuda
from benchmarks.e2e.engines import SMOLLM2, write_configs
from hyperdraft import LLM, SamplingParams


class CompileLog:
    """Every kernel specialization a process makes, by phase, through Triton's pre-compile hook. It fires on each new
    key in a process, whether the binary then comes from the disk cache (milliseconds) or is compiled (~1 s)."""

    def __init__(self) -> None:
        self.phase = "start"
        self.keys: list[tuple[str, str, dict[str, str]]] = []  # (phase, kernel, argument -> specialization)
        self.callers: list[str] = []  # per key: the innermost engine frames that launched it
        triton.knobs.runtime.jit_cache_hook = self.record

    def record(self, *, fn, compile, **_) -> None:
        """An argument's specialization: its type, a constexpr's value, and attributes such as 16-divisibility."""
        constants, attrs = compile["constants"], compile["configs"][0]
        args = {name: f"{ty}{'=' + str(constants[(i,)]) if (i,) in constants else ''} {attrs.get((i,), '')}".strip()
                for i, (name, ty) in enumerate(compile["signature"].items())}
        args.update(num_warps=str(compile["num_warps"]), num_stages=str(compile["num_stages"]))
        self.keys.append((self.phase, fn.name, args))
        frames = [f for f in traceback.extract_stack() if "/hyperdraft/" in f.filename and "/kernels/" not in f.filename
                  and "/benchmarks/" not in f.filename]
        self.callers.append(" < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                                       for f in frames[-3:][::-1]))

    def names(self, phase: str) -> list[str]:
        return [kernel for ph, kernel, _ in self.keys if ph == phase]

    def why(self, phase: str) -> list[str]:
        """For each key new in `phase`: the arguments that differ from the nearest earlier key of that kernel, or
        where a kernel's first key was launched from."""
        lines = []
        for i, (ph, kernel, args) in enumerate(self.keys):
            earlier = [a for p, k, a in self.keys[:i] if k == kernel]
            if ph != phase:
                continue
            if not earlier:
                lines.append(f"{phase}, {kernel}: its first key, from {self.callers[i]}")
                continue
            nearest = min(earlier, key=lambda a: sum(a.get(n) != t for n, t in args.items()))
            lines.append(f"{phase}, {kernel}: " + ", ".join(
                f"{n} {nearest.get(n)} -> {t}" for n, t in args.items() if nearest.get(n) != t))
        return lines


def rows(head: str) -> dict[str, dict]:
    eagle = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_num_steps=5,
                 speculative_simulate_accept_rate=0.5)
    return {"plain": {}, "chain 5": eagle,
            "tree (topk 4, 8 tokens)": dict(eagle, speculative_eagle_topk=4, speculative_num_draft_tokens=8),
            "adaptive": dict(eagle, speculative_adaptive=True)}


def measure(log: CompileLog, row: str, llm_args: dict, prompts: list[list[int]]) -> list[str]:
    log.phase = f"{row}, warm-up"
    llm = LLM(**llm_args)
    llm.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=8), use_tqdm=False)
    cells = [str(len(log.names(log.phase)))]
    params = SamplingParams(temperature=0, max_new_tokens=128, ignore_eos=True)
    for run in range(1, 4):
        llm.flush_cache()
        log.phase = f"{row}, run {run}"
        rate = generate_rate(llm, prompts, params)
        cells.append(f"{rate:.0f} tok/s, {' '.join(log.names(log.phase)) or 'none'}")
    close_llm(llm)
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    require_cuda()
    target, head = write_configs(tempfile.mkdtemp(), SMOLLM2, 8192)
    prompts = ragged_prompts(80)
    log = CompileLog()
    lines = ["| row | new in the warm-up | run 1: tok/s, new kernels | run 2 | run 3 |", "|---|---|---|---|---|"]
    for row, spec in rows(head).items():
        llm_args = dict(model=target, load_format="dummy", dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
                        log_level="error", max_running_requests=64, enable_deterministic_inference=a.deterministic,
                        **spec)
        lines.append(f"| {row} | " + " | ".join(measure(log, row, llm_args, prompts)) + " |")
        print(lines[-1], flush=True)
    why = [w for row in rows(head) for run in (1, 2, 3) for w in log.why(f"{row}, run {run}")]
    lines += ["", "What the timed runs' new keys changed, against the nearest earlier key of the same kernel:", ""]
    lines += [f"- {w}" for w in why] or ["- nothing"]
    print("\n".join(lines[-len(why) - 1:]))
    with open(os.path.join(a.out, "first_use_compiles.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
