"""NGRAM's prompt lookup on the device, so that a round's next draft can be queued before the host has read the
round's accepted tokens (draft-ahead: speculative/proposers/ngram_store.py). Three launches a round, the torch
reference beside them; the GPU test compares the two element for element.

Terms. A request's sequence S = its tokens 0 .. L-1, kept by K/V slot (`tokens[slot]`, the slot of position p from
the page table as the K/V's), so a request's tokens live beside its K/V and need no buffer of their own. The history
H = finished requests' sequences, SEPARATOR between them. A candidate end e in a source (S or H) has 1 <= e <
len(source) (a continuation exists), and its match length w(e) is the largest w <= max_window (and <= L) with
source[e-w : e] == S[L-w : L]. The draft is what follows the best candidate, source[e : e+K] cut at a SEPARATOR:
the longest w, the latest e on a tie, S's own unless H holds a strictly longer match, and nothing when w <
min_window. This is speculative/proposers/ngram.ngram_match's rule, which the CPU test holds the reference to.

  append   program b: the round's a_b + 1 committed tokens (accepted drafts, then the bonus) at positions base_b ..
           base_b + a_b (base_b = the sequence's length before the round); L_b = base_b + a_b + 1
  match    programs (b, s): candidate blocks s, s + S, ... of S's ends, then of H's; each block's best key
           (w << 32 | e) goes to best[b, source] by atomic max, so the winner is the same whatever the split
  draft    program b: the winner's K tokens, and how many are real
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels._triton import jit, tl, triton
from hyperdraft.kernels.pdl import pdl_args, pdl_wait

SEPARATOR = -1  # between sequences in the history; no token id equals it, so no match or draft crosses it
# (the kernels write it as the literal -1: Triton reads no module global that is not a tl.constexpr)
MATCH_BLOCK = 512  # candidate ends a program scores at once
MAX_MATCH_PROGRAMS = 64  # per request: enough to spread a 64k-token history over the GPU


class NgramDrafts(NamedTuple):
    tokens: torch.Tensor  # [B, K] int64, 0 past each request's real drafts
    lens: torch.Tensor  # [B] int64: real drafts per request, 0 .. K


class TokenStore(NamedTuple):
    """Where the lookup reads sequences: tokens by K/V slot, and the page table that maps positions to slots."""

    tokens: torch.Tensor  # [slots] int32
    table: torch.Tensor  # [rows, pages] int64, flushed
    page_size: int


@jit
def _slot(Table, row, pos, stride_table, last_page, PAGE_SIZE: tl.constexpr):
    page = tl.load(Table + row * stride_table + tl.minimum(pos // PAGE_SIZE, last_page))
    return page * PAGE_SIZE + pos % PAGE_SIZE


@jit(do_not_specialize=("stride_accepted",))  # K + 1 or wider: one compile whatever the tier
def _ngram_append(Tokens, Table, Rows, Bases, NumAccepted, Accepted, Lens, Best, stride_table, stride_accepted,
                  last_page, PAGE_SIZE: tl.constexpr, BLOCK_A: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    row, base, a = tl.load(Rows + b), tl.load(Bases + b), tl.load(NumAccepted + b)
    j = tl.arange(0, BLOCK_A)
    ok = j <= a
    token = tl.load(Accepted + b * stride_accepted + j, mask=ok, other=0)
    slot = _slot(Table, row, tl.where(ok, base + j, 0), stride_table, last_page, PAGE_SIZE)
    tl.store(Tokens + slot, token.to(tl.int32), mask=ok)
    tl.store(Lens + b, base + a + 1)
    tl.store(Best + 2 * b, 0)  # no candidate yet: any real one has w >= 1, so its key is larger
    tl.store(Best + 2 * b + 1, 0)


@jit(do_not_specialize=("own_blocks", "history_len", "history_blocks"))
def _ngram_match(Tokens, Table, Rows, Lens, History, Best, stride_table, last_page, own_blocks, history_len,
                 history_blocks, PAGE_SIZE: tl.constexpr, MAX_WINDOW: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    s, num_programs = tl.program_id(1), tl.num_programs(1)
    row, seq_len = tl.load(Rows + b), tl.load(Lens + b)
    lane = tl.arange(0, BLOCK)
    for block in range(s, own_blocks + history_blocks, num_programs):
        own = block < own_blocks
        first = 1 + tl.where(own, block, block - own_blocks).to(tl.int64) * BLOCK
        ends = first + lane
        alive = ends < tl.where(own, seq_len, history_len)
        width = tl.zeros([BLOCK], dtype=tl.int32)
        for j in tl.static_range(MAX_WINDOW):
            at = ends - 1 - j
            alive = alive & (at >= 0) & (j < seq_len)
            # S[L-1-j], the suffix's j-th token from the end (j < L holds wherever it is compared)
            want = tl.load(Tokens + _slot(Table, row, tl.maximum(seq_len - 1 - j, 0), stride_table, last_page,
                                          PAGE_SIZE))
            if own:
                slots = _slot(Table, row, tl.where(alive, at, 0), stride_table, last_page, PAGE_SIZE)
                got = tl.load(Tokens + slots, mask=alive, other=-1)  # SEPARATOR
            else:
                got = tl.load(History + at, mask=alive, other=-1)
            alive = alive & (got == want)
            width += alive.to(tl.int32)
        key = tl.max(tl.where(width > 0, (width.to(tl.int64) << 32) | ends, 0), axis=0)
        if key > 0:
            tl.atomic_max(Best + 2 * b + tl.where(own, 0, 1), key)


@jit(do_not_specialize=("history_len", "min_window", "k"))
def _ngram_draft(Tokens, Table, Rows, Lens, History, Best, Out, OutLens, stride_table, last_page, history_len,
                 min_window, k, PAGE_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    row, seq_len = tl.load(Rows + b), tl.load(Lens + b)
    own, hist = tl.load(Best + 2 * b), tl.load(Best + 2 * b + 1)
    from_history = (hist >> 32) > (own >> 32)
    key = tl.where(from_history, hist, own)
    width = key >> 32
    end = key - (width << 32)
    j = tl.arange(0, BLOCK_K)
    pos = end + j
    ok = (j < k) & (pos < tl.where(from_history, history_len, seq_len)) & (width >= min_window)
    own_token = tl.load(Tokens + _slot(Table, row, tl.where(ok, pos, 0), stride_table, last_page, PAGE_SIZE),
                        mask=ok & (from_history == 0), other=0)
    token = tl.where(from_history, tl.load(History + pos, mask=ok & from_history, other=0), own_token)
    cut = tl.min(tl.where(ok & (token == -1), j, BLOCK_K), axis=0)  # the first SEPARATOR
    count = tl.minimum(tl.sum(ok.to(tl.int64), axis=0), cut)
    tl.store(Out + b * k + j, tl.where(j < count, token, 0).to(tl.int64), mask=j < k)
    tl.store(OutLens + b, count)


def ngram_draft_ahead(store: TokenStore, rows: torch.Tensor, bases: torch.Tensor, num_accepted: torch.Tensor,
                      accepted: torch.Tensor, history: torch.Tensor, history_len: int, max_len: int, k: int,
                      min_window: int, max_window: int) -> NgramDrafts:
    """rows, bases [B] int64 (each request's page-table row and length before the round); num_accepted [B] int64;
    accepted [B, >= K+1] int64 (the round's accepted drafts, then the bonus token); history [capacity] int32 (its
    first history_len entries are H); max_len >= every L_b after the append (launch bound) -> the next round's
    drafts. Writes the committed tokens into store.tokens. The kernels on CUDA, torch elsewhere."""
    if use_fused_kernels(accepted):
        return ngram_draft_ahead_kernel(store, rows, bases, num_accepted, accepted, history, history_len, max_len, k,
                                        min_window, max_window)
    return ngram_draft_ahead_reference(store, rows, bases, num_accepted, accepted, history, history_len, k,
                                       min_window, max_window)


def ngram_draft_ahead_kernel(store: TokenStore, rows, bases, num_accepted, accepted, history, history_len, max_len, k,
                             min_window, max_window) -> NgramDrafts:
    bsz, device = rows.shape[0], rows.device
    assert accepted.stride(1) == 1 and store.table.stride(1) == 1
    lens = torch.empty(bsz, dtype=torch.int64, device=device)
    best = torch.empty(bsz, 2, dtype=torch.int64, device=device)
    drafts = NgramDrafts(torch.empty(bsz, k, dtype=torch.int64, device=device),
                         torch.empty(bsz, dtype=torch.int64, device=device))
    if not bsz:
        return drafts
    table, last_page, pdl = store.table, store.table.shape[1] - 1, pdl_args(device)
    _ngram_append[(bsz,)](store.tokens, table, rows, bases, num_accepted, accepted, lens, best, table.stride(0),
                          accepted.stride(0), last_page, PAGE_SIZE=store.page_size,
                          BLOCK_A=triton.next_power_of_2(accepted.shape[1]), num_warps=1, **pdl)
    own_blocks, history_blocks = triton.cdiv(max_len, MATCH_BLOCK), triton.cdiv(history_len, MATCH_BLOCK)
    programs = max(1, min(MAX_MATCH_PROGRAMS, own_blocks + history_blocks))
    _ngram_match[(bsz, programs)](store.tokens, table, rows, lens, history, best, table.stride(0), last_page,
                                  own_blocks, history_len, history_blocks, PAGE_SIZE=store.page_size,
                                  MAX_WINDOW=max_window, BLOCK=MATCH_BLOCK, num_warps=4, **pdl)
    _ngram_draft[(bsz,)](store.tokens, table, rows, lens, history, best, *drafts, table.stride(0), last_page,
                         history_len, min_window, k, PAGE_SIZE=store.page_size, BLOCK_K=triton.next_power_of_2(k),
                         num_warps=1, **pdl)
    return drafts


def ngram_draft_ahead_reference(store: TokenStore, rows, bases, num_accepted, accepted, history, history_len, k,
                                min_window, max_window) -> NgramDrafts:
    """The kernels' rule in plain torch, request by request (module doc)."""
    width = accepted.shape[1]
    index = bases[:, None] + torch.arange(width, device=rows.device)  # [B, K+1]
    keep = torch.arange(width, device=rows.device)[None, :] <= num_accepted[:, None]
    slots = _token_slots(store, rows[:, None], index)
    store.tokens[slots[keep]] = accepted[keep].to(torch.int32)
    lens = bases + num_accepted + 1
    drafts = torch.zeros(rows.shape[0], k, dtype=torch.int64, device=rows.device)
    counts = torch.zeros(rows.shape[0], dtype=torch.int64, device=rows.device)
    past = history[:history_len].long()
    for b, (row, length) in enumerate(zip(rows.tolist(), lens.tolist())):
        positions = torch.arange(length, device=rows.device)
        seq = store.tokens[_token_slots(store, torch.tensor(row, device=rows.device), positions)].long()
        width_own, end = _longest_match(seq, seq, max_window)
        width_history, history_end = _longest_match(past, seq, max_window)
        source = seq
        if width_history > width_own:
            width_own, end, source = width_history, history_end, past
        if width_own < min_window:
            continue
        draft = source[end: end + k]
        cut = (draft == SEPARATOR).nonzero()
        draft = draft[: int(cut[0]) if len(cut) else len(draft)]
        drafts[b, : len(draft)], counts[b] = draft, len(draft)
    return NgramDrafts(drafts, counts)


def _token_slots(store: TokenStore, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    pages = store.table[rows, (index // store.page_size).clamp_max(store.table.shape[1] - 1)]
    return pages * store.page_size + index % store.page_size


def _longest_match(source: torch.Tensor, seq: torch.Tensor, max_window: int) -> tuple[int, int]:
    """-> (w, e): the best candidate end of `source` for seq's suffix (module doc); (0, 0) when none matches."""
    ends = torch.arange(1, max(len(source), 1), device=source.device)
    alive = torch.ones_like(ends, dtype=torch.bool)
    width = torch.zeros_like(ends)
    for j in range(min(max_window, len(seq))):
        at = ends - 1 - j
        alive &= (at >= 0) & (source[at.clamp_min(0)] == seq[-1 - j])
        width += alive
    if not len(ends) or int(width.max()) == 0:
        return 0, 0
    best = int(torch.where(width > 0, width * (1 << 32) + ends, 0).max())
    return best >> 32, best & 0xFFFFFFFF
