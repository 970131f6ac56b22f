"""SiLU(gate) * up, the gated MLP's activation, in one Triton launch (eager torch runs two, and the gate and up
halves of a fused gate/up projection output would otherwise be read twice).

The SiLU result is rounded to the activation dtype before the product, as `F.silu(gate) * up` rounds it.
gate and up are [T, I] with any row stride and a contiguous last dim (two views into one [T, 2I] output).
"""

from __future__ import annotations

import torch

from hyperdraft.kernels._triton import jit, tl, triton
from hyperdraft.kernels.pdl import pdl_args, pdl_wait

BLOCK = 1024


@jit
def _silu_mul(Gate, Up, Out, stride_g, stride_u, width, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(Gate + t * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(Up + t * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + t * width + cols, (act * u).to(Out.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up: [T, I] -> SiLU(gate) * up, [T, I] contiguous."""
    assert gate.shape == up.shape and gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1
    num_tokens, width = gate.shape
    out = torch.empty((num_tokens, width), dtype=gate.dtype, device=gate.device)
    if out.numel():
        _silu_mul[(num_tokens, triton.cdiv(width, BLOCK))](gate, up, out, gate.stride(0), up.stride(0), width,
                                                            BLOCK=BLOCK, num_warps=4, **pdl_args(gate.device))
    return out


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up
