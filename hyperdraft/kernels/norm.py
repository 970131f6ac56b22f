"""RMSNorm, optionally fused with the residual add before it: one Triton launch instead of the ~8 elementwise
kernels (cast, square, mean, add eps, rsqrt, scale, cast, weight) plus the add that eager torch runs.

Rounding follows the reference step by step, so bf16 results match eager torch up to the reduction order: the
residual sum is rounded to the activation dtype (as `x + residual` in that dtype is), the normalised value is
rounded to the activation dtype before the weight multiplies it (as Hugging Face's LlamaRMSNorm does).

Rows may be strided: x is [N, M, D] with any strides on N and M and a contiguous last dim (q/k heads viewed
inside a fused q/k/v projection output), or [N, D]; the outputs are fresh contiguous tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperdraft.kernels._triton import jit, tl, triton
from hyperdraft.kernels.pdl import pdl_args, pdl_wait
from hyperdraft.options import triton_interpreted
from hyperdraft.kernels.rope import write_cos_sin_row


@jit
def _rms_norm(X, R, W, Out, ResOut, stride_xn, stride_xm, stride_rn, num_inner, dim, eps,
              HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    pdl_wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1).to(tl.int64)
    row = n * num_inner + m  # row index into the contiguous outputs
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    x = tl.load(X + n * stride_xn + m * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + n * stride_rn + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(ResOut.dtype.element_ty)
        tl.store(ResOut + row * dim + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:  # Qwen3.5's (1 + w), applied in fp32 before the one rounding
        y = x * inv_rms * (1.0 + w)
    else:
        y = w * (x * inv_rms).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * dim + cols, y.to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, D] or [N, M, D] (last dim contiguous); residual: None or [N, D] -> (normed, new residual).

    With a residual: new residual = x + residual, normed = RMSNorm(new residual). Without: normed = RMSNorm(x)
    and the new residual is x itself (the caller's running sum starts there). zero_centered: scale by (1 + weight)
    in fp32, rounding once at the end (models/hybrid.py's ZeroCenteredRMSNorm)."""
    dim = x.shape[-1]
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    num_rows, num_inner = x3.shape[0], x3.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert x.dim() == 2 and residual.shape == x.shape and residual.stride(-1) == 1
        new_residual = torch.empty_like(out)
    else:
        new_residual = x
    if x.numel() == 0:
        return out, new_residual
    assert x3.stride(-1) == 1, "the last dim must be contiguous"
    block = triton.next_power_of_2(dim)
    _rms_norm[(num_rows, num_inner)](
        x3, residual if residual is not None else x3, weight, out, new_residual, x3.stride(0), x3.stride(1),
        residual.stride(0) if residual is not None else 0, num_inner, dim, eps,
        HAS_RESIDUAL=residual is not None, BLOCK_D=block, num_warps=min(16, max(1, block // 256)), **pdl_args(x.device),
        ZERO_CENTERED=zero_centered,
    )
    return out, new_residual


@jit
def _gated_rms_norm(X, Z, W, Out, stride_xt, stride_xh, stride_zt, num_heads, dim, eps, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    x = tl.load(X + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    normed = (x * inv_rms).to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    weighted = (w * normed).to(Out.dtype.element_ty).to(tl.float32)
    z = tl.load(Z + t * stride_zt + h * dim + cols, mask=mask, other=0.0).to(tl.float32)
    gate = z / (1.0 + tl.exp(-z))
    tl.store(Out + (t * num_heads + h) * dim + cols, (weighted * gate).to(Out.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A Gated DeltaNet's output norm in one launch: x [T, HV, dv] (last dim contiguous), z [T, HV * dv] (any row
    stride: a column block of the fused input projection), weight [dv] -> [T, HV * dv], rounded as
    gated_rms_norm_reference rounds (normalised, cast; weighted, cast; times SiLU(z) in fp32, cast).
    The reference's ~10 elementwise launches per layer measured 0.4 ms of a 9B hybrid's batch-1 step on an H200."""
    num_tokens, heads, dim = x.shape
    assert x.stride(-1) == 1 and z.stride(-1) == 1 and z.shape == (num_tokens, heads * dim)
    out = torch.empty(num_tokens, heads * dim, dtype=x.dtype, device=x.device)
    if num_tokens:
        block = triton.next_power_of_2(dim)
        _gated_rms_norm[(num_tokens, heads)](x, z, weight, out, x.stride(0), x.stride(1), z.stride(0), heads, dim, eps,
                                             BLOCK_D=block, num_warps=max(1, min(4, block // 128)))
    return out


def gated_rms_norm_reference(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's gated RMSNorm (per head of x [T, HV, dv], gated by SiLU(z), z [T, HV * dv]) -> [T, HV * dv]."""
    num_tokens, dim = x.shape[0], x.shape[-1]
    xf = x.reshape(-1, dim).float()
    h = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (h * F.silu(z.reshape(-1, dim).float())).to(x.dtype).view(num_tokens, -1)


@jit
def _embed_hidden_norm(Ids, Table, Hidden, WEmbed, WHidden, Out, Pos, InvFreq, Cos, Sin, stride_ids, stride_h, dim, eps,
                       half, BLOCK_D: tl.constexpr, ROPE: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)  # 0: the token's embedding, 1: the hidden state
    if ROPE and part == 0:  # the step's cos/sin row too: one launch fewer per draft step
        write_cos_sin_row(Pos, InvFreq, Cos, Sin, t, half, BLOCK_HALF, LIBDEVICE)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    if part == 0:
        x = tl.load(Table + tl.load(Ids + t * stride_ids) * dim + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(WEmbed + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(Hidden + t * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(WHidden + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    normed = (x * inv_rms).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + t * 2 * dim + part * dim + cols, (w * normed).to(Out.dtype.element_ty), mask=mask)


def embed_hidden_norm(ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, embed_weight: torch.Tensor,
                      hidden_weight: torch.Tensor, eps: float, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
    """EAGLE-3's layer input in one launch: [RMSNorm(table[ids]), RMSNorm(hidden)] side by side, [T, 2H] (both
    norms round as rms_norm does). ids [T] (any stride: a chain step feeds a column of its token grid); table [V, H]
    contiguous and hidden [T, H] (last dim contiguous) of one dtype. With rope = (positions [T], inv_freq [D/2] fp32)
    the same launch also builds rope_cos_sin(positions, inv_freq, hidden.dtype), bit-identical: -> (x, cos, sin)."""
    num_tokens, dim = hidden.shape
    out = torch.empty(num_tokens, 2 * dim, dtype=hidden.dtype, device=hidden.device)
    assert table.is_contiguous() and table.dtype == hidden.dtype, "table: contiguous, in the hidden states' dtype"
    assert hidden.stride(-1) == 1 and ids.dim() == 1, "hidden: last dim contiguous; ids: [T]"
    positions, inv_freq = rope if rope is not None else (ids, out)  # placeholder pointers without rope
    half = inv_freq.shape[0] if rope is not None else 1
    cos = torch.empty(num_tokens, 1, 2 * half, dtype=hidden.dtype, device=hidden.device) if rope is not None else out
    sin = torch.empty_like(cos) if rope is not None else out
    assert rope is None or (positions.is_contiguous() and inv_freq.is_contiguous() and inv_freq.dtype == torch.float32)
    if num_tokens:
        block = triton.next_power_of_2(dim)
        _embed_hidden_norm[(num_tokens, 2)](ids, table, hidden, embed_weight, hidden_weight, out, positions, inv_freq, cos,
                                            sin, ids.stride(0), hidden.stride(0), dim, eps, half, BLOCK_D=block,
                                            ROPE=rope is not None, BLOCK_HALF=triton.next_power_of_2(half),
                                            LIBDEVICE=not triton_interpreted(), num_warps=min(16, max(1, block // 256)),
                                            **pdl_args(hidden.device))
    return out if rope is None else (out, cos, sin)


def embed_hidden_norm_reference(ids, table, hidden, embed_weight, hidden_weight, eps) -> torch.Tensor:
    return torch.cat((rms_norm_reference(table[ids].to(hidden.dtype), embed_weight, eps)[0],
                      rms_norm_reference(hidden, hidden_weight, eps)[0]), dim=-1)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(dtype), x
