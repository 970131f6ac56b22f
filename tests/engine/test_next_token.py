"""runner/next_token.py: the decode queued ahead built two ways. Moving the step's own decode on by one token on the
device (moved_next_token_batch) must give the forward exactly what packing it on the host (next_token_batch) gives: the
same ids, positions, slots, lengths and host bounds, at every page size, with rows in any order and lengths that
cross page boundaries; the torch reference runs here, the Triton kernel against it in tests/gpu/test_draft_plan.py."""

import random

import pytest
import torch

from hyperdraft.core.forward_batch import ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.request import Request
from hyperdraft.runner.next_token import moved_next_token_batch, next_token_batch
from hyperdraft.sampling_params import SamplingParams

DEVICE = torch.device("cpu")
PAGES_PER_ROW = 96
FIELDS = ("input_ids", "positions", "out_slots", "req_rows", "logits_indices", "seq_lens_t", "extend_starts_t",
          "extend_lens_t")


def _running(page_size: int, lengths: list[int], seed: int) -> tuple[PageTable, list[Request]]:
    """Requests holding rows in a shuffled order, each with num_computed tokens cached and room for one more."""
    table = PageTable(num_pages=512, page_size=page_size, max_rows=8, max_pages_per_row=PAGES_PER_ROW, device=DEVICE)
    rows = [table.acquire_row() for _ in range(8)]
    random.Random(seed).shuffle(rows)
    reqs = []
    for i, n in enumerate(lengths):
        req = Request(f"r{i}", list(range(n)), SamplingParams(), seed=i)
        req.row, req.num_computed = rows[i], n
        assert table.reserve(req.row, n + 1)
        reqs.append(req)
    table.flush()
    return table, reqs


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("lengths", [[5], [3, 16, 31, 7], [15, 63, 64, 1, 2, 47]])
def test_moved_next_token_batch_equals_the_host_packed_one(page_size, lengths):
    table, reqs = _running(page_size, lengths, seed=page_size + len(lengths))
    fed = build_forward_batch(ForwardMode.DECODE, [ForwardInput(r.row, r.num_computed, [1], 1) for r in reqs],
                              table, DEVICE)
    tokens = torch.randint(0, 1000, (len(reqs),), generator=torch.Generator().manual_seed(page_size))
    moved = moved_next_token_batch(fed, reqs, tokens, table)
    packed = next_token_batch(ForwardMode.DECODE, reqs, tokens, table, DEVICE)  # room already reserved: a no-op
    assert moved is not None and packed is not None
    for name in FIELDS:
        a, b = getattr(moved, name), getattr(packed, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(moved.input_ids, tokens)
    assert moved.positions.tolist() == [r.num_computed + 1 for r in reqs]
    assert (moved.prefix_lens, moved.extend_lens, moved.max_seq_len, moved.max_extend_len) == \
        (packed.prefix_lens, packed.extend_lens, packed.max_seq_len, packed.max_extend_len)
    # the slots are the rows' own: index n + 1 of each request's pages
    assert moved.out_slots.tolist() == [table.slot(r.row, r.num_computed + 1) for r in reqs]


def test_moved_next_token_batch_reserves_or_refuses():
    """Room for index n + 1 is reserved first; a row at its page-table width refuses, and nothing moves."""
    table, reqs = _running(4, [6, 9], seed=1)
    fed = build_forward_batch(ForwardMode.DECODE, [ForwardInput(r.row, r.num_computed, [1], 1) for r in reqs],
                              table, DEVICE)
    pages = [len(table.row_pages(r.row)) for r in reqs]
    assert moved_next_token_batch(fed, reqs, torch.tensor([3, 4]), table) is not None
    assert [len(table.row_pages(r.row)) for r in reqs] == [p + (r.num_computed + 2 > 4 * p) for p, r in
                                                            zip(pages, reqs)]
    full = reqs[0]
    full.num_computed = PAGES_PER_ROW * 4 - 1  # n + 2 past the row's pages
    assert moved_next_token_batch(fed, reqs, torch.tensor([3, 4]), table) is None
