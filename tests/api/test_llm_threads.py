"""LLM from several threads: calls take turns a step at a time, and each gets its own requests' outputs (two
threads' generate() stepped the engine at once, corrupting the batch: both hung; found by an audit)."""

from __future__ import annotations

import threading

import pytest

from conftest import assert_engine_clean, random_prompts
from hyperdraft import LLM, SamplingParams


def test_generate_from_two_threads_equals_one_at_a_time(llama_path):
    llm = LLM(llama_path, device="cpu", dtype="float32")
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    batches = [random_prompts([5, 9, 3, 12], seed=s) for s in (1, 2)]
    want = [[o.token_ids for o in llm.generate(input_ids=b, sampling_params=greedy, use_tqdm=False)] for b in batches]
    got: dict[int, list] = {}

    def run(k: int) -> None:
        got[k] = [o.token_ids for o in llm.generate(input_ids=batches[k], sampling_params=greedy, use_tqdm=False)]

    for _ in range(3):
        threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a generate() from a second thread hung"
        assert [got[0], got[1]] == want
    assert_engine_clean(llm)
    llm.shutdown()


@pytest.mark.parametrize("prompts", [5, (p for p in ["a"]), {"a": 1}])
def test_prompts_of_the_wrong_type_are_named(llama_path, prompts):
    llm = LLM(llama_path, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="prompts must be a string or a list of strings"):
        llm.generate(prompts)
    assert_engine_clean(llm)
    llm.shutdown()
