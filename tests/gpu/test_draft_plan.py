"""A draft round's bookkeeping kernels (kernels/draft_plan.py) against the torch code they replace, element for
element: the catch-up batch, anchor and step plan (unpack_round), the packed catch-up of draft-ahead, and the chain
accept decision (greedy and simulated). Run on a GPU machine: `python3 -m pytest tests/gpu/test_draft_plan.py`
(with TRITON_INTERPRET=1 and triton installed, also on the CPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from hyperdraft.options import RuntimeOptions, activated
from hyperdraft.kernels.draft_plan import (PACKED_FIELDS, accept_chain, move_chain_batch_kernel,
                                           move_chain_batch_reference, pack_catch_up_kernel, pack_catch_up_reference,
                                           round_plan)
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.sample.rng import DOMAIN_ACCEPT
from hyperdraft.speculative.drafting.anchor import CatchUpRows, unpack_round
from hyperdraft.speculative.verify.rejection import verify_greedy_chain
from hyperdraft.speculative.verify.simulated import simulate_chain

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA device")


def _poison_int(numel: int) -> None:
    if DEVICE == "cuda":  # freed at once: the caching allocator hands these blocks to the launcher's outputs
        for dtype in (torch.int64, torch.int32, torch.bool):
            torch.full((numel,), -7 if dtype != torch.bool else True, dtype=dtype, device=DEVICE)


def _page_table(page_size: int, rows: int, seed: int) -> PageTable:
    """A table whose row r holds 4 + r % 5 shuffled pages (its later entries stay 0, the padding page)."""
    table = PageTable(num_pages=64, page_size=page_size, max_rows=rows + 1, max_pages_per_row=12, device=DEVICE)
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(63, generator=g) + 1
    for r in range(rows):
        n = 4 + r % 5
        table._table[r, :n] = pages[(r * 7) % 50 : (r * 7) % 50 + n].to(DEVICE)
    return table


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("width,depths,k", [(1, 4, 1), (6, 4, 1), (3, 0, 1), (4, 3, 4), (6, 2, 3)])
def test_round_plan(monkeypatch, page_size, width, depths, k):
    """unpack_round's kernel path == its torch path (unpack_catch_up, DraftAnchor.after, plan) on a batch with
    ragged counts, starts near a row's end (indices past its pages), and padding rows."""
    rows = [0, 3, 1, 4, 2]
    table = _page_table(page_size, len(rows), seed=page_size + width)
    g = torch.Generator().manual_seed(width * 10 + depths)
    tokens = [torch.randint(0, 1000, (1 + i % width,), generator=g).tolist() for i in range(len(rows))]
    # Each request's tokens end 0-5 slots before its row's last page ends, so later depths run past its pages.
    starts = [max(0, (4 + r % 5) * page_size - len(t) - off) for r, t, off in zip(rows, tokens, [3, 1, 0, 2, 5])]
    packed_host = CatchUpRows(rows, starts, tokens).packed(len(rows) + 2, width)
    packed = torch.tensor(packed_host, dtype=torch.int64, device=DEVICE).view(len(rows) + 2, PACKED_FIELDS + width)
    max_seq_len = table.max_pages_per_row * page_size

    _poison_int(4096)
    plan = round_plan(packed, table.table, page_size, depths, k, k)
    with activated(RuntimeOptions.from_env(fused_kernels=False)):  # the torch reference
        fb, anchor = unpack_round(packed, table, max_seq_len, [0] * packed.shape[0], None, depths, k)

    def same(a, b):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), (a, b)

    catch_up = [fb.input_ids, fb.positions, fb.out_slots, fb.req_rows, fb.logits_indices, fb.seq_lens_t,
                fb.extend_starts_t, fb.extend_lens_t, anchor.base, anchor.live]
    for mine, ref in zip(plan[:10], catch_up):
        same(mine, ref)
    assert plan.live.tolist() == [True] * len(rows) + [False] * 2  # the real rows' last tokens sit on real pages
    if depths == 0:
        assert anchor.steps is None
        return
    steps = anchor.steps
    step_refs = [steps.slots, steps.positions, steps.seq_lens, steps.extend_starts, steps.extend_lens,
                 steps.logits_indices]
    for mine, ref in zip(plan[10:], step_refs, strict=True):
        same(mine, ref)


@pytest.mark.parametrize("real,bs,width,steps", [(1, 1, 6, 5), (3, 8, 6, 5), (5, 5, 1, 0), (2, 4, 4, 3), (3, 4, 8, 3),
                                                 (1, 2, 5, 1)])
def test_pack_catch_up(real, bs, width, steps):
    """Draft-ahead's packed catch-up: accepted drafts then the bonus token, zeros past them, padding rows; a round of
    fewer steps than the graph's width - 1 (an adaptive batch size's graphs take its widest tier's catch-up)."""
    g = torch.Generator().manual_seed(real * 100 + bs + width)
    rows_starts = torch.randint(0, 50, (real, 2), generator=g).to(DEVICE)
    num_accepted = torch.randint(0, steps + 1, (real,), generator=g).to(DEVICE)
    tokens = torch.randint(0, 1000, (real, steps + 2), generator=g).to(DEVICE)[:, :steps + 1]  # a strided view
    out = torch.full((bs, PACKED_FIELDS + width), -7, dtype=torch.int64, device=DEVICE)
    ref = pack_catch_up_reference(rows_starts, num_accepted, tokens, out.clone())
    assert torch.equal(pack_catch_up_kernel(rows_starts, num_accepted, tokens, out), ref)


def _chain_case(bsz: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 4, (bsz, k + 1), generator=g)
    other = torch.randint(0, 4, (bsz, k), generator=g)
    draft = torch.where(torch.rand(bsz, k, generator=g) < 0.7, target[:, :k], other)
    draft_len = torch.randint(0, k + 1, (bsz,), generator=g)
    return target.to(DEVICE), draft.to(DEVICE), draft_len.to(DEVICE)


@pytest.mark.parametrize("bsz,k", [(1, 5), (64, 5), (33, 3), (16, 1), (8, 7)])
def test_accept_chain_greedy(monkeypatch, bsz, k):
    target, draft, draft_len = _chain_case(bsz, k, seed=bsz + k)
    _poison_int(bsz * (k + 1))
    num_accepted, tokens = accept_chain(target, draft, draft_len)
    with activated(RuntimeOptions.from_env(fused_kernels=False)):
        ref_accepted, ref_tokens = verify_greedy_chain(target, draft, draft_len)
    assert torch.equal(num_accepted, ref_accepted) and torch.equal(tokens, ref_tokens)
    assert len(set(num_accepted.tolist())) > 1 or bsz == 1  # the case exercises several accept lengths


@pytest.mark.parametrize("bsz,k,alpha", [(1, 5, 0.8), (64, 5, 0.6), (128, 3, 0.9), (16, 7, 0.5)])
def test_accept_chain_simulated(monkeypatch, bsz, k, alpha):
    """The simulated accept decision draws the same coins as sample/rng.uniform, bit for bit."""
    target, draft, draft_len = _chain_case(bsz, k, seed=7 * bsz + k)
    g = torch.Generator().manual_seed(bsz)
    seeds = torch.randint(-2**62, 2**62, (bsz,), generator=g).to(DEVICE)
    seq_lens = torch.randint(0, 10_000, (bsz,), generator=g).to(DEVICE)
    _poison_int(bsz * (k + 1))
    num_accepted, tokens = accept_chain(target, draft, draft_len, (alpha, seeds, seq_lens, DOMAIN_ACCEPT))
    with activated(RuntimeOptions.from_env(fused_kernels=False)):
        ref_accepted, ref_tokens = simulate_chain(None, draft, draft_len, alpha, seeds, seq_lens, greedy_target=target)
    assert torch.equal(num_accepted, ref_accepted) and torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("bsz,k", [(1, 1), (1, 5), (5, 3), (8, 7), (1, 0), (6, 0)])
def test_move_chain_batch(page_size, bsz, k):
    """Round-ahead's chain batch move (verify_ahead.next_round_batch): the kernel == the torch code, element for
    element, with accept counts 0..K, rows in any order, and moved rows running past a row's pages (they map to its
    last page entry, as token_slots clamps). K = 0 is a plain decode moved on by one token (not used by the engine
    yet: a candidate for decode-ahead's batch, session 32's note)."""
    table = _page_table(page_size, 6, seed=page_size * 10 + k)
    g = torch.Generator().manual_seed(bsz * 100 + k)
    width = k + 1
    rows = torch.randint(0, 6, (bsz,), generator=g)
    seq_lens = torch.randint(width, width + 8 * page_size, (bsz,), generator=g).to(torch.int32)
    num_accepted = torch.randint(0, k + 1, (bsz,), generator=g)
    tokens = torch.randint(0, 1000, (bsz, k + 2), generator=g)[:, : k + 1]  # a strided view, as a round's slice
    drafted = torch.randint(0, 1000, (bsz, k), generator=g)
    args = [t.to(DEVICE) for t in (seq_lens, num_accepted, tokens, drafted, rows)]
    _poison_int(4096)
    got = move_chain_batch_kernel(*args, table.table, page_size)
    want = move_chain_batch_reference(*args, table.table, page_size)
    for name, a, b in zip(got._fields, got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
