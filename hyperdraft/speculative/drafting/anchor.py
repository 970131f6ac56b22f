"""Where a draft round writes, known on the device: its catch-up batch, and every draft step's batch after it.

A round starts with the catch-up (the positions the drafter has not consumed, ending at the root: the last
committed token). Every later draft step feeds k nodes per request at one RoPE position, root + depth, and writes
their K/V at consecutive indices past the root: a chain feeds one node per depth (index = position), a tree's
beam writes depth d's frontier at offsets 1 + (d-1)*topk + f past the root (tree_draft.py). Both are built here
from device tensors alone, so a step costs no host-to-device copy and no host decision: that makes a whole round
capturable as one CUDA graph (draft_graphs.py), and the eager path runs the very same batches. The steps' tensors
(slots, positions, lengths) are built for every depth at once before the first step (DraftAnchor.plan): at batch 1
each step's dozen index kernels cost about as much as its attention.

The catch-up's host side (CatchUpRows) travels as ONE packed int64 block per round, which unpack_catch_up turns
into the catch-up ForwardBatch on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperdraft.core.forward_batch import ForwardBatch, ForwardMode
from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels.draft_plan import PACKED_FIELDS, round_plan


@dataclass
class StepPlan:
    """The device tensors of a round's draft steps at depths 1 .. D (k nodes per request each), built together
    before the first step: one set of launches per round instead of one per step. Row d-1 is depth d's."""

    stride: int
    k: int
    slots: torch.Tensor  # [D, B*k] int64 pool slots (0 for padding rows)
    positions: torch.Tensor  # [D, B*k] int64 RoPE positions
    seq_lens: torch.Tensor  # [D, B] int32 sequence length after the step
    extend_starts: torch.Tensor  # [B] int32, the same at every depth
    extend_lens: torch.Tensor  # [B] int32
    logits_indices: torch.Tensor  # [B*k] int64

    @property
    def depths(self) -> int:
        return self.slots.shape[0]


@dataclass
class DraftAnchor:
    """Where the draft steps of each request write, read on the device off the catch-up batch."""

    rows: torch.Tensor  # [B] int64 page-table rows
    base: torch.Tensor  # [B] int64 index right after the root (the catch-up's last real token): step 1 writes here
    live: torch.Tensor  # [B] bool; False for a graph's padding rows, whose K/V then goes to the padding page
    base_host: list[int] | None  # host copy, for backends that read host lists (torch); None inside a graph
    max_seq_len: int  # static bound inside a graph; 0 = from base_host
    steps: StepPlan | None = None  # set by plan()

    @classmethod
    def after(cls, catch_up: ForwardBatch, base_host: list[int] | None, max_seq_len: int = 0) -> "DraftAnchor":
        # The catch-up's logits row of each request is its last real token; step 1 comes right after it. A real
        # token always has a real slot (page 0 is never handed out), a padding row's slots are all 0.
        last = catch_up.logits_indices
        return cls(catch_up.req_rows, catch_up.positions[last] + 1, catch_up.out_slots[last] != 0, base_host,
                   max_seq_len)

    def plan(self, depths: int, stride: int, k: int, page_table) -> None:
        """Build the batch tensors of depths 1 .. depths at once (unless unpack_round already has); step_batch then
        slices them."""
        planned = self.steps is not None and (self.steps.depths, self.steps.stride, self.steps.k) == (depths, stride, k)
        if depths >= 1 and not planned:
            self.steps = self._build(1, depths, stride, k, page_table)

    def _build(self, first_depth: int, depths: int, stride: int, k: int, page_table) -> StepPlan:
        """Depth d feeds k nodes per request at RoPE position base + d - 1, written at indices base + (d-1)*stride
        + 0 .. k-1; here for d = first_depth .. first_depth + depths - 1."""
        bsz, device = self.rows.shape[0], self.base.device
        shift = torch.arange(first_depth - 1, first_depth - 1 + depths, device=device)[:, None]  # [D, 1]: d - 1
        first = self.base + shift * stride  # [D, B] index of each request's first node at depth d
        index = first[..., None] + torch.arange(k, device=device)  # [D, B, k]
        slots = torch.where(self.live[:, None], page_table.token_slots(self.rows[:, None], index), 0)
        positions = (self.base + shift)[..., None].expand(depths, bsz, k).reshape(depths, bsz * k)
        arange = torch.arange(bsz, dtype=torch.int32, device=device)
        return StepPlan(stride, k, slots.view(depths, bsz * k), positions, (first + k).to(torch.int32), arange * k,
                        torch.full((bsz,), k, dtype=torch.int32, device=device), torch.arange(bsz * k, device=device))

    def step_batch(self, depth: int, stride: int, input_ids: torch.Tensor, page_table,
                   input_hidden: torch.Tensor | None, tail_mask: torch.Tensor | None = None,
                   state_nodes: tuple[torch.Tensor, torch.Tensor] | None = None) -> ForwardBatch:
        """The batch of draft step `depth` (>= 1): k = len(input_ids) / B nodes per request, all at RoPE position
        base + depth - 1, written at indices base + (depth-1)*stride + 0 .. k-1. A chain has stride 1 and k = 1
        (index = position); a beam has stride topk and a [B, k, W] tail mask over its ancestors. From the plan
        when one covers it (a sampled tree's narrower frontiers do not), else built here. state_nodes: (parents,
        targets) [B*k] scratch indices of a recurrent draft model's step (see ForwardBatch.state_parents)."""
        bsz = self.rows.shape[0]
        k = input_ids.shape[0] // bsz
        plan, row = self.steps, depth - 1
        if plan is None or (plan.stride, plan.k) != (stride, k) or depth > plan.depths:
            plan, row = self._build(depth, 1, stride, k, page_table), 0
        shift = (depth - 1) * stride
        prefix = [b + shift for b in self.base_host] if self.base_host is not None else [0] * bsz
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=input_ids, positions=plan.positions[row], out_slots=plan.slots[row],
            req_rows=self.rows, prefix_lens=prefix, extend_lens=[k] * bsz, logits_indices=plan.logits_indices,
            tail_mask=tail_mask, seq_lens_t=plan.seq_lens[row], extend_starts_t=plan.extend_starts,
            extend_lens_t=plan.extend_lens, max_extend_len=k,
            max_seq_len=self.max_seq_len or max(prefix, default=0) + k, input_hidden=input_hidden,
            logits_every_row=True, state_parents=None if state_nodes is None else state_nodes[0],
            num_spec_requests=0 if state_nodes is None else bsz,
            state_targets=None if state_nodes is None else state_nodes[1],
        )


@dataclass
class CatchUpRows:
    """A round's catch-up, host side: per request its page-table row, the index of its first fed token, and the
    tokens it feeds (sequence indices start .. start + len - 1; draft step 1 writes the index right after)."""

    rows: list[int]
    starts: list[int]
    tokens: list[list[int]]

    @property
    def step_bases(self) -> list[int]:
        """Host copy of DraftAnchor.base: the index right after each request's last fed token."""
        return [start + len(toks) for start, toks in zip(self.starts, self.tokens)]

    @property
    def widest(self) -> int:
        return max(map(len, self.tokens))

    def packed(self, bs: int, width: int) -> list[int]:
        """[bs, PACKED_FIELDS + width] row-major: (row, start, count, live, tokens padded to width); the rows past
        the real ones are padding (row 0, start 0, count width, not live)."""
        out = []
        for row, start, toks in zip(self.rows, self.starts, self.tokens):
            out += [row, start, len(toks), 1, *toks, *[0] * (width - len(toks))]
        return out + [0, 0, width, 0, *[0] * width] * (bs - len(self.rows))


def unpack_round(packed: torch.Tensor, page_table, max_seq_len: int, prefix_lens: list[int],
                 base_host: list[int] | None, depths: int, k: int) -> tuple[ForwardBatch, DraftAnchor]:
    """unpack_catch_up, DraftAnchor.after and plan(depths, stride = k, k) in one: on CUDA a single launch
    (kernels/draft_plan.round_plan) instead of ~40 index kernels; elsewhere these functions themselves."""
    if base_host is not None or not use_fused_kernels(packed):
        fb = unpack_catch_up(packed, page_table, max_seq_len, prefix_lens)
        anchor = DraftAnchor.after(fb, base_host, 0 if base_host is not None else max_seq_len)
        anchor.plan(depths, k, k, page_table)
        return fb, anchor
    p = round_plan(packed, page_table.table, page_table.page_size, depths, k, k)
    bs, width = packed.shape[0], packed.shape[1] - PACKED_FIELDS
    fb = ForwardBatch(
        mode=ForwardMode.DRAFT_EXTEND, input_ids=p.ids, positions=p.positions, out_slots=p.slots, req_rows=p.rows,
        prefix_lens=prefix_lens, extend_lens=[width] * bs, logits_indices=p.logits_indices, seq_lens_t=p.seq_lens,
        extend_starts_t=p.ext_starts, extend_lens_t=p.ext_lens, max_extend_len=width, max_seq_len=max_seq_len)
    steps = StepPlan(k, k, p.step_slots, p.step_positions, p.step_seq_lens, p.step_ext_starts, p.step_ext_lens,
                     p.step_logits_indices) if depths >= 1 else None
    return fb, DraftAnchor(p.rows, p.base, p.live, None, max_seq_len, steps)


def unpack_catch_up(packed: torch.Tensor, page_table, max_seq_len: int, prefix_lens: list[int]) -> ForwardBatch:
    """packed: [bs, PACKED_FIELDS + width] (CatchUpRows.packed) -> the catch-up ForwardBatch, built on the device.
    Every request feeds `width` tokens from its start; logits at its last real one. Padding tokens past a live
    request's real ones write K/V past its last real index (the draft steps overwrite them first; see the
    proposers' catch_up_batch); a padding row writes only to the padding page."""
    bs, width = packed.shape[0], packed.shape[1] - PACKED_FIELDS
    # contiguous: kernels index these [B] tensors with stride 1 (a column view of packed would hand them stride 4+W)
    rows, starts, counts, live = (packed[:, i].contiguous() for i in range(PACKED_FIELDS))
    live = live != 0
    arange = torch.arange(bs, dtype=torch.int64, device=packed.device)
    index = (starts[:, None] + torch.arange(width, device=packed.device)).flatten()
    token_rows = rows.repeat_interleave(width)
    slots = torch.where(live.repeat_interleave(width), page_table.token_slots(token_rows, index), 0)
    return ForwardBatch(
        mode=ForwardMode.DRAFT_EXTEND, input_ids=packed[:, PACKED_FIELDS:].flatten(), positions=index, out_slots=slots,
        req_rows=rows, prefix_lens=prefix_lens, extend_lens=[width] * bs, logits_indices=arange * width + counts - 1,
        seq_lens_t=(starts + width).to(torch.int32), extend_starts_t=(arange * width).to(torch.int32),
        extend_lens_t=torch.full((bs,), width, dtype=torch.int32, device=packed.device), max_extend_len=width,
        max_seq_len=max_seq_len,
    )
