"""Host <-> device transfers that never stall the host: small host values in, and the step's one results copy out.

On CUDA, `torch.tensor(values, device="cuda")` copies from pageable memory, and that copy waits for the
stream: every such call is a host-device sync, and a step full of them serialises the host with the GPU. Staging
the values in pinned memory (the caching host allocator reuses the blocks) makes the copy asynchronous. On CPU it
is plain torch.tensor.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Generic, TypeVar

import torch


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def host_to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A CPU tensor (e.g. torch.from_numpy) -> device, through pinned memory on CUDA (never a pageable, blocking copy)."""
    if torch.device(device).type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


# Triton specializes a kernel on whether each pointer argument is 16-byte aligned. Parts of one packed copy that
# started wherever the previous part ended made that depend on the batch (a batch of 3: int32 lengths at offset 12), so
# eager forwards compiled the attention kernel again, about a second each, in the middle of serving or of a timed run
# (seen on an H100: 1-6 compiles in a timed run after a full warm-up). Every part starts aligned instead.
ALIGN_BYTES = 16


def _padding(size: int, dtype: torch.dtype) -> int:
    """Elements of dtype after `size` of them up to the next ALIGN_BYTES boundary."""
    return -size % (ALIGN_BYTES // dtype.itemsize)


def aligned_sizes(sizes: list[int], dtype: torch.dtype) -> list[int]:
    """Split sizes with a padding size after each part, so that every part of a packed tensor starts 16-byte
    aligned: split(aligned_sizes(...))[::2] are the parts."""
    return [n for size in sizes for n in (size, _padding(size, dtype))]


def aligned_concat(parts: list[list], dtype: torch.dtype) -> list:
    """The parts as one list, each followed by zeros up to a 16-byte multiple (aligned_sizes' layout)."""
    return list(itertools.chain.from_iterable(itertools.chain(p, [0] * _padding(len(p), dtype)) for p in parts))


def to_device_many(parts: list[list], dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Several lists -> device tensors of one dtype through ONE copy (then split on the device), each 16-byte
    aligned (ALIGN_BYTES)."""
    flat = to_device(aligned_concat(parts, dtype), dtype, device)
    return list(flat.split(aligned_sizes([len(p) for p in parts], dtype))[::2])


# ---- the step's one device-to-host copy ----------------------------------------------------------------------------
# A results record is a NamedTuple whose fields are device tensors, nested records, or None (a part the step lacks).
Record = TypeVar("Record", bound=tuple)


def _map_tensors(record, fn):
    """The record with fn applied to every tensor, in field order (None stays None)."""
    if record is None:
        return None
    if isinstance(record, torch.Tensor):
        return fn(record)
    return type(record)(*(_map_tensors(part, fn) for part in record))


class HostCopy(Generic[Record]):
    """The step's one device-to-host copy, in two halves. __init__ queues it: every tensor of the record, flattened
    into one buffer, goes into pinned memory with an event after it. The buffer is int64 when every tensor is an
    integer one (a greedy step without logprobs: no conversions, and a lone tensor is not even concatenated), else
    float64 (exact for token ids and float32 logprobs). wait() waits for that event, not for the stream, reads the
    buffer once, and returns the same record with each tensor replaced by its values as nested Python lists of its
    shape (ints for integer tensors): no offsets are counted by hand. The host may queue more GPU work in between
    (the next decode or draft) without that work delaying the results. The record's device tensors stay referenced
    until then, so their memory cannot be reused by work queued meanwhile (see results_stream)."""

    def __init__(self, record: Record):
        self.record = record
        parts: list[torch.Tensor] = []
        _map_tensors(record, parts.append)
        self.event = None
        dtype = torch.float64 if any(x.is_floating_point() for x in parts) else torch.int64
        if len(parts) == 1:  # on the CPU the values are read at wait(): a copy keeps later in-place writes out
            flat = parts[0].flatten().to(dtype)
            self.flat = flat if flat.is_cuda else flat.clone()
        else:
            self.flat = torch.cat([x.flatten().to(dtype) for x in parts]) if parts else None  # None: nothing to copy
        if self.flat is not None and self.flat.is_cuda:
            device_values = self.flat
            self.flat = torch.empty(device_values.shape, dtype=dtype, pin_memory=True)
            self.flat.copy_(device_values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> Record:
        if self.event is not None:
            self.event.synchronize()
        flat, offset = (self.flat.tolist() if self.flat is not None else []), 0

        def take(device_tensor: torch.Tensor) -> list:
            nonlocal offset
            values = flat[offset : offset + device_tensor.numel()]
            offset += len(values)
            if not device_tensor.is_floating_point() and self.flat.dtype != torch.int64:
                values = [int(v) for v in values]
            return _nest(values, tuple(device_tensor.shape))

        return _map_tensors(self.record, take)


def _nest(values: list, shape: tuple[int, ...]) -> list:
    """A flat row-major list as nested lists of this shape."""
    if len(shape) <= 1:
        return values
    step = len(values) // shape[0] if shape[0] else 0
    return [_nest(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


@contextlib.contextmanager
def results_stream(stream: torch.cuda.Stream | None):
    """Queue the enclosed GPU work on `stream` (None: where it is), after everything queued so far on the current
    stream. A step's results tail (logprobs, packing, the copy to the host) needs nothing the next GPU work needs,
    so on its own stream it runs beside the next draft instead of delaying it. The caller keeps every input it
    hands over alive until the results are waited for: the allocator would otherwise reuse their memory for the
    current stream's next work while this stream still reads it."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield
