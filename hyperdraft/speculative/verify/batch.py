"""The step's one target forward: a round's verify rows first, then the prefill chunks riding along."""

from __future__ import annotations

import torch

from hyperdraft.core.forward_batch import ForwardBatch, ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.core.host_copy import to_device, to_device_many
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.speculative.verify.chain import ChainRound
from hyperdraft.speculative.verify.tree import TreeRound


def verify_batch(round_: ChainRound | TreeRound | None, prefill_inputs: list[ForwardInput], page_table: PageTable,
                 device: torch.device, stateful: bool = False) -> ForwardBatch:
    """TARGET_VERIFY when only the round runs, EXTEND when prefill chunks ride along (their rows causal). stateful: the
    target keeps recurrent state (a hybrid model), so the round's rows are marked speculative, each with its parent."""
    inputs = (round_.inputs() if round_ is not None else []) + prefill_inputs
    ids, positions = _packed_ids_positions(round_, prefill_inputs, device)
    mode = ForwardMode.TARGET_VERIFY if not prefill_inputs else ForwardMode.EXTEND
    mask = round_.tail_mask([len(inp.token_ids) for inp in inputs]) if round_ is not None else None
    spec = stateful and round_ is not None
    return build_forward_batch(mode, inputs, page_table, device, input_ids=ids, positions=positions, tail_mask=mask,
                               state_parents=round_.state_parents() if spec else None,
                               num_spec_requests=len(round_.reqs) if spec else 0)


def _packed_ids_positions(round_, prefill_inputs: list[ForwardInput], device: torch.device):
    """-> (input ids [T], RoPE positions [T] or None = the sequence indices) of the round's rows, then the
    prefill chunks'; the host values go in one copy."""
    prefill_ids = [t for inp in prefill_inputs for t in inp.token_ids]
    if round_ is None:
        return to_device(prefill_ids, torch.int64, device), None
    round_positions = round_.positions()
    if not prefill_inputs:
        return round_.packed_ids(), round_positions
    if round_positions is None:
        return torch.cat([round_.packed_ids(), to_device(prefill_ids, torch.int64, device)]), None
    pos = [p for inp in prefill_inputs for p in range(inp.prefix_len, inp.prefix_len + len(inp.token_ids))]
    d_ids, d_pos = to_device_many([prefill_ids, pos], torch.int64, device)
    return torch.cat([round_.packed_ids(), d_ids]), torch.cat([round_positions, d_pos])
