"""A one-launch all-reduce for small tensors on GPUs that can write each other's memory (NVLink or PCIe P2P).

Why: under tensor parallelism a decode step of a Llama-8B shape runs 66 all-reduces of one row each. NCCL takes
11.9 us for one inside a CUDA graph on two H100s, 0.79 ms of a 3.85 ms step (benchmarks/results/
allreduce_latency_h100.md), so TP 2 reached only 1.45x TP 1's latency. Here each rank *pushes* its part straight into
every peer's receive buffer (a posted NVLink write, no round trip) and sums what the peers pushed into its own; the
data is its own ready flag, so there is no separate signal and no memory-ordering handshake:

  sentinel      -0.0's bit pattern. Receive buffers hold it until a peer's part lands; a part's own -0.0 values are
                sent as +0.0 (the sum is the same number), so a slot still holding the sentinel has not arrived.
  call counter  per program (a fixed chunk of BLOCK elements of the flattened tensor), how many all-reduces that
                chunk has taken part in. Every rank makes the same calls with the same shapes, so the counters agree
                across ranks without any exchange; they live in device memory, so CUDA graph replays keep counting.
  three slots   call e pushes into slot e % 3 and, once summed, refills slot (e + 2) % 3 (the one call e - 1 read)
                with the sentinel. A peer cannot run more than one call ahead (call e + 1 needs this rank's part), so
                it writes slot (e + 1) % 3 at most while this rank reads slot e % 3; slot (e + 2) % 3 is idle.

The slots are safe only if call e - 1 has finished on this rank before call e starts (call e refills the slot that
e - 1 reads). So this kernel is launched plainly, never with programmatic dependent launch (kernels/pdl.py): a plain
launch waits for all earlier work in the stream, while a PDL kernel waits only for the kernel just before it, and the
chain back to the previous all-reduce holds only if every kernel between keeps pdl.py's rule. Measured on two H100s
(Llama-8B shape, TP 2, bf16): with PDL the engine hung in its first forward (the kernel trapped at its time limit)
whenever the nvcc-built GEMV (gemv_mma.cu) ran before it; with the GEMV off, with PDL off, with launches made blocking,
or with only this kernel launched plainly, it ran (benchmarks/probes/push_trace.py). Which link of the chain breaks
was not found.

Every rank adds the parts in rank order in fp32 and rounds once, so all ranks hold the same bits (for two ranks,
those of NCCL's sum). Programs spin on their own chunk only, so there is no grid-wide barrier; a chunk that never
arrives (a dead or diverged peer) traps after WAIT_LIMIT_S seconds instead of hanging the GPU. The plain-torch
reference is `all_reduce_reference` (the sum of the parts); tests/gpu/test_push_all_reduce.py runs the kernel's
protocol under Triton's interpreter with 2 and 3 ranks as processes sharing memory, and against NCCL on two GPUs.
"""

from __future__ import annotations

import torch

from hyperdraft.kernels._triton import jit, tl
from hyperdraft.options import triton_interpreted

BLOCK = 1024  # elements per program: a Llama-8B row (4096) spreads over 4 SMs' pushes
SLOTS = 3
# Seconds a chunk may wait for a peer before the kernel traps. Not a count of polls: at startup one rank can reach its
# first all-reduce many seconds before another (a fresh process loading its kernels), and a poll takes well under
# a microsecond, so a count large enough for that would be hours. NCCL's own default timeout is ten minutes; an
# engine passes its dist_timeout, which bounds its NCCL and gloo collectives too.
WAIT_LIMIT_S = 600
INT_OF = {2: torch.int16, 4: torch.int32}  # element width -> the integer type whose bits carry it
SENTINEL = {2: -(1 << 15), 4: -(1 << 31)}  # -0.0 of bf16/fp16 and of fp32, read as those integers


def all_reduce_reference(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of every rank's part, in rank order, in fp32, rounded once (what each rank's kernel returns)."""
    total = torch.zeros_like(parts[0], dtype=torch.float32)
    for part in parts:
        total += part.float()
    return total.to(parts[0].dtype)


@jit
def clock_ns(TRAP: tl.constexpr):
    """The GPU's global nanosecond timer (0 under the interpreter, which never traps)."""
    if TRAP:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        return tl.zeros((), dtype=tl.int64)


@jit
def _trap_after(start_ns, LIMIT_NS: tl.constexpr, TRAP: tl.constexpr):
    if TRAP:
        if clock_ns(TRAP) - start_ns > LIMIT_NS:
            tl.inline_asm_elementwise("trap; mov.u64 $0, $1;", "=l,l", [start_ns], dtype=tl.int64, is_pure=False,
                                      pack=1)


@jit
def _push_all_reduce(X, Out, Buffers, Counters, n, slot_size, SENTINEL: tl.constexpr, RANK: tl.constexpr,
                     WORLD: tl.constexpr, BLOCK: tl.constexpr, LIMIT_NS: tl.constexpr, TRAP: tl.constexpr):
    # The buffers travel as addresses, this rank's own too: a tensor argument would be copied back whole after the
    # launch by Triton's interpreter, over the parts peers pushed meanwhile. Addresses loaded from memory have no
    # known alignment, so each buffer access states it (buffers are allocation-aligned, chunks BLOCK-aligned): without
    # it every access compiled to 2-byte loads and stores (sm_90 PTX), with it to 16-byte ones.
    int_ty: tl.constexpr = tl.int32 if X.dtype.element_ty.primitive_bitwidth == 32 else tl.int16
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    calls = tl.load(Counters + pid)
    tl.store(Counters + pid, calls + 1)
    here = (calls % 3).to(tl.int64)
    idle = ((calls + 2) % 3).to(tl.int64)
    x = tl.load(X + offs, mask=live, other=0.0)
    recv = tl.load(Buffers + RANK).to(tl.pointer_type(int_ty))
    bits = x.to(int_ty, bitcast=True)
    bits = tl.where(bits == SENTINEL, 0, bits)  # -0.0 travels as +0.0: the sentinel means "not here yet"
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            remote = tl.load(Buffers + peer).to(tl.pointer_type(int_ty))
            dst = tl.multiple_of(remote + (here * WORLD + RANK) * slot_size + offs, 16)
            tl.store(dst, bits, mask=live)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for src in tl.static_range(WORLD):
        if src == RANK:
            total += x.to(tl.float32)
        else:
            box = tl.multiple_of(recv + (here * WORLD + src) * slot_size + offs, 16)
            got = tl.load(box, mask=live, other=0, volatile=True)
            start_ns = clock_ns(TRAP)
            while tl.max((got == SENTINEL).to(tl.int32), axis=0) > 0:
                got = tl.load(box, mask=live, other=0, volatile=True)
                _trap_after(start_ns, LIMIT_NS, TRAP)
            total += got.to(x.dtype, bitcast=True).to(tl.float32)
            # the whole chunk, past n too: the call that next reads this slot may be wider than this one
            empty = tl.multiple_of(recv + (idle * WORLD + src) * slot_size + offs, 16)
            tl.store(empty, tl.full((BLOCK,), SENTINEL, int_ty))
    tl.store(Out + offs, total.to(x.dtype), mask=live)


def push_all_reduce(x: torch.Tensor, buffers: torch.Tensor, slot_size: int, counters: torch.Tensor, rank: int,
                    world: int, wait_limit_s: float = WAIT_LIMIT_S) -> torch.Tensor:
    """The sum of x over the ranks, new tensor. buffers: int64 [world], each rank's receive buffer's address as this
    device reaches it, a buffer being SLOTS * world * slot_size (a multiple of BLOCK) elements of INT_OF[x's width],
    sentinel-filled at first; counters: int64, at least one per BLOCK of the largest x, zero at first, on every rank
    alike."""
    n = x.numel()
    assert x.element_size() in INT_OF and n <= slot_size and slot_size % BLOCK == 0
    assert -(-n // BLOCK) <= counters.numel()
    x = x.contiguous()
    out = torch.empty_like(x)
    grid = (-(-n // BLOCK),)
    _push_all_reduce[grid](x, out, buffers, counters, n, slot_size, SENTINEL=SENTINEL[x.element_size()],
                           RANK=rank, WORLD=world, BLOCK=BLOCK, LIMIT_NS=int(wait_limit_s * 1e9),
                           TRAP=not triton_interpreted(), num_warps=4)
    return out

