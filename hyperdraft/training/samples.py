"""Training samples for a draft head: prompts (a JSONL file, or written by the target itself) answered by the target.

The head learns to predict the target's own answers (self-distillation), so the answers are generated here with
the engine, through the model's chat template. MT-bench is the evaluation set: prompts that appear in it are
refused.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from hyperdraft.sampling_params import SamplingParams

# Where the MT-bench questions live beside a checkout (shared/data), checked against training prompts.
MT_BENCH_CANDIDATES = ("shared/data/mt_bench_questions.jsonl", "../shared/data/mt_bench_questions.jsonl")
SELF_PROMPT = "Write one question that a user might ask a helpful AI assistant. Reply with the question only."
MIN_ANSWER_TOKENS = 8


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]  # the chat-templated prompt, then the target's answer
    answer_start: int  # index of the answer's first token: the loss covers the answer only


def load_prompts(path: str) -> list[str]:
    """One prompt per JSONL line: {"prompt": ...}, ShareGPT's {"conversations": [{"from": "human", "value": ...}]}
    (its first human turn), {"turns": [...]} (the first), or {"text": ...}."""
    prompts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = _prompt_of(row)
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{path}:{number}: no prompt (expected a 'prompt', 'conversations', 'turns' or "
                                 "'text' field)")
            prompts.append(prompt)
    return prompts


def _prompt_of(row: dict):
    if "prompt" in row:
        return row["prompt"]
    if "conversations" in row:
        return next((t.get("value") for t in row["conversations"] if t.get("from") in ("human", "user")), None)
    if "turns" in row:
        return (row["turns"] or [None])[0]
    return row.get("text")


def refuse_evaluation_prompts(prompts: list[str], candidates: tuple[str, ...] = MT_BENCH_CANDIDATES) -> None:
    """Raise if any prompt is an MT-bench first turn (when the questions file is found)."""
    path = next((p for p in candidates if os.path.isfile(p)), None)
    if path is None:
        return
    with open(path) as f:
        evaluation = {json.loads(line)["turns"][0].strip() for line in f if line.strip()}
    leaked = [p for p in prompts if p.strip() in evaluation]
    if leaked:
        raise ValueError(f"{len(leaked)} training prompts are MT-bench questions (the evaluation set), e.g. "
                         f"{leaked[0][:60]!r}: train on other prompts")


def self_written_prompts(llm, count: int, seed: int) -> list[str]:
    """`count` distinct questions the target writes itself, sampled at temperature 1 (seed, seed + 1, ...)."""
    ids = llm.apply_chat_template([{"role": "user", "content": SELF_PROMPT}])
    prompts: list[str] = []
    tries = 0
    while len(prompts) < count and tries < 4:
        params = [SamplingParams(temperature=1.0, seed=seed + tries * count + i, max_new_tokens=64)
                  for i in range(count)]
        for out in llm.generate(input_ids=[ids] * count, sampling_params=params, use_tqdm=False):
            text = out.text.strip()
            if text and text not in prompts:
                prompts.append(text)
        tries += 1
    return prompts[:count]


def answer(llm, prompts: list[str], max_len: int, temperature: float, seed: int) -> list[Sample]:
    """The target's answers, each sample at most max_len tokens; prompts too long to leave room are skipped."""
    inputs = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    kept = [ids for ids in inputs if len(ids) + MIN_ANSWER_TOKENS <= max_len]
    params = [SamplingParams(temperature=temperature, seed=seed + i, max_new_tokens=max_len - len(ids))
              for i, ids in enumerate(kept)]
    outs = llm.generate(input_ids=kept, sampling_params=params, use_tqdm=True)
    return [Sample(ids + out.token_ids, len(ids)) for ids, out in zip(kept, outs) if len(out.token_ids) >= 2]
