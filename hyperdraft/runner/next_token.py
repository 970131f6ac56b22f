"""The forward of every request's next token, queued before the host has committed this step: decode-ahead
(engine/model_worker.py) and verify-ahead (speculative/verify_ahead.py) both feed each request the token it just
produced, still on the device, at index n + 1 (req.num_computed is still n)."""

from __future__ import annotations

import torch

from hyperdraft.core.forward_batch import ForwardBatch, ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.request import Request


def next_token_batch(mode: ForwardMode, reqs: list[Request], tokens: torch.Tensor, page_table: PageTable,
                     device: torch.device, **state_walk) -> ForwardBatch | None:
    """tokens [B] on the device -> one-token rows at n + 1, room for them reserved; None (nothing reserved) when the
    pool is dry: the next schedule decides who keeps running."""
    if not page_table.reserve_ahead([r.row for r in reqs], [r.num_computed + 2 for r in reqs]):
        return None
    inputs = [ForwardInput(r.row, r.num_computed + 1, [0], 1) for r in reqs]
    return build_forward_batch(mode, inputs, page_table, device, input_ids=tokens, **state_walk)
