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
from dataclasses import dataclass

import torch


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
    # Per request, an optional [extend_len, prefix_len + extend_len] bool mask (True = may attend).
    # None means plain causal attention. Tree verification supplies ancestor masks here.
    custom_masks: list[torch.Tensor | None] | None = None

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
    mask: torch.Tensor | None = None  # optional [n, prefix_len + n] attention mask


def build_forward_batch(mode: ForwardMode, inputs: list[ForwardInput], page_table, device,
                        input_ids: torch.Tensor | None = None) -> ForwardBatch:
    """Pack inputs into one ForwardBatch. input_ids, when given, replaces the packed token ids with a device
    tensor (draft tokens that never visit the host); the inputs' token_ids then only count tokens."""
    ids, positions, seq_index, row_of_token, logits_idx = [], [], [], [], []
    for b, inp in enumerate(inputs):
        n = len(inp.token_ids)
        start = len(ids)
        ids += inp.token_ids
        positions += inp.positions if inp.positions is not None else range(inp.prefix_len, inp.prefix_len + n)
        seq_index += range(inp.prefix_len, inp.prefix_len + n)
        row_of_token += [inp.row] * n
        logits_idx += range(start + n - inp.num_logits, start + n)
    as_long = dict(dtype=torch.int64, device=device)
    rows = torch.tensor([inp.row for inp in inputs], **as_long)
    out_slots = page_table.slots(torch.tensor(row_of_token, **as_long), torch.tensor(seq_index, **as_long)[:, None])[:, 0]
    masks = [inp.mask for inp in inputs]
    return ForwardBatch(
        mode=mode,
        input_ids=torch.tensor(ids, **as_long) if input_ids is None else input_ids,
        positions=torch.tensor(positions, **as_long),
        out_slots=out_slots,
        req_rows=rows,
        prefix_lens=[inp.prefix_len for inp in inputs],
        extend_lens=[len(inp.token_ids) for inp in inputs],
        logits_indices=torch.tensor(logits_idx, **as_long),
        custom_masks=masks if any(m is not None for m in masks) else None,
    )
