"""Linear layers that pick a fast MKL kernel for the few-token products of decoding and verifying on CPU.

`F.linear(x, W)` with x [M, in] asks MKL for sgemm(W, x^T) with the token count M as the *narrow output
dimension*; for M = 1..11 MKL then runs a kernel that reaches only 8-20 GB/s of memory bandwidth on fp32 weights
(measured on AMD EPYC with 2 threads, SmolLM2-135M: 34 ms per token at M = 1, 50-65 ms at M = 2..11). The same
product written as `W @ x^T` puts M on the *other* side of the call, and MKL's kernel for that case streams the
weights at 30-38 GB/s for M = 2..4, so a 4-token verify costs about half of a 1-token F.linear decode. A single
row is the exception: `W @ x^T` with M = 1 becomes a gemv as slow as F.linear, so it is padded to two rows.

From M = 12 up both calls run the same kernel (bit-identical results), so wider inputs keep F.linear. Only CPU
float32 takes this path: CUDA, half precision and autograd callers get plain F.linear. Results differ from
F.linear by float32 rounding only (another summation order), the same order of difference as between two M.

Caveat: MKL's gemv for M = 1 runs on one thread, this path on all intra-op threads. When another process keeps a
core busy, every product then waits for a descheduled OpenMP thread (measured: 15 ms -> 0.2-2 s per forward with
a busy-loop on one of two cores), where F.linear's single-thread decode only loses its share of the core.

`fuse_rows` packs projections that read the same input (q/k/v, gate/up) into one weight buffer whose row
slices become the modules' own parameters, so `project` runs them as one product: fewer, larger products
stream the weights faster and cost fewer parallel regions per layer (about 1.2 ms of a 17 ms SmolLM2 decode).
CUDA models are packed the same way and run each group as one product (kernels/gemv.py's GEMV for a few rows,
F.linear above); CPU products of 12+ rows still run
per projection, so CPU prefill keeps its numerics.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyperdraft import options
from hyperdraft.kernels.activation import silu_mul, silu_mul_reference
from hyperdraft.kernels.gemv import cuda_linear, finish_product, silu_mul_gemv, silu_mul_gemv_fits
from hyperdraft.models.cpu_packed import PACKED_MIN_ROWS, BlockedWeight, packing_available

logger = logging.getLogger("hyperdraft")

# Up to this many rows, `W @ x^T` beats F.linear (by 1.2-3x at 2..8 rows, 1.2-1.4x at 9..11); from 12 rows on MKL
# picks the same kernel for both.
SKINNY_MAX_ROWS = 11


def uses_skinny_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Cheapest tests first: this runs for every projection of every step (about 120 per SmolLM2 forward).
    width = x.shape[-1]
    return (x.is_cpu and 0 < x.numel() <= SKINNY_MAX_ROWS * width and x.dtype == torch.float32
            and weight.dtype == torch.float32 and options.current().skinny_cpu_linear  # off: A/B against F.linear
            and not ((x.requires_grad or weight.requires_grad) and torch.is_grad_enabled()))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                  blocked: BlockedWeight | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) (+ residual, then cast to out_dtype) for x [..., in]; the fast orientation when
    uses_skinny_path holds, and on CUDA the few-row Triton GEMV (kernels/gemv.py), which adds the residual and
    stores out_dtype in the same launch. blocked: weight's blocked copy (models/cpu_packed.py), which the rows it
    takes run through."""
    if x.is_cuda:
        return cuda_linear(x, weight, bias, residual, out_dtype)
    if residual is not None or out_dtype is not None:
        return finish_product(skinny_linear(x, weight, bias, blocked=blocked), residual, out_dtype)
    if blocked is not None and blocked.takes(x, weight):
        return blocked.product(x)
    if not uses_skinny_path(x, weight):
        return F.linear(x, weight, bias)
    flat = x.dim() == 2 and x.is_contiguous()
    rows = x if flat else x.reshape(-1, x.shape[-1]).contiguous()  # the fast kernel needs row-major rows, seen as x^T
    m = rows.shape[0]
    if m == 1:
        rows = torch.cat([rows, rows])  # two rows take the fast kernel; one would be a slow gemv
    out = torch.mm(weight, rows.t()) if bias is None else torch.addmm(bias[:, None], weight, rows.t())  # [out, m]
    out = transposed(out[:, :1] if m == 1 else out)
    return out if flat else out.view(*x.shape[:-1], weight.shape[0])


def transposed(columns: torch.Tensor) -> torch.Tensor:
    """[n, m] (m a few rows' outputs side by side) -> a contiguous [m, n]. torch's copy of the transposed view took
    310 us for SmolLM2's logits (n = 49152, m = 4) and 23 us for its gate/up product (n = 3072) on a 2-core EPYC, and
    inside a four-row verify 2.7 ms and 80 us (profiled: 5.7 ms of a 41 ms forward); stacking the columns takes 66 and
    12 us (numpy's copy 63 and 7, but a .numpy() reads as a host sync to the step's sync check). Below ~1000 outputs
    (576 x 4: 6.5 against 3.9 us) the plain copy wins."""
    if columns.shape[1] == 1 or columns.shape[0] < 1024:
        return columns.t().contiguous()
    return torch.stack(columns.unbind(1))


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict names) whose forward uses skinny_linear."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_rows: FusedRows | None = None  # set by fuse_rows on the first of the projections it packs
        self.blocked: BlockedWeight | None = None  # the weight's blocked copy, set by pack_for_verify

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W^T + b, plus residual ([..., out]) when given, cast to out_dtype when given."""
        return skinny_linear(x, self.weight, self.bias, residual, out_dtype, self.blocked)

    def blocked_copy(self) -> BlockedWeight:
        """This projection's blocked copy (models/cpu_packed.py): the weight and the bias its product adds."""
        return BlockedWeight.of(self.weight, self.bias)

    def forward_silu_mul(self, gate: torch.Tensor, up: torch.Tensor, residual: torch.Tensor | None = None,
                         fused: bool = False) -> torch.Tensor:
        """self(SiLU(gate) * up, residual): fused (CUDA kernels) takes the activation's kernel, or for one row the
        product's own launch (kernels/gemv.py silu_mul_gemv, bit for bit the same); else the torch reference."""
        if fused and silu_mul_gemv_fits(gate, up, self.weight):
            return silu_mul_gemv(gate, up, self.weight, self.bias, residual)
        return self((silu_mul if fused else silu_mul_reference)(gate, up), residual)


@dataclass
class FusedRows:
    """One weight buffer [sum(sizes), in] whose row blocks are the parameters of several projections."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: list[int]
    ptrs: list[int]  # where each projection's weight and bias start inside the buffers, to notice a swap
    blocked: BlockedWeight | None = None  # weight's blocked copy, set by pack_for_verify

    def blocked_copy(self) -> BlockedWeight:
        return BlockedWeight.of(self.weight, self.bias)


def fuse_rows(*linears: Linear) -> None:
    """Re-point the projections' weights (and biases) at row blocks of one fresh contiguous buffer. The modules
    keep their parameters and state-dict names; only the storage is shared. Does nothing unless every
    projection has the same input width, device and dtype, and all or none have a bias."""
    weights = [lin.weight for lin in linears]
    biases = [lin.bias for lin in linears]
    if len({(w.shape[1], w.device, w.dtype) for w in weights}) != 1 or len({b is None for b in biases}) != 1:
        return
    with torch.no_grad():
        weight = torch.cat([w.detach() for w in weights]).contiguous()
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
    sizes = [w.shape[0] for w in weights]
    for i, lin in enumerate(linears):
        rows = slice(sum(sizes[:i]), sum(sizes[: i + 1]))
        lin.weight = nn.Parameter(weight[rows], requires_grad=lin.weight.requires_grad)
        if bias is not None:
            lin.bias = nn.Parameter(bias[rows], requires_grad=lin.bias.requires_grad)
    linears[0].fused_rows = FusedRows(weight, bias, sizes, _pointers(linears))


def _pointers(linears) -> list[int]:
    return [t.data_ptr() for lin in linears for t in (lin.weight, lin.bias) if t is not None]


def packed(*linears: Linear) -> FusedRows | None:
    """The one buffer fuse_rows packed these projections into, while they still share it (a later .to() or
    parameter swap gives them their own storage again), else None."""
    fused = linears[0].fused_rows
    return fused if fused is not None and _pointers(linears) == fused.ptrs else None


def project(x: torch.Tensor, *linears: Linear) -> tuple[torch.Tensor, ...]:
    """(lin(x) for lin in linears), as one product when fuse_rows packed them (else each runs alone). On CUDA the
    packed product is one launch instead of two or three: the small k/v GEMVs alone stream their weights well
    below bandwidth."""
    fused = packed(*linears)
    if fused is not None:
        takes_blocked = fused.blocked is not None and fused.blocked.takes(x, fused.weight)
        if takes_blocked or uses_skinny_path(x, linears[0].weight):
            return skinny_linear(x, fused.weight, fused.bias, blocked=fused.blocked).split(fused.sizes, -1)
        if x.is_cuda:
            return cuda_linear(x, fused.weight, fused.bias).split(fused.sizes, -1)
    return tuple(lin(x) for lin in linears)


def fuse_projections(layers) -> None:
    """fuse_rows over each decoder layer's projections of one input: q/k/v (or a Gated DeltaNet's q|k|v, z, b, a)
    and gate/up (see the module doc and `project`)."""
    for layer in layers:
        for group in layer.fused_projection_groups():
            fuse_rows(*group)


def pack_for_verify(models: list[nn.Module | None], verify_rows: int, device: torch.device) -> int:
    """Give the fp32 CPU projections of these models (a target and its drafter) their blocked copies
    (models/cpu_packed.py) when a verify feeds PACKED_MIN_ROWS rows or more and the copies fit in half the free
    memory -> bytes of copies made (0: none)."""
    if device.type != "cpu" or verify_rows < PACKED_MIN_ROWS or not packing_available():
        return 0
    owners = _weight_owners([m for m in models if m is not None])
    total = sum(weight.numel() * weight.element_size() for _, weight in owners)
    free = _free_memory()
    if free is None or 2 * total > free:
        logger.info("verify weights not blocked: %.0f MB of copies, %s MB free", total / 2**20,
                    "unknown" if free is None else f"{free / 2**20:.0f}")
        return 0
    for owner, _ in owners:
        owner.blocked = owner.blocked_copy()
    return total


def _weight_owners(models: list[nn.Module]) -> list[tuple[Linear | FusedRows, torch.Tensor]]:
    """(holder of a blocked copy, the weight it copies) for each fp32 CPU projection not blocked yet: a live fused
    group's buffer once, every other Linear alone; a module two models share (a head's borrowed lm_head) once."""
    linears = {id(m): m for model in models for m in model.modules() if isinstance(m, Linear)}.values()
    linears = [m for m in linears if m.weight.is_cpu and m.weight.dtype == torch.float32]
    groups = [m.fused_rows for m in linears if m.fused_rows is not None and m.weight.data_ptr() == m.fused_rows.ptrs[0]]
    in_groups = {ptr for group in groups for ptr in group.ptrs}
    owners = [(g, g.weight) for g in groups if g.blocked is None]
    owners += [(m, m.weight) for m in linears if m.weight.data_ptr() not in in_groups and m.blocked is None]
    return owners


def _free_memory() -> int | None:
    """Bytes of physical memory free now, or None where the platform does not say (then nothing is copied)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no os.sysconf (Windows), or no such name (macOS)
        return None
