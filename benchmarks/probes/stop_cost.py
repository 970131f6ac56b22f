"""What a request's stop strings cost per token, on the two paths that look for them: the detokenizer's push (the
server's event loop, the LLM API's stream) and the engine's stop check (StopChecker.check, inside every step).
SmolLM2-135M's tokenizer (the default model's; downloaded once into the cache), README.md's text as the output,
stop lists from typical (one or four short strings) to the largest SamplingParams accepts, random letters and a
worst case for the hold-back scan (every string the same repeated common letter). CPU.

  python -m benchmarks.probes.stop_cost [--tokens 1000] [--out FILE]    -> results/stop_cost_cpu.md (appended)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import time

from benchmarks.common import command_line, git_commit, write_results
from hyperdraft import SamplingParams
from hyperdraft.detokenizer import IncrementalDetokenizer
from hyperdraft.engine.stop import StopChecker
from hyperdraft.models.default_model import ensure_default_model
from hyperdraft.models.loader import load_tokenizer
from hyperdraft.request import Request
from hyperdraft.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
CASES = [(1, 4), (4, 16), (MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS)]


def stop_lists(count: int, length: int, rng: random.Random) -> dict[str, list[str]]:
    letters = "abcdefghijklmnopqrstuvwxyz "
    return {"random letters": ["".join(rng.choice(letters) for _ in range(length)) for _ in range(count)],
            "'e' repeated": ["e" * length] * count}


def push_us(tok, ids: list[int], stop: list[str]) -> float:
    detok = IncrementalDetokenizer(tok, stop)
    start = time.perf_counter()
    for token in ids:
        detok.push([token])
    return (time.perf_counter() - start) / len(ids) * 1e6


def check_us(tok, ids: list[int], stop: list[str], context: int) -> float:
    """The check after each of len(ids) tokens appended to an output already `context` tokens long."""
    checker = StopChecker(tok, (), 10**9)
    req = Request("probe", [1], SamplingParams(stop=stop, max_new_tokens=10**9), 0)
    req.output_ids.extend(ids[:context])
    start = time.perf_counter()
    for token in ids[context:]:
        req.output_ids.append(token)
        if checker.check(req) is not None:
            raise AssertionError("a probe's stop string occurred in the text")
    return (time.perf_counter() - start) / (len(ids) - context) * 1e6


def run_us(tok, ids: list[int], stop: list[str], context: int, run: int, one_by_one: bool) -> float:
    """StopChecker.append of runs of `run` tokens (a speculative step's accepted tokens), per token; one_by_one: the
    check after each token of the run (what append did before it decoded a run once)."""
    checker = StopChecker(tok, (), 10**9)
    req = Request("probe", [1], SamplingParams(stop=stop, max_new_tokens=10**9), 0)
    req.output_ids.extend(ids[:context])
    append = checker._append_one_by_one if one_by_one else checker.append
    start = time.perf_counter()
    for at in range(context, len(ids) - run + 1, run):
        if append(req, ids[at:at + run], [0.0] * run)[1] is not None:
            raise AssertionError("a probe's stop string occurred in the text")
    return (time.perf_counter() - start) / (len(ids) - context) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.probes.stop_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1000, help="tokens timed per path and case")
    ap.add_argument("--out", default=None, help="a file to write (default: append to results/stop_cost_cpu.md)")
    args = ap.parse_args()
    tok = load_tokenizer(ensure_default_model(progress=False))
    with open(README) as f:
        ids = tok.encode(f.read())[: 2 * args.tokens]
    rng = random.Random(0)
    lines = ["## Stop strings: cost per token", "", f"- date: {datetime.date.today()}; device: this machine's CPU "
             f"({platform.machine()}); commit: {git_commit()}", f"- command: `{command_line()}`", "",
             "| stop strings | kind | detokenizer push, us a token | engine stop check, us a token | runs of 4: "
             "checked token by token, us a token | runs of 4: one decode a run, us a token |",
             "|---|---|---|---|---|---|"]
    for count, length in CASES:
        for kind, stop in stop_lists(count, length, rng).items():
            push, check = push_us(tok, ids[: args.tokens], stop), check_us(tok, ids, stop, args.tokens)
            each, once = (run_us(tok, ids, stop, args.tokens, 4, one_by_one) for one_by_one in (True, False))
            lines.append(f"| {count} x {length} characters | {kind} | {push:.0f} | {check:.0f} | {each:.0f} | "
                         f"{once:.0f} |")
            print(lines[-1], flush=True)
    print("wrote", write_results(lines, args.out, "stop_cost", "cpu"))


if __name__ == "__main__":
    main()
