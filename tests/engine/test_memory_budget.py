"""engine/memory.kv_capacity_tokens: a budget with no room for the K/V cache is refused by the field that sets it,
with what to change."""

from __future__ import annotations

import pytest
import torch

from hyperdraft.config import EngineArgs
from hyperdraft.engine.memory import kv_capacity_tokens


def test_the_tokens_a_budget_holds():
    args = EngineArgs(model_path="m")
    assert kv_capacity_tokens(args, 100, 10_000, 0, 1, torch.device("cpu")) == 100
    assert kv_capacity_tokens(args, 100, 10_000, 2_000, 1, torch.device("cpu")) == 80  # after the states


def test_no_room_names_max_total_tokens_on_cpu():
    with pytest.raises(ValueError, match="^max_total_tokens leaves no room for the K/V cache$"):
        kv_capacity_tokens(EngineArgs(model_path="m", max_total_tokens=1), 100, 100, 0, 1, torch.device("cpu"))


def test_no_room_on_cuda_says_what_the_fraction_left_and_what_to_change():
    # A negative budget: another process holds more of the device than 1 - mem_fraction_static leaves free. Only the
    # device's type is read, so this runs without a GPU.
    args = EngineArgs(model_path="m", mem_fraction_static=0.8)
    with pytest.raises(ValueError, match=r"mem_fraction_static leaves no room for the K/V cache \(mem_fraction_static="
                                         r"0.8 of the device, less all memory in use on it.*leaves -2.00 GiB: free "
                                         r"the device, raise mem_fraction_static or set max_total_tokens\)"):
        kv_capacity_tokens(args, 100, -2 * 2**30, 0, 1, torch.device("cuda"))


def test_no_room_after_the_recurrent_states_says_so():
    with pytest.raises(ValueError, match=r"after the recurrent state of max_running_requests=8 requests \(1.0 MiB\): "
                                         "raise max_total_tokens or lower max_running_requests"):
        kv_capacity_tokens(EngineArgs(model_path="m", max_total_tokens=10), 100, 2**20, 2**20, 8, torch.device("cpu"))


@pytest.mark.parametrize("spec", [{}, dict(speculative_algorithm="NGRAM", speculative_num_steps=3)], ids=["plain", "ngram"])
def test_the_page_table_is_as_wide_as_the_pool_not_the_context(make_llm, tmp_path, spec):
    """A row never holds more pages than the pool has: sized by context_length alone, a model with a 1M-token context
    made a 2 GiB table for a 256-token pool. One column past the pool stays the padding page, so indices past a full
    row still land there: outputs, including a request that outgrows the pool, equal an engine whose context is
    short enough for the old sizing."""
    from conftest import greedy, random_prompts
    from hyperdraft.testing.tiny import make_tiny_model

    long_context = make_tiny_model(str(tmp_path / "long"), "llama", max_position_embeddings=2**20)
    short_context = make_tiny_model(str(tmp_path / "short"), "llama", max_position_embeddings=512)
    prompts = random_prompts([5, 30, 12], seed=9) + [[7, 8, 9] * 12]
    params = [greedy(20), greedy(40), greedy(8), greedy(400)]  # the last outgrows the pool
    runs = []
    for path in (long_context, short_context):
        llm = make_llm(path, page_size=4, max_total_tokens=256, **spec)
        runs.append([(o.token_ids, o.finish_reason) for o in
                     llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)])
        if path == long_context:
            assert tuple(llm.engine.page_table.table.shape[1:]) == (256 // 4 + 1,)
    assert runs[0] == runs[1]
    assert runs[0][3][1] == "length"  # it filled the pool (a row as wide as the table) and could grow no further
