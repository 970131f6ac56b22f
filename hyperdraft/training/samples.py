"""Training samples for a draft head: prompts (a JSONL file, or written by the target itself) answered by the target.

The head learns to predict the target's own answers (self-distillation), so the answers are generated here with
the engine, through the model's chat template. MT-bench is the evaluation set: prompts that appear in it are
refused.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from hyperdraft.sampling_params import SamplingParams
from hyperdraft.training.evaluation_set import EvaluationSet, folded, mt_bench

logger = logging.getLogger(__name__)

_CHECKOUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
# Where the MT-bench questions live beside a checkout (shared/data): with them, a training prompt that contains a
# question is refused too (the fingerprints catch a question alone, however spaced or capitalised).
MT_BENCH_CANDIDATES = tuple(os.path.normpath(os.path.join(_CHECKOUT, up, "shared", "data", "mt_bench_questions.jsonl"))
                            for up in (".", ".."))
# What the target is asked to write, in turn: kinds of requests a chat assistant gets (writing, roleplay, reasoning,
# math, coding, extraction, science, humanities, and plain questions). A head trained only on ShareGPT's questions
# agreed with the target 0.11 less on MT-bench's instruction-style requests than on held-out ShareGPT ones, although
# the target was more confident there (benchmarks/results/real_accept_h100.md): the head had rarely seen such
# requests. No benchmark question is used; MT-bench's are refused as training prompts (refuse_evaluation_prompts).
SELF_PROMPT_KINDS = ("a writing task, such as an email, a blog post, a story or a poem",
                     "a roleplay request, in which the assistant plays a character or a profession",
                     "a reasoning puzzle", "a math word problem", "a programming task",
                     "a request to extract or summarise information from a short text that the request includes",
                     "a science or engineering question", "a question about history, society or the arts",
                     "a question")
SELF_PROMPT = "Write {kind} that a user might give a helpful AI assistant. Reply with the request only."
MIN_ANSWER_TOKENS = 8


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]  # the chat-templated prompt, then the target's answer
    answer_start: int  # index of the answer's first token: the loss covers the answer only


class EngineOnDemand:
    """The target as the engine that answers (and writes) prompts, started on first use. A run whose answers are all
    stored (a new --init run on an earlier run's answers, a run whose prompts were answered before) starts none: it
    claims no K/V cache, so it can train beside another run on one GPU, where a second engine found no room for one
    (benchmarks/results/real_accept_h200.md, session 36), and it skips the engine's start."""

    def __init__(self, model: str, device: str, dtype: str):
        self._args = dict(model=model, device=device, dtype=dtype)
        self._llm = None

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self._engine().apply_chat_template(messages)

    def generate(self, **kwargs):
        return self._engine().generate(**kwargs)

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()

    def _engine(self):
        if self._llm is None:
            from hyperdraft.llm import LLM

            self._llm = LLM(**self._args)
        return self._llm


def load_prompts(path: str) -> list[str]:
    """One prompt per JSONL line: {"prompt": ...}, ShareGPT's {"conversations": [{"from": "human", "value": ...}]}
    (its first human turn), {"turns": [...]} (the first), or {"text": ...}."""
    prompts = []
    with open(path, encoding="utf-8", errors="strict") as f:
        for number, line in enumerate(_lines(path, f), 1):
            if not line.strip():
                continue
            try:
                prompt = _prompt_of(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON line ({e.msg})") from None
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{path}:{number}: no prompt (expected an object with a 'prompt' or 'text' string, "
                                 "'conversations' (a list of {'from', 'value'}) or 'turns' (a list of strings))")
            prompts.append(prompt)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _lines(path: str, f):
    try:
        yield from f
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start} of a line)") from None


def _prompt_of(row):
    """A row's prompt, or None where the row has none of the shapes load_prompts reads (a bare string, a 'turns'
    string, whose first character was taken as the prompt, and the like)."""
    if not isinstance(row, dict):
        return None
    if "prompt" in row:
        return row["prompt"]
    turns = row.get("conversations")
    if turns is not None:
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            return None
        return next((t.get("value") for t in turns if t.get("from") in ("human", "user")), None)
    if "turns" in row:
        return row["turns"][0] if isinstance(row["turns"], list) and row["turns"] else None
    return row.get("text")


def refuse_evaluation_prompts(prompts: list[str], candidates: tuple[str, ...] = MT_BENCH_CANDIDATES,
                              evaluation: EvaluationSet | None = None) -> None:
    """Raise if any prompt is or holds an MT-bench question (any turn; evaluation_set.py: the packaged hashes), or,
    where the questions file is found, contains one's text."""
    evaluation = evaluation if evaluation is not None else mt_bench()
    leaked = [p for p in prompts if evaluation.holds(p)]
    path = next((p for p in candidates if os.path.isfile(p)), None)
    if path is not None and not leaked:
        with open(path) as f:
            questions = [folded(t) for line in f if line.strip() for t in json.loads(line)["turns"]]
        leaked = [p for p, text in zip(prompts, map(folded, prompts)) if any(q in text for q in questions)]
    if leaked:
        raise ValueError(f"{len(leaked)} training prompts are or contain MT-bench questions (the evaluation set), "
                         f"e.g. {leaked[0][:60]!r}: train on other prompts")


def self_written_prompts(llm, count: int, seed: int, path: str | None = None) -> list[str]:
    """`count` distinct requests the target writes itself, of each kind of SELF_PROMPT_KINDS in turn, sampled at
    temperature 1 (seed, seed + 1, ...); with a path, the ones written there by an earlier run (a resumed run
    answers the same requests)."""
    asked = {"count": count, "seed": seed}
    if path is not None and os.path.isfile(path):
        rows, _ = _read_rows(path)
        written_for = rows.pop(0)["asked"] if rows and "asked" in rows[0] else asked  # older files: as they are
        if written_for != asked:  # a larger count took the file's fewer prompts without a word
            raise ValueError(f"{path} holds prompts written for {written_for}, this run asks {asked}: remove it, or "
                             "ask as it was written")
        return [row["prompt"] for row in rows][:count]
    prompts = _write_prompts(llm, count, seed)
    if path is not None:
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in [{"asked": asked}] + [{"prompt": p} for p in prompts])
    return prompts


def self_prompt_requests(count: int) -> list[str]:
    """What the target is asked, for each of `count` prompts it writes: the kinds of SELF_PROMPT_KINDS in turn."""
    return [SELF_PROMPT.format(kind=SELF_PROMPT_KINDS[i % len(SELF_PROMPT_KINDS)]) for i in range(count)]


def _write_prompts(llm, count: int, seed: int) -> list[str]:
    inputs = [llm.apply_chat_template([{"role": "user", "content": text}]) for text in self_prompt_requests(count)]
    prompts: list[str] = []
    seen: set[str] = set()  # thousands of prompts: a list's `in` would make the dedup quadratic
    tries = 0
    while len(prompts) < count and tries < 4:
        params = [SamplingParams(temperature=1.0, seed=seed + tries * count + i, max_new_tokens=64)
                  for i in range(count)]
        for out in llm.generate(input_ids=inputs, sampling_params=params, use_tqdm=False):
            text = out.text.strip()
            if text and text not in seen:
                seen.add(text)
                prompts.append(text)
        tries += 1
    return prompts[:count]


def _read_rows(path: str, torn_tail_ok: bool = False) -> tuple[list[dict], bool]:
    """The JSON lines of a file -> (rows, whether a last line cut short was dropped). A bad line is an error naming
    the file and line, except, with torn_tail_ok, an unterminated last one (a run killed while appending it)."""
    with open(path) as f:
        lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
    rows = []
    for position, (number, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if torn_tail_ok and position == len(lines) - 1 and not line.endswith("\n"):
                logger.warning("%s:%d was cut short (a run stopped while writing it): that prompt is answered again",
                               path, number)
                return rows, True
            raise ValueError(f"{path}:{number}: not a JSON line ({e.msg}): remove the file, or that line") from None
    return rows, False


class SampleStore:
    """OUT/samples.jsonl: each prompt's answer, appended as chunks of prompts are answered, so a run stopped midway
    (a GPU call's time limit) resumes where it stopped and no prompt is answered twice. One line per prompt: its
    index, its text (a resumed run with other prompts is refused), and its sample, or null when the prompt was too
    long or the answer empty."""

    def __init__(self, path: str | None, made_by: dict | None = None):
        """path None: kept in memory only. made_by: what makes the answers (the model, temperature, max_len, seed),
        the store's first line; a store made otherwise is refused, since its answers would be trained on as this
        run's (a store from before the record is used with a warning)."""
        self.path = path
        self.done: dict[int, tuple[str, Sample | None]] = {}
        if path is None:
            return
        if not os.path.isfile(path):
            with open(path, "w") as f:
                f.write(json.dumps({"made_by": made_by}) + "\n")
            return
        rows, torn = _read_rows(path, torn_tail_ok=True)
        if torn:  # appended lines must not run on from the cut one
            with open(path, "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        if rows and "made_by" in rows[0]:
            _refuse_other_maker(path, rows.pop(0)["made_by"], made_by)
        else:
            logger.warning("%s does not record the model, temperature, max_len and seed its answers were made with; "
                           "they are used as this run's", path)
        for row in rows:
            self.done[row["index"]] = (row["prompt"], None if row["sample"] is None else Sample(*row["sample"]))

    def check(self, prompts: list[str]) -> None:
        for index, (text, _) in self.done.items():  # answers past these prompts (a smaller --num-samples) stay unused
            if index < len(prompts) and prompts[index] != text:
                raise ValueError(f"{self.path} holds answers to other prompts (prompt {index} differs): remove it, "
                                 "or train from the prompts it was made from")

    def add(self, index: int, prompt: str, sample: Sample | None) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"index": index, "prompt": prompt,
                                    "sample": None if sample is None else [sample.token_ids, sample.answer_start]}) + "\n")
        self.done[index] = (prompt, sample)


def _refuse_other_maker(path: str, stored: dict | None, wanted: dict | None) -> None:
    stored = stored or {}
    differ = [f"{k} {stored.get(k)!r}, this run {v!r}" for k, v in sorted((wanted or {}).items()) if stored.get(k) != v]
    if differ:
        raise ValueError(f"{path} holds answers made with other settings ({'; '.join(differ)}): remove it (or give "
                         "--out another directory), or run with the settings it was made with")


ANSWER_CHUNK = 2048  # prompts answered between two appends to the store (larger: fewer low-batch tails on GPU)


def answer(llm, prompts: list[str], max_len: int, temperature: float, seed: int,
           store: SampleStore | None = None) -> list[Sample]:
    """The target's answers in prompt order, each sample at most max_len tokens; prompts too long to leave room, and
    empty answers, are skipped. With a store, prompts it already answered are taken from it and new answers go to it
    chunk by chunk. Prompt i's answer is sampled with seed + i, however the prompts were chunked or resumed."""
    store = store if store is not None else SampleStore(None)
    store.check(prompts)
    todo = [i for i in range(len(prompts)) if i not in store.done]
    for start in range(0, len(todo), ANSWER_CHUNK):
        chunk = todo[start:start + ANSWER_CHUNK]
        for i, sample in zip(chunk, _answer_chunk(llm, [prompts[i] for i in chunk], chunk, max_len, temperature, seed)):
            store.add(i, prompts[i], sample)
    return [s for i in range(len(prompts)) if (s := store.done[i][1]) is not None]


def _answer_chunk(llm, prompts: list[str], indices: list[int], max_len: int, temperature: float,
                  seed: int) -> list[Sample | None]:
    inputs = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    kept = [k for k, ids in enumerate(inputs) if len(ids) + MIN_ANSWER_TOKENS <= max_len]
    params = [SamplingParams(temperature=temperature, seed=seed + indices[k], max_new_tokens=max_len - len(inputs[k]))
              for k in kept]
    outs = llm.generate(input_ids=[inputs[k] for k in kept], sampling_params=params, use_tqdm=True)
    samples: list[Sample | None] = [None] * len(prompts)
    for k, out in zip(kept, outs):
        if len(out.token_ids) >= 2:
            samples[k] = Sample(inputs[k] + out.token_ids, len(inputs[k]))
    return samples
