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
