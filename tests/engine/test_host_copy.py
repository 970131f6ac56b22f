"""HostCopy: a record of named device tensors comes back as the same record of host values, shapes and integer types
kept, in one read of one buffer."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hyperdraft.core.host_copy import HostCopy
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
