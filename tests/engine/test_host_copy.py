"""HostCopy: a record of named device tensors comes back as the same record of host values, shapes and integer types
kept, in one read of one buffer; host-to-device packs start every part 16-byte aligned."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from hyperdraft.core.forward_batch import ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.core.host_copy import ALIGN_BYTES, HostCopy, to_device_many
from hyperdraft.kvcache.page_table import PageTable
from helpers.host_reads import HostReadCounter


class Inner(NamedTuple):
    counts: torch.Tensor
    scores: torch.Tensor


class Outer(NamedTuple):
    tokens: torch.Tensor
    inner: Inner | None
    missing: Inner | None


def test_a_record_round_trips_with_its_shapes_and_types():
    tokens = torch.tensor([[3, 2**40 + 1, -1], [7, 0, 5]])  # int64 beyond float32's exact range
    inner = Inner(torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0.25, -1.5e-7], dtype=torch.float32))
    host = HostCopy(Outer(tokens, inner, None)).wait()
    assert isinstance(host, Outer) and isinstance(host.inner, Inner) and host.missing is None
    assert host.tokens == [[3, 2**40 + 1, -1], [7, 0, 5]] and all(type(t) is int for row in host.tokens for t in row)
    assert host.inner.counts == [0, 4] and all(type(c) is int for c in host.inner.counts)
    assert host.inner.scores == inner.scores.tolist()  # float32 values, exact in float64


def test_empty_dimensions_keep_their_nesting():
    host = HostCopy(Inner(torch.zeros(3, 0, dtype=torch.int64), torch.zeros(0, 4))).wait()
    assert host.counts == [[], [], []] and host.scores == []


def test_one_read_per_copy_and_none_without_values():
    record = Outer(torch.arange(6).view(2, 3), Inner(torch.arange(2), torch.ones(2)), None)
    with HostReadCounter() as counter:
        HostCopy(record).wait()
        assert counter.kinds() == ["read:tolist"]
        counter.clear()
        assert HostCopy(Outer(torch.zeros(0, dtype=torch.int64)[:0].view(0), None, None)).wait().inner is None
        HostCopy(Inner(None, None)).wait()
        assert counter.kinds() == ["read:tolist"]  # the zero-size tensor still travels; the all-None record does not


def test_integer_records_travel_as_int64():
    """A record of integer tensors only (a greedy step without logprobs) travels as one int64 buffer: values past
    float64's 53-bit mantissa stay exact, and a lone tensor written in place after the copy was queued comes back as
    it was when queued."""
    big = 2**60 + 3  # not exact in float64
    lone = torch.tensor([big, -7])
    copy = HostCopy(Inner(lone, None))
    lone.fill_(0)
    host = copy.wait()
    assert host.counts == [big, -7] and all(type(t) is int for t in host.counts)
    pair = HostCopy(Outer(torch.tensor([[big, 1]]), Inner(torch.tensor([2], dtype=torch.int32), None), None)).wait()
    assert pair.tokens == [[big, 1]] and pair.inner.counts == [2]


@pytest.mark.parametrize("sizes", [[1, 2, 3], [3, 0, 5, 1], [4, 4], [7]])
def test_packed_parts_start_16_byte_aligned(sizes):
    """Triton compiles a kernel again for each alignment class of its pointers (host_copy.ALIGN_BYTES): every part of
    a packed copy, and every tensor of a forward batch, starts on a 16-byte boundary whatever the batch's sizes."""
    for dtype in (torch.int64, torch.int32, torch.float32):
        parts = [list(range(n)) for n in sizes]
        out = to_device_many(parts, dtype, "cpu")
        assert [t.tolist() for t in out] == parts
        assert all(t.data_ptr() % ALIGN_BYTES == 0 for t in out)
    table = PageTable(num_pages=64, page_size=1, max_rows=8, max_pages_per_row=32, device="cpu")
    rows = [table.acquire_row() for _ in sizes]
    for row, n in zip(rows, sizes):
        assert table.reserve(row, 2 + n)
    inputs = [ForwardInput(row, 2, list(range(n)), min(n, 1)) for row, n in zip(rows, sizes)]
    fb = build_forward_batch(ForwardMode.EXTEND, inputs, table, "cpu")
    tensors = [fb.input_ids, fb.positions, fb.out_slots, fb.req_rows, fb.logits_indices, fb.seq_lens_t,
               fb.extend_starts_t, fb.extend_lens_t]
    assert all(t.data_ptr() % ALIGN_BYTES == 0 for t in tensors)
    assert fb.seq_lens_t.tolist() == [2 + n for n in sizes] and fb.extend_lens_t.tolist() == sizes
    assert fb.extend_starts_t.tolist() == [sum(sizes[:i]) for i in range(len(sizes))]
    assert fb.req_rows.tolist() == rows and fb.input_ids.tolist() == [t for n in sizes for t in range(n)]
