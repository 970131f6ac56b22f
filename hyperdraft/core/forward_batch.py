"""ForwardBatch: everything one model forward needs, as explicit tensors.

A forward runs over B requests packed into T tokens. Request b contributes
extend_lens[b] new tokens on top of prefix_lens[b] tokens already in its KV
cache. Every mode is this one shape:

  EXTEND         prefill chunks, possibly mixed with single-token decodes
  DECODE         every request feeds exactly one token
  TARGET_VERIFY  every request feeds its last token plus its draft tokens,
                 and every one of them produces logits
  DRAFT_EXTEND   the draft model consumes accepted tokens
  IDLE           no request (kept so callers never special-case empty batches)

Nothing here is global: a ForwardBatch is built, consumed and dropped.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch

from hyperdraft.core.host_copy import aligned_concat, aligned_sizes, to_device


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    IDLE = "idle"


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, RoPE position of each token (prefix_len + depth for tree nodes)
    out_slots: torch.Tensor  # [T] int64, KV-pool slot that receives each token's K/V
    req_rows: torch.Tensor  # [B] int64, each request's row in the page table
    prefix_lens: list[int]  # [B] tokens already cached, host copy
    extend_lens: list[int]  # [B] new tokens, host copy
    logits_indices: torch.Tensor  # [N] int64, packed rows whose logits are wanted
    # Optional tail mask [B, Q, W] bool (True = may attend): query i of request b against the LAST W keys of
    # its sequence (cached and new); every key before those is visible. None means plain causal attention.
    # Tree drafting and tree verification put their ancestor masks here; W = the whole length gives an
    # arbitrary mask. Q = the longest extend in the batch (shorter requests' extra rows are ignored).
    tail_mask: torch.Tensor | None = None
    # Device copies of the per-request lengths, for backends that must not read host lists (Triton, and every
    # backend under CUDA-graph capture, where the same tensors are refilled in place before each replay).
    seq_lens_t: torch.Tensor | None = None  # [B] int32, prefix + extend
    extend_starts_t: torch.Tensor | None = None  # [B] int32, packed row of each request's first new token
    extend_lens_t: torch.Tensor | None = None  # [B] int32
    # Static upper bounds a kernel may size its launch grid from. Eager batches use the true maxima; a captured
    # graph uses the bounds it was captured for, so one graph serves every batch that fits under them.
    max_extend_len: int = 0
    max_seq_len: int = 0
    # [T, H] per-token hidden states fed beside the tokens (EAGLE heads); H is the CONSUMING model's hidden size
    input_hidden: torch.Tensor | None = None
    # logits_indices is arange(T) (every packed row, in order): the forward skips the gather
    logits_every_row: bool = False
    # Hybrid models' recurrent state under speculation: the first num_spec_requests requests feed speculative tokens
    # (a verify's rows), whose states go to the state pool's scratch, each starting from its parent's: state_parents
    # [T] int64 holds each such token's parent index within its request (-1: the committed state). Every other request
    # advances its committed state. None / 0: no request is speculative.
    state_parents: torch.Tensor | None = None
    num_spec_requests: int = 0
    # [T] int64: the scratch index each speculative token's state goes to (-1: the committed slot); None: its position
    # within its request (a verify). A draft model's steps write scratch at their node's offset past the root, less
    # one; a plain decode queued ahead (engine/model_worker.py) writes the location its request's state is not in.
    state_targets: torch.Tensor | None = None

    def logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows of hidden [T, H] whose logits are wanted."""
        return hidden if self.logits_every_row else hidden[self.logits_indices]

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]


@dataclass
class ForwardInput:
    """One request's share of a forward."""

    row: int  # page-table row
    prefix_len: int  # tokens already cached
    token_ids: list[int]  # new tokens, stored at sequence indices prefix_len .. prefix_len + n - 1
    num_logits: int  # trailing new tokens whose logits are wanted
    positions: list[int] | None = None  # RoPE positions; default prefix_len + i
    mask: torch.Tensor | None = None  # optional [n, W] tail mask over the last W keys (see ForwardBatch.tail_mask)
    padding: int = 0  # trailing token_ids fed only to fill a captured width: the logits rows end before them


def _token_lists(inputs: list[ForwardInput], starts: list[int], with_ids: bool, with_positions: bool):
    """-> per packed token: ids (when with_ids), RoPE positions (when with_positions), sequence index and page-table
    row; then the packed rows whose logits are wanted. Host lists, built in one pass."""
    if all(len(inp.token_ids) == 1 and inp.num_logits == 1 and not inp.padding for inp in inputs):
        prefix = [inp.prefix_len for inp in inputs]  # one token and its logits per request: the common decode
        ids = [inp.token_ids[0] for inp in inputs] if with_ids else []
        pos = [p if inp.positions is None else inp.positions[0] for p, inp in zip(prefix, inputs)] if with_positions else []
        return ids, pos, prefix, [inp.row for inp in inputs], starts
    ids, pos, seq_index, row_of_token, logits_idx = [], [], [], [], []
    for inp, start in zip(inputs, starts):
        n = len(inp.token_ids)
        if with_ids:
            ids += inp.token_ids
        if with_positions:
            pos += inp.positions if inp.positions is not None else range(inp.prefix_len, inp.prefix_len + n)
        seq_index += range(inp.prefix_len, inp.prefix_len + n)
        row_of_token += [inp.row] * n
        logits_idx += range(start + n - inp.padding - inp.num_logits, start + n - inp.padding)
    return ids, pos, seq_index, row_of_token, logits_idx


def build_forward_batch(mode: ForwardMode, inputs: list[ForwardInput], page_table, device,
                        input_ids: torch.Tensor | None = None, tail_mask: torch.Tensor | None = None,
                        positions: torch.Tensor | None = None, state_parents: torch.Tensor | None = None,
                        num_spec_requests: int = 0, state_targets: torch.Tensor | None = None) -> ForwardBatch:
    """Pack inputs into one ForwardBatch. input_ids, when given, replaces the packed token ids with a device
    tensor (draft tokens that never visit the host); the inputs' token_ids then only count tokens. positions, when
    given, likewise replaces the packed RoPE positions (tree nodes sit at root + depth, known on the device).
    state_parents / num_spec_requests / state_targets: where a hybrid model's leading requests read and write their
    recurrent states (see ForwardBatch).

    Every integer the forward needs travels in ONE host-to-device copy (pinned on CUDA, so it does not block), the
    page table's queued entries too (a decode at page size 1 queues one a step: its own copy cost a second transfer
    and three more host calls a step). Default RoPE positions are the tokens' sequence indices, so they are sent once
    and serve as both."""
    bsz = len(inputs)
    ext = [len(inp.token_ids) for inp in inputs]
    prefix = [inp.prefix_len for inp in inputs]
    rows = [inp.row for inp in inputs]
    seq = [p + e for p, e in zip(prefix, ext)]
    starts = list(itertools.accumulate(ext, initial=0))
    starts.pop()  # the total
    own_positions = positions is None and any(inp.positions is not None for inp in inputs)
    ids, pos, seq_index, row_of_token, logits_idx = _token_lists(inputs, starts, input_ids is None, own_positions)
    # int32 lengths last, so one conversion serves all three; every part starts 16-byte aligned (host_copy.ALIGN_BYTES:
    # else a kernel compiles again for each alignment the batch's sizes give its pointers)
    lengths = aligned_concat([seq, starts, ext], torch.int32)
    table_index, table_pages = page_table.take_pending()
    parts = [ids, pos, seq_index, row_of_token, logits_idx, rows, lengths, table_index, table_pages]
    flat = to_device(aligned_concat(parts, torch.int64), torch.int64, device)
    d_ids, d_pos, d_seq_index, d_row_of_token, d_logits, d_rows, d_lengths, d_table_index, d_table_pages = flat.split(
        aligned_sizes([len(p) for p in parts], torch.int64))[::2]
    d_seq, d_starts, d_ext = d_lengths.to(torch.int32).split(aligned_sizes([bsz] * 3, torch.int32))[::2]
    page_table.write(d_table_index, d_table_pages)
    out_slots = page_table.token_slots(d_row_of_token, d_seq_index)
    if tail_mask is None and any(inp.mask is not None for inp in inputs):
        tail_mask = _stack_tail_masks(inputs, device)
    if positions is None:
        positions = d_pos if own_positions else d_seq_index
    return ForwardBatch(
        mode=mode,
        input_ids=d_ids if input_ids is None else input_ids,
        positions=positions,
        out_slots=out_slots,
        req_rows=d_rows,
        prefix_lens=prefix,
        extend_lens=ext,
        logits_indices=d_logits,
        tail_mask=tail_mask,
        seq_lens_t=d_seq,
        extend_starts_t=d_starts,
        extend_lens_t=d_ext,
        max_extend_len=max(ext, default=0),
        max_seq_len=max(seq, default=0),
        state_parents=state_parents,
        num_spec_requests=num_spec_requests,
        state_targets=state_targets,
    )


def _stack_tail_masks(inputs: list[ForwardInput], device) -> torch.Tensor:
    """Per-request masks -> one [B, Q, W] tail mask; a request without a mask gets its causal rows."""
    q = max(len(inp.token_ids) for inp in inputs)
    w = max(inp.mask.shape[1] if inp.mask is not None else len(inp.token_ids) for inp in inputs)
    out = torch.zeros(len(inputs), q, w, dtype=torch.bool, device=device)
    for b, inp in enumerate(inputs):  # one small copy per request, no host sync: masks may already be on the device
        n = len(inp.token_ids)
        m = inp.mask.to(device) if inp.mask is not None else torch.ones(n, n, dtype=torch.bool, device=device).tril()
        out[b, :n, w - m.shape[1] :] = m
        out[b, :n, : w - m.shape[1]] = True  # keys before this request's own tail are visible
    return out


def leading_tail_mask(leading: torch.Tensor, extend_lens: list[int], device) -> torch.Tensor:
    """One [B, Q, W] tail mask, built without a per-request loop: the first leading.shape[0] requests use
    `leading` ([b, n, n], over their n new tokens), the rest plain causal rows over their own new tokens."""
    b, n = leading.shape[0], leading.shape[1]
    if len(extend_lens) == b and max(extend_lens) == n:
        # A round alone (no prefill riding along): the mask is `leading` itself. Building it took eight launches and
        # a host copy, ~100 us of an NGRAM trie round's host time on an H200's host (ngram_round_h200.md).
        return leading
    q = max(extend_lens)
    w = max(q, n)
    lens = to_device(extend_lens, torch.int64, device)
    rows = torch.arange(q, device=device)[None, :, None]
    rel = torch.arange(w, device=device)[None, None, :] - (w - lens)[:, None, None]  # key index within own tail
    mask = rel <= rows  # causal within the tail, everything before the tail visible
    mask[:b, :n, w - n :] = leading
    return mask
