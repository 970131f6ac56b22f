"""The forward of every request's next token, queued before the host has committed this step: decode-ahead
(engine/model_worker.py) and verify-ahead (speculative/verify_ahead.py) both feed each request the token it just
produced, still on the device, at index n + 1 (req.num_computed is still n).

Two ways to build it. `next_token_batch` packs the rows on the host, as any forward's batch (build_forward_batch: host
lists, one pinned copy, splits, a slot gather). `moved_next_token_batch` starts from the one-token forward the step
itself fed (a decode, or a step-0 round's one-row verify: index n for each request, in the same order) and moves it
on by one token on the device with the chain round's move kernel at no drafts (kernels/draft_plan.move_chain_batch:
ids, positions, slots and lengths in one launch); only the page table's queued entries travel. Measured on an H200
(plain_step_h200.md, session 33): a plain step 2-3% faster at batch 8 and 5-8% at 64, even at batch 1 (where the
page table's new entry still travels every step)."""

from __future__ import annotations

import dataclasses

import torch

from hyperdraft import options
from hyperdraft.core.forward_batch import ForwardBatch, ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.kernels.draft_plan import move_chain_batch
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.request import Request


def next_token_batch(mode: ForwardMode, reqs: list[Request], tokens: torch.Tensor, page_table: PageTable,
                     device: torch.device, **state_walk) -> ForwardBatch | None:
    """tokens [B] on the device -> one-token rows at n + 1, room for them reserved; None (nothing reserved) when the
    pool is dry: the next schedule decides who keeps running."""
    if not _reserve(reqs, page_table):
        return None
    inputs = [ForwardInput(r.row, r.num_computed + 1, [0], 1) for r in reqs]
    return build_forward_batch(mode, inputs, page_table, device, input_ids=tokens, **state_walk)


def moves_on(fed: ForwardBatch | None, reqs: list[Request]) -> bool:
    """Whether the next-token forward of reqs is moved_next_token_batch's (fed: the step's own one-token forward of
    them over a dense target, or None) rather than next_token_batch's (RuntimeOptions.move_ahead_batch)."""
    return fed is not None and fed.num_tokens == len(reqs) and options.current().move_ahead_batch


def moved_next_token_batch(fed: ForwardBatch, reqs: list[Request], tokens: torch.Tensor,
                           page_table: PageTable) -> ForwardBatch | None:
    """fed: the step's own one-token forward of reqs, one row each at index n (a dense target's: no state walk);
    tokens [B] on the device -> the same rows at n + 1 fed `tokens`, in fed's mode, as next_token_batch gives them;
    None when the pool is dry."""
    assert fed.num_tokens == len(reqs) and fed.max_extend_len == 1 and fed.state_parents is None
    if not _reserve(reqs, page_table):
        return None
    no_drafts = tokens.new_empty(len(reqs), 0)
    # a = 0 accepted: the "bonus" is tokens[b], fed at seq_len (n + 1) with the new length n + 2
    moved = move_chain_batch(fed.seq_lens_t, torch.zeros_like(tokens), tokens[:, None], no_drafts, fed.req_rows,
                             page_table.table, page_table.page_size)
    prefix = [r.num_computed + 1 for r in reqs]
    return dataclasses.replace(fed, input_ids=moved.ids, positions=moved.positions, out_slots=moved.slots,
                               prefix_lens=prefix, seq_lens_t=moved.seq_lens, max_seq_len=max(prefix) + 1)


def _reserve(reqs: list[Request], page_table: PageTable) -> bool:
    return page_table.reserve_ahead([r.row for r in reqs], [r.num_computed + 2 for r in reqs])
