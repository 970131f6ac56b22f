"""SiLU(gate) * up, the gated MLP's activation, in one Triton launch (eager torch runs two, and the gate and up
halves of a fused gate/up projection output would otherwise be read twice); and the gated attention's output gate,
x * sigmoid(gate), in one (eager torch runs three: a copy of the strided gate, the sigmoid, the product).

The SiLU result is rounded to the activation dtype before the product, as `F.silu(gate) * up` rounds it.
gate and up are [T, I] with any row stride and a contiguous last dim (two views into one [T, 2I] output).
"""

from __future__ import annotations

import torch

from hyperdraft.kernels._triton import jit, libdevice, tl, triton
from hyperdraft.kernels.pdl import pdl_args, pdl_wait
from hyperdraft.options import triton_interpreted

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


@jit
def _sigmoid_gate_mul(X, Gate, Out, stride_xt, stride_xh, stride_gt, stride_gh, num_heads, head_dim,
                      BLOCK_D: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < head_dim
    x = tl.load(X + t * stride_xt + h * stride_xh + d, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(Gate + t * stride_gt + h * stride_gh + d, mask=mask, other=0.0).to(tl.float32)
    # torch.sigmoid: 1 / (1 + expf(-g)) in fp32, the math library's expf and an IEEE division (Triton's exp and `/`
    # are approximations), rounded to the activation dtype before the product; the interpreter has no libdevice
    e = libdevice.exp(-g) if LIBDEVICE else tl.exp(-g)
    sig = tl.math.div_rn(tl.full([BLOCK_D], 1.0, tl.float32), 1.0 + e).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + (t * num_heads + h) * head_dim + d, (x * sig).to(Out.dtype.element_ty), mask=mask)


def sigmoid_gate_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, gate: [T, H, D] with any token and head strides (gate: the second half of each head's q|gate slice of
    the q projection output) -> x * sigmoid(gate), [T, H * D] contiguous."""
    assert x.shape == gate.shape and x.dim() == 3 and x.stride(2) == 1 and gate.stride(2) == 1
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty((num_tokens, num_heads * head_dim), dtype=x.dtype, device=x.device)
    if out.numel():
        block = triton.next_power_of_2(head_dim)
        _sigmoid_gate_mul[(num_tokens, num_heads)](
            x, gate, out, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), num_heads, head_dim, BLOCK_D=block,
            LIBDEVICE=not triton_interpreted(), num_warps=max(1, min(4, block // 256)), **pdl_args(x.device))
    return out


def sigmoid_gate_mul_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    t = x.shape[0]
    return x.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
