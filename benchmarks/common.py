"""What every benchmark shares: where results and data live, the run's provenance (commit, command line, device
name) and the GPU check of the GPU-only scripts."""

from __future__ import annotations

import collections
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")
# MT-bench questions: shared/data beside the checkout, or inside it (the GPU machine's copy of the working tree)
_MT_BENCH_CANDIDATES = [os.path.normpath(os.path.join(REPO_ROOT, p, "shared", "data", "mt_bench_questions.jsonl"))
                        for p in ("..", ".")]
MT_BENCH = next((p for p in _MT_BENCH_CANDIDATES if os.path.exists(p)), _MT_BENCH_CANDIDATES[0])


def mt_bench_first_turns() -> list[str]:
    """The first turn of every MT-bench question, in file order."""
    with open(MT_BENCH) as f:
        return [json.loads(line)["turns"][0] for line in f]


def mt_bench_categories() -> list[str]:
    """The category of every MT-bench question (writing, roleplay, ..., humanities), in file order."""
    with open(MT_BENCH) as f:
        return [json.loads(line)["category"] for line in f]


def mt_bench_per_category(count: int) -> list[str]:
    """The first `count` first turns of each MT-bench category, in file order: a short run that still samples all
    eight kinds (the file's first questions are all writing)."""
    return first_per_category(mt_bench_first_turns(), mt_bench_categories(), count)


def first_per_category(questions: list[str], categories: list[str], count: int) -> list[str]:
    """The first `count` questions of each category (categories[i] is questions[i]'s), in their order."""
    taken: collections.Counter[str] = collections.Counter()
    chosen = []
    for question, category in zip(questions, categories, strict=True):
        if taken[category] < count:
            taken[category] += 1
            chosen.append(question)
    return chosen


def chat_turns(llm, questions: list[str]) -> list[list[int]]:
    """Each question as a one-turn chat through the model's template, as token ids."""
    return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]


# Edits asked of code the answer must mostly copy: the workload prompt lookup (NGRAM) is for.
EDIT_REQUESTS = ("Rename the variable `{name}` to `{name}_value` everywhere in this Python function and return the "
                 "whole function:", "Add a short docstring to this Python function and return the whole function "
                 "unchanged otherwise:", "Add type hints where they are missing in this Python function and return "
                 "the whole function:")


def code_edit_requests(count: int) -> list[str]:
    """`count` requests to edit a function of hyperdraft's own source (functions of 8-30 lines, in file order), each
    quoting the function in full: answers repeat most of their prompt, as code-editing chats do."""
    import ast

    requests = []
    root = os.path.join(REPO_ROOT, "hyperdraft")
    for path in sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".py")):
        source = open(path).read()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef) and 8 <= node.end_lineno - node.lineno + 1 <= 30:
                code = ast.get_source_segment(source, node, padded=True)
                arg = next((a.arg for a in node.args.args if a.arg != "self"), node.name)
                ask = EDIT_REQUESTS[len(requests) % len(EDIT_REQUESTS)].format(name=arg)
                requests.append(f"{ask}\n\n```python\n{code}\n```")
                if len(requests) == count:
                    return requests
    return requests


def results_path(what: str, device: str) -> str:
    """benchmarks/results/<what>_<device>.md"""
    return os.path.join(RESULTS_DIR, f"{what}_{device}.md")


def write_results(lines: list[str], out: str | None, what: str, device: str) -> str:
    """A run's report -> the path written. With out (a file, or a directory to hold <what>_<device>.md) it is written
    there, replacing the file. Without, it is appended to benchmarks/results/<what>_<device>.md: those files keep the
    earlier sessions' runs, which a run without --out used to overwrite."""
    default = results_path(what, device)
    if out is None:
        had_runs = os.path.isfile(default) and os.path.getsize(default) > 0
        os.makedirs(os.path.dirname(default), exist_ok=True)
        with open(default, "a") as f:
            f.write(("\n" if had_runs else "") + "\n".join(lines) + "\n")
        return default
    if os.path.isdir(out):
        out = os.path.join(out, os.path.basename(default))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    return out


def device_tag(device="cuda") -> str:
    """The <device> part of a results file's name: cpu, or the GPU's model in lower case (h100, h200, ...)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return tag_of(torch.cuda.get_device_name(device))


def tag_of(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; 'cpu ...' -> 'cpu'; anything else, its name made file-safe."""
    if device_name.lower().startswith("cpu"):
        return "cpu"
    model = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", device_name)
    return model.group(1).lower() if model else re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


def git_commit(root: str = REPO_ROOT) -> str:
    """Short HEAD of the checkout; when hyperdraft/ has uncommitted changes, also the git tree its files make now.
    A GPU machine's copy of .git can be older than the files sent with the command, so HEAD alone can name the wrong
    commit there; the tree names the code that ran: it is `git rev-parse C:hyperdraft` of the commit C holding it."""
    def git(*args: str, env: dict | None = None) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, env=env).stdout.strip()
        except FileNotFoundError:
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--", "hyperdraft"):
        with tempfile.TemporaryDirectory() as scratch:  # a throwaway index: the checkout's own stays as it is
            env = {**os.environ, "GIT_INDEX_FILE": os.path.join(scratch, "index")}
            git("add", "-A", "--", "hyperdraft", env=env)
            tree = git("write-tree", "--prefix=hyperdraft/", env=env)[:10]
        commit += f" (plus uncommitted changes under hyperdraft/: its tree {tree or 'unknown'})"
    return commit


def command_line() -> str:
    """How this run was started, as `python -m benchmarks.<group>.<script> ARGS` (for a report's header)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    script = f"-m {spec.name}" if spec is not None else os.path.relpath(sys.argv[0], REPO_ROOT)
    return " ".join(["python", script, *map(shlex.quote, sys.argv[1:])])


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def require_cuda() -> None:
    """Stop a GPU-only benchmark with a message (not a traceback) where there is no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        name = getattr(getattr(sys.modules["__main__"], "__spec__", None), "name", "this benchmark")
        raise SystemExit(f"{name} needs a CUDA GPU (and triton); none is available here. "
                         "Run it on the GPU machine (see benchmarks/README.md).")


def timed_generate(llm, prompts: list[list[int]], params, warm_up: int, warm_up_tokens: int = 8):
    """Generate prompts once after a warm-up of their first `warm_up` prompts (first-call costs), then shut the LLM
    down -> (token ids per prompt, output tokens per second, internal state before, and after). The warm-up's
    cached prompts are flushed, so the timed run computes every prompt. Warm up over every prompt on a GPU: each new
    attention tile shape (a prompt length class, a step mixing prefill chunks with decodes) compiles a Triton kernel
    on first use, ~1 s each; at batch 16 with 80 prompts those compiles took longer than the timed run itself
    (benchmarks/probes/small_spec_batch.py)."""
    import time

    from hyperdraft import SamplingParams

    llm.generate(input_ids=prompts[:warm_up], sampling_params=SamplingParams(temperature=0, max_new_tokens=warm_up_tokens),
                 use_tqdm=False)
    llm.flush_cache()
    before = llm.get_server_info()["internal_states"][0]
    start = time.perf_counter()
    outs = llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.get_server_info()["internal_states"][0]
    llm.shutdown()
    return [o.token_ids for o in outs], sum(len(o.token_ids) for o in outs) / seconds, before, after


def generate_rate(llm, prompts: list[list[int]], params) -> float:
    """Output tokens per second of one generate over `prompts` on a CUDA device, drained before and after."""
    import time

    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    torch.cuda.synchronize()
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def close_llm(llm) -> None:
    """Shut an LLM down and hand its GPU memory back before the next one is built in the same process."""
    import gc

    import torch

    llm.shutdown()
    gc.collect()
    torch.cuda.empty_cache()


def ragged_prompts(count: int, seed: int = 0, shortest: int = 20, longest: int = 600) -> list[list[int]]:
    """`count` prompts of random ids in [10, 40000) (inside SmolLM2's vocabulary), of lengths in [shortest, longest):
    many length classes, so prefill chunks, joins and key bounds vary as in serving."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 40000, (n,), generator=g).tolist()
            for n in torch.randint(shortest, longest, (count,), generator=g).tolist()]
