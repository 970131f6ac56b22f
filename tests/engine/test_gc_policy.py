"""engine/gc_policy.py: the offline LLM keeps the GC's youngest generation off its steps while it runs, and puts the
thresholds back when the last open stream closes (in any order)."""

from __future__ import annotations

import gc

from conftest import assert_engine_clean
from hyperdraft import LLM, SamplingParams
from hyperdraft.engine.gc_policy import YOUNG_THRESHOLD, young_collections_deferred


def test_young_collections_deferred_nests_and_restores():
    before = gc.get_threshold()
    outer = young_collections_deferred()
    inner = young_collections_deferred()
    outer.__enter__()
    inner.__enter__()
    assert gc.get_threshold()[0] == YOUNG_THRESHOLD
    outer.__exit__(None, None, None)  # streams of two LLMs may close out of order
    assert gc.get_threshold()[0] == YOUNG_THRESHOLD, "the first block to close put the thresholds back too early"
    inner.__exit__(None, None, None)
    assert gc.get_threshold() == before


def test_llm_steps_with_young_collections_deferred(llama_path):
    """While an LLM's stream steps, the thresholds are the deferred ones (seen from inside the stream); once it is
    exhausted, and after a generate call, they are the process's own again; the pool ends free."""
    llm = LLM(llama_path, device="cpu", dtype="float32", max_total_tokens=4096)
    before = gc.get_threshold()
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11], [12] * 7]
    seen = [gc.get_threshold()[0] for _ in llm.stream(input_ids=prompts, sampling_params=params)]
    assert seen and set(seen) == {YOUNG_THRESHOLD}, seen
    assert gc.get_threshold() == before
    outs = llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [12, 12, 12]
    assert gc.get_threshold() == before
    assert_engine_clean(llm)
    llm.shutdown()
