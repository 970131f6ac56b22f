"""A draft round's bookkeeping in single launches: the catch-up batch and every draft step's batch from one packed
block (round_plan), the next round's packed block from a verify's results (pack_catch_up), and a chain's accept
decision (accept_chain).

Each replaces a dozen or more tiny torch kernels (aranges, gathers, wheres, casts, a scan) of a few microseconds
each: at batch 1 on an H100 they summed to ~150 us of a ~7.6 ms chain-5 round, time the GPU spends on nothing
but indices. The torch references are the code these kernels stand in for (speculative/drafting/anchor.py's unpack_catch_up,
DraftAnchor.after and plan; speculative/verify/rejection.py's verify_greedy_chain and speculative/verify/simulated.py's simulate_chain); the
GPU tests compare the two element for element.

Shapes: B requests (a graph's padded batch), W = catch-up width, D = draft depths planned, k = nodes per depth and
request (1 for a chain, topk for a beam), stride = index step between depths (1 for a chain, topk for a beam).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels._triton import jit, tl, triton
from hyperdraft.kernels.pdl import pdl_args, pdl_wait
from hyperdraft.kernels.uniform import fold_domain, uniform_at

PACKED_FIELDS = 4  # row, start, count, live; then W tokens (spec/draft_anchor.CatchUpRows.packed)


class RoundPlan(NamedTuple):
    """The device tensors of a catch-up batch (ids .. ext_lens), its anchor (base, live) and the draft steps'
    plan (step_*), as unpack_catch_up, DraftAnchor.after and DraftAnchor.plan build them."""

    ids: torch.Tensor  # [B*W] int64
    positions: torch.Tensor  # [B*W] int64
    slots: torch.Tensor  # [B*W] int64
    rows: torch.Tensor  # [B] int64
    logits_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    ext_starts: torch.Tensor  # [B] int32
    ext_lens: torch.Tensor  # [B] int32
    base: torch.Tensor  # [B] int64 index right after the last real catch-up token
    live: torch.Tensor  # [B] bool
    step_slots: torch.Tensor  # [D, B*k] int64
    step_positions: torch.Tensor  # [D, B*k] int64
    step_seq_lens: torch.Tensor  # [D, B] int32
    step_ext_starts: torch.Tensor  # [B] int32
    step_ext_lens: torch.Tensor  # [B] int32
    step_logits_indices: torch.Tensor  # [B*k] int64


@jit
def _token_slots(Table, row, index, stride_table, page_size, last_page, mask):
    """PageTable.token_slots: indices past a row's pages read its last entry (the padding page when unused)."""
    page = tl.load(Table + row * stride_table + tl.minimum(index // page_size, last_page), mask=mask, other=0)
    return page * page_size + index % page_size


@jit(do_not_specialize=("batch", "stride_packed", "depths", "stride", "k", "width"))
def _round_plan(
    Packed, Table, Ids, Positions, Slots, Rows, LogitsIdx, SeqLens, ExtStarts, ExtLens, Base, Live,
    StepSlots, StepPositions, StepSeqLens, StepExtStarts, StepExtLens, StepLogitsIdx,
    batch, stride_packed, stride_table, page_size, last_page, depths, stride, k, width,
    FIELDS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program b: request b's catch-up rows, anchor, and its nodes at every planned depth."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(Packed + b * stride_packed)
    start = tl.load(Packed + b * stride_packed + 1)
    count = tl.load(Packed + b * stride_packed + 2)
    packed_live = tl.load(Packed + b * stride_packed + 3) != 0

    w = tl.arange(0, BLOCK_W)
    w_ok = w < width
    index = start + w
    slot = _token_slots(Table, row, index, stride_table, page_size, last_page, w_ok & packed_live)
    slot = tl.where(packed_live, slot, 0)
    tl.store(Ids + b * width + w, tl.load(Packed + b * stride_packed + FIELDS + w, mask=w_ok), mask=w_ok)
    tl.store(Positions + b * width + w, index, mask=w_ok)
    tl.store(Slots + b * width + w, slot, mask=w_ok)
    tl.store(Rows + b, row)
    tl.store(LogitsIdx + b, b * width + count - 1)
    tl.store(SeqLens + b, (start + width).to(tl.int32))
    tl.store(ExtStarts + b, (b * width).to(tl.int32))
    tl.store(ExtLens + b, (b * 0 + width).to(tl.int32))

    # The anchor: a real token always has a real slot (page 0 is never handed out), a padding row's are all 0.
    live = tl.sum(tl.where(w == count - 1, slot, 0), 0) != 0
    base = start + count
    tl.store(Base + b, base)
    tl.store(Live + b, live)

    # Depth d (row d-1 of the plan) feeds k nodes at RoPE position base + d - 1, written at base + (d-1)*stride + f.
    d = tl.arange(0, BLOCK_D)[:, None]  # d - 1
    f = tl.arange(0, BLOCK_K)[None, :]
    node_ok = (d < depths) & (f < k)
    first = base + d * stride
    step_slot = _token_slots(Table, row, first + f, stride_table, page_size, last_page, node_ok & live)
    step_slot = tl.where(live, step_slot, 0)
    node = d * (batch * k) + b * k + f
    tl.store(StepSlots + node, step_slot, mask=node_ok)
    tl.store(StepPositions + node, base + d + f * 0, mask=node_ok)
    depth = tl.arange(0, BLOCK_D)
    tl.store(StepSeqLens + depth * batch + b, (base + depth * stride + k).to(tl.int32), mask=depth < depths)
    tl.store(StepExtStarts + b, (b * k).to(tl.int32))
    tl.store(StepExtLens + b, (b * 0 + k).to(tl.int32))  # b * 0: a tensor, whatever k arrives as
    f1 = tl.arange(0, BLOCK_K)
    tl.store(StepLogitsIdx + b * k + f1, b * k + f1, mask=f1 < k)


def _pow2(x: int) -> int:
    return triton.next_power_of_2(max(1, x))


def _block(x: int) -> int:
    """A block over a tier's width, draft count or depth: one compile for every value up to 8, so an adaptive tier
    first used in the middle of serving finds its kernels built (first_use_compiles_h100.md: a tier's first round
    compiled _accept_chain and _pack_catch_up, their blocks sized from the tier)."""
    return max(8, _pow2(x))


def round_plan(packed: torch.Tensor, table: torch.Tensor, page_size: int, depths: int, stride: int,
               k: int) -> RoundPlan:
    """packed [B, PACKED_FIELDS + W] int64 (CatchUpRows.packed layout), table [rows, pages] int64 -> RoundPlan."""
    batch, width = packed.shape[0], packed.shape[1] - PACKED_FIELDS
    dev = packed.device

    def empty(*shape, dtype=torch.int64):
        return torch.empty(shape, dtype=dtype, device=dev)

    plan = RoundPlan(empty(batch * width), empty(batch * width), empty(batch * width), empty(batch), empty(batch),
                     empty(batch, dtype=torch.int32), empty(batch, dtype=torch.int32), empty(batch, dtype=torch.int32),
                     empty(batch), empty(batch, dtype=torch.bool), empty(depths, batch * k), empty(depths, batch * k),
                     empty(depths, batch, dtype=torch.int32), empty(batch, dtype=torch.int32),
                     empty(batch, dtype=torch.int32), empty(batch * k))
    assert packed.stride(1) == 1 and table.stride(1) == 1
    if batch:
        _round_plan[(batch,)](packed, table, *plan, batch, packed.stride(0), table.stride(0), page_size,
                              table.shape[1] - 1, depths, stride, k, width, FIELDS=PACKED_FIELDS,
                              BLOCK_W=_block(width), BLOCK_K=_block(k), BLOCK_D=_block(depths), num_warps=1,
                              **pdl_args(dev))
    return plan


@jit(do_not_specialize=("real", "width", "stride_tokens", "stride_out"))
def _pack_catch_up(RowsStarts, NumAccepted, Tokens, Out, real, width, stride_tokens, stride_out,
                   FIELDS: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    """Program b: the packed catch-up of request b (< real), or a padding row (row 0, start 0, count W, not live)."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    w_ok = w < width
    is_real = b < real
    row = tl.load(RowsStarts + 2 * b, mask=is_real, other=0)
    start = tl.load(RowsStarts + 2 * b + 1, mask=is_real, other=0)
    count = tl.where(is_real, tl.load(NumAccepted + b, mask=is_real, other=0) + 1, width)
    fed = tl.load(Tokens + b * stride_tokens + w, mask=w_ok & is_real & (w < count), other=0)
    base = Out + b * stride_out
    tl.store(base, row)
    tl.store(base + 1, start)
    tl.store(base + 2, count)
    tl.store(base + 3, is_real.to(tl.int64))
    tl.store(base + FIELDS + w, fed, mask=w_ok)


def pack_catch_up(rows_starts: torch.Tensor, num_accepted: torch.Tensor, tokens: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """rows_starts [R, 2] int64 (page-table row, first fed index), num_accepted [R] int64, tokens [R, T] int64
    (the accepted drafts then the bonus token, a_r + 1 <= T) -> out [B >= R, PACKED_FIELDS + W], filled in place:
    request r feeds tokens[r, :a_r + 1] and zeros up to W (T < W: a graph padded wider than this tier's catch-up,
    an adaptive batch size's widest), rows past R are padding. The kernel on CUDA, torch elsewhere."""
    if use_fused_kernels(out):
        return pack_catch_up_kernel(rows_starts, num_accepted, tokens, out)
    return pack_catch_up_reference(rows_starts, num_accepted, tokens, out)


def pack_catch_up_kernel(rows_starts, num_accepted, tokens, out):
    width = out.shape[1] - PACKED_FIELDS
    assert rows_starts.is_contiguous() and num_accepted.is_contiguous() and tokens.stride(1) == 1
    assert out.stride(1) == 1
    if out.shape[0]:
        _pack_catch_up[(out.shape[0],)](rows_starts, num_accepted, tokens, out, rows_starts.shape[0], width,
                                        tokens.stride(0), out.stride(0), FIELDS=PACKED_FIELDS, BLOCK_W=_block(width),
                                        num_warps=1, **pdl_args(out.device))
    return out


def pack_catch_up_reference(rows_starts, num_accepted, tokens, out):
    real, width = rows_starts.shape[0], out.shape[1] - PACKED_FIELDS
    count = (num_accepted + 1)[:, None]
    tokens = torch.nn.functional.pad(tokens[:, :width], (0, max(width - tokens.shape[1], 0)))
    fed = torch.where(torch.arange(width, device=out.device) < count, tokens, 0)
    out[:real] = torch.cat([rows_starts, count, torch.ones_like(count), fed], 1)
    out[real:] = 0
    out[real:, 2] = width
    return out


@jit(do_not_specialize=("k", "stride_target", "stride_draft"))
def _accept_chain(Target, Draft, DraftLen, Seeds, SeqLens, NumAccepted, Tokens, alpha, domain_hash,
                  stride_target, stride_draft, k, SIMULATE: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program b. Draft j passes iff j < len_b and (SIMULATE: its coin < alpha; else: it equals the target's argmax
    at row j); the accepted count a is the number of leading passes, and the token after them is the target's
    argmax at row a (the bonus, or the recovery in place of the first failed draft)."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    j_ok = j < k
    draft = tl.load(Draft + b * stride_draft + j, mask=j_ok, other=0)
    passed = j_ok & (j < tl.load(DraftLen + b))
    if SIMULATE:  # sample/rng.uniform(seed, seq_len + j, DOMAIN_ACCEPT), column 0, bit for bit
        coin = uniform_at(tl.load(Seeds + b), tl.load(SeqLens + b) + j, domain_hash, j * 0)  # column 0 for every j
        passed = passed & (coin < alpha)
    else:
        passed = passed & (draft == tl.load(Target + b * stride_target + j, mask=j_ok, other=-1))
    accepted = tl.min(tl.where(passed, BLOCK_K, j), 0)  # the first failure (BLOCK_K >= k + 1: never all pass)
    last = tl.load(Target + b * stride_target + accepted)
    tl.store(NumAccepted + b, accepted)
    tl.store(Tokens + b * (k + 1) + j, tl.where(j == accepted, last, draft), mask=j < k + 1)


def accept_chain(target: torch.Tensor, draft: torch.Tensor, draft_len: torch.Tensor, simulate=None):
    """target [B, K+1] int64 argmax of every verify row, draft [B, K] int64, draft_len [B] int64; simulate: None
    (greedy verification) or (alpha, seeds [B] int64, seq_lens [B] int64, domain) -> (num_accepted [B] int64,
    tokens [B, K+1] int64: the accepted drafts, then the target's token at the first unaccepted row)."""
    target, draft, draft_len = target.contiguous(), draft.contiguous(), draft_len.contiguous()
    bsz, k = draft.shape
    num_accepted = torch.empty(bsz, dtype=torch.int64, device=draft.device)
    tokens = torch.empty(bsz, k + 1, dtype=torch.int64, device=draft.device)
    if simulate is None:
        alpha, seeds, seq_lens, domain_hash = 0.0, draft_len, draft_len, 0
    else:
        alpha, seeds, seq_lens, domain = simulate
        seeds, seq_lens, domain_hash = seeds.contiguous(), seq_lens.contiguous(), fold_domain(domain)
    if bsz:
        _accept_chain[(bsz,)](target, draft, draft_len, seeds, seq_lens, num_accepted, tokens, float(alpha),
                              domain_hash, target.stride(0), draft.stride(0), k, SIMULATE=simulate is not None,
                              BLOCK_K=_block(k + 1), num_warps=1, **pdl_args(draft.device))
    return num_accepted, tokens


class MovedChain(NamedTuple):
    """A chain round's verify batch moved on by each request's a + 1 (speculative/verify_ahead.next_round_batch)."""

    ids: torch.Tensor  # [B*W] int64: the bonus token, then the next drafts
    positions: torch.Tensor  # [B*W] int64
    slots: torch.Tensor  # [B*W] int64
    seq_lens: torch.Tensor  # [B] int32


@jit(do_not_specialize=("width", "stride_tokens", "stride_drafted", "stride_table", "last_page"))
def _move_chain_batch(SeqLens, NumAccepted, Tokens, Drafted, Rows, Table, Ids, Positions, Slots, NewLens,
                      stride_tokens, stride_drafted, stride_table, width, last_page,
                      PAGE_SIZE: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    """Program b: request b's W rows start at n + a + 1 (SeqLens holds n + W, the verify it moves on)."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_W)
    ok = j < width
    a = tl.load(NumAccepted + b)
    start = tl.load(SeqLens + b).to(tl.int64) + a + 1 - width
    index = start + j
    bonus = tl.load(Tokens + b * stride_tokens + a)
    drafted = tl.load(Drafted + b * stride_drafted + j - 1, mask=ok & (j > 0), other=0)
    row = tl.load(Rows + b)
    page = tl.load(Table + row * stride_table + tl.minimum(index // PAGE_SIZE, last_page), mask=ok, other=0)
    out = b * width + j
    tl.store(Ids + out, tl.where(j == 0, bonus, drafted), mask=ok)
    tl.store(Positions + out, index, mask=ok)
    tl.store(Slots + out, page * PAGE_SIZE + index % PAGE_SIZE, mask=ok)
    tl.store(NewLens + b, (start + width).to(tl.int32))


def move_chain_batch(seq_lens: torch.Tensor, num_accepted: torch.Tensor, tokens: torch.Tensor, drafted: torch.Tensor,
                     rows: torch.Tensor, table: torch.Tensor, page_size: int) -> MovedChain:
    """seq_lens [B] int32 (n + W: the verify being moved), num_accepted [B] int64, tokens [B, >= K+1] int64 (accepted
    drafts, then the bonus), drafted [B, K] int64 (the next drafts), rows [B] int64, table [rows, pages] int64 (the
    device page table, flushed) -> the next verify's rows, W = K + 1 a request. The kernel on CUDA, torch elsewhere."""
    if use_fused_kernels(drafted):
        return move_chain_batch_kernel(seq_lens, num_accepted, tokens, drafted, rows, table, page_size)
    return move_chain_batch_reference(seq_lens, num_accepted, tokens, drafted, rows, table, page_size)


def move_chain_batch_kernel(seq_lens, num_accepted, tokens, drafted, rows, table, page_size) -> MovedChain:
    bsz, width = drafted.shape[0], drafted.shape[1] + 1
    assert tokens.stride(1) == 1 and drafted.stride(1) == 1 and table.stride(1) == 1
    device = drafted.device
    moved = MovedChain(torch.empty(bsz * width, dtype=torch.int64, device=device),
                       torch.empty(bsz * width, dtype=torch.int64, device=device),
                       torch.empty(bsz * width, dtype=torch.int64, device=device),
                       torch.empty(bsz, dtype=torch.int32, device=device))
    if bsz:
        _move_chain_batch[(bsz,)](seq_lens, num_accepted, tokens, drafted, rows, table, *moved, tokens.stride(0),
                                  drafted.stride(0), table.stride(0), width, table.shape[1] - 1, PAGE_SIZE=page_size,
                                  BLOCK_W=_block(width), num_warps=1, **pdl_args(device))
    return moved


def move_chain_batch_reference(seq_lens, num_accepted, tokens, drafted, rows, table, page_size) -> MovedChain:
    width = drafted.shape[1] + 1
    start, index, slots = moved_rows_reference(seq_lens, num_accepted, width, rows, table, page_size)
    ids = torch.cat([tokens.gather(1, num_accepted[:, None]), drafted], 1).flatten()
    return MovedChain(ids, index.flatten(), slots.flatten(), (start + width).to(torch.int32))


def moved_rows_reference(seq_lens: torch.Tensor, num_accepted: torch.Tensor, width: int, rows: torch.Tensor,
                         table: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify of `width` rows a request (seq_lens [B] = n + width) moved on by each request's a + 1, in torch ->
    (start [B] int64 = n + a + 1, index [B, W] = start + j, slots [B, W]: indices past a row's pages read its last
    page entry, as the kernels' _token_slots)."""
    start = seq_lens + (num_accepted + (1 - width))  # [B] int64 (int32 lengths promote)
    index = start[:, None] + torch.arange(width, device=start.device)  # [B, W]
    pages = table[rows[:, None], (index // page_size).clamp_max(table.shape[1] - 1)]
    return start, index, pages * page_size + index % page_size
