"""Rotary position embedding applied in place to q and k, one Triton launch for both (eager torch runs about
six kernels per tensor: two products, a negation, a concatenation, a sum, and the copies between them); and the
cos/sin table of a forward's positions, one launch instead of six (a product, a concatenation, cos, sin, two casts:
~10 us per forward, paid by every draft step of a speculative round).

Rounding follows `x * cos + rotate_half(x) * sin` in the activation dtype: each product is rounded, then the sum.
q: [T, Hq, D], k: [T, Hkv, D] with any token and head strides and a contiguous last dim (views into a fused
q/k/v output); cos, sin: [T, R] in the activation dtype, as DecoderLM.rope builds them (two equal halves). R = D for
most models; a partial RoPE (Qwen3.5: R = D / 4) rotates the first R dims of each head and leaves the rest as they
are, in place too (the torch path slices, rotates and concatenates: two more copies per tensor).
"""

from __future__ import annotations

import torch

from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels._triton import jit, libdevice, tl, triton

from hyperdraft.kernels.pdl import pdl_args, pdl_wait
from hyperdraft.options import triton_interpreted


@jit
def rotated_halves(X, Cos, Sin, t, stride_t, stride_h, num_heads, half, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    """Dims [0, 2 * half) of each head of token t, rotated -> (first half, second half) [BLOCK_H, BLOCK_HALF] in
    X's dtype (rows and columns past num_heads and half are zeros)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (d < half)
    heads, row = X + t * stride_t + h * stride_h, t * 2 * half
    return (rotated_dims(heads, Cos + row, Sin + row, d, mask, half),
            rotated_dims(heads, Cos + row, Sin + row, d + half, mask, half))


@jit
def rotated_dims(X, CosRow, SinRow, d, mask, half):
    """Dims d of the head(s) at X rotated: x * cos - partner * sin in the first half, x * cos + partner * sin in the
    second (partner: the dim half away), each product rounded to X's dtype, then the sum, as `x * cos +
    rotate_half(x) * sin` rounds in eager torch. X points at each head's dim 0 (a scalar or a column of pointers,
    broadcast against d), CosRow/SinRow at the token's table row(s). Dims >= 2 * half (a partial RoPE's tail) come
    back as they are; masked-off dims as 0. For kernels that rotate what they load (kernels/attention.py)."""
    rot = d < 2 * half
    first = d < half
    x = tl.load(X + d, mask=mask, other=0.0)
    partner = tl.load(X + tl.where(first, d + half, d - half), mask=mask & rot, other=0.0).to(tl.float32)
    c = tl.load(CosRow + d, mask=mask & rot, other=0.0).to(tl.float32)
    s = tl.load(SinRow + d, mask=mask & rot, other=0.0).to(tl.float32)
    own = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
    other = (partner * s).to(x.dtype).to(tl.float32)
    return tl.where(rot, tl.where(first, own - other, own + other).to(x.dtype), x)


@jit
def rotate_heads_in_place(X, Cos, Sin, t, stride_t, stride_h, num_heads, half, BLOCK_H: tl.constexpr,
                          BLOCK_HALF: tl.constexpr):
    """Rotates dims [0, 2 * half) of each head of token t; a partial RoPE's dims past them are never touched."""
    first, second = rotated_halves(X, Cos, Sin, t, stride_t, stride_h, num_heads, half, BLOCK_H, BLOCK_HALF)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    ptr = X + t * stride_t + h * stride_h + d
    mask = (h < num_heads) & (d < half)
    tl.store(ptr, first, mask=mask)
    tl.store(ptr + half, second, mask=mask)


@jit
def _rope(Q, K, Cos, Sin, stride_qt, stride_qh, stride_kt, stride_kh, num_q_heads, num_k_heads, half,
          BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    rotate_heads_in_place(Q, Cos, Sin, t, stride_qt, stride_qh, num_q_heads, half, BLOCK_HQ, BLOCK_HALF)
    rotate_heads_in_place(K, Cos, Sin, t, stride_kt, stride_kh, num_k_heads, half, BLOCK_HK, BLOCK_HALF)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first R dims of each head of q and k in place (R = D but for a partial RoPE); returns them.
    cos/sin: [T, R] (or [T, 1, R]), contiguous."""
    num_tokens, num_q_heads, head_dim = q.shape
    rotary = cos.shape[-1]
    cos, sin = cos.reshape(num_tokens, rotary), sin.reshape(num_tokens, rotary)
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert rotary % 2 == 0 and rotary <= head_dim == k.shape[2]
    if num_tokens:
        half = rotary // 2
        _rope[(num_tokens,)](
            q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), num_q_heads, k.shape[1], half,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(half), num_warps=4, **pdl_args(q.device),
        )
    return q, k


@jit
def _rope_cos_sin(Pos, InvFreq, Cos, Sin, half, BLOCK_HALF: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    write_cos_sin_row(Pos, InvFreq, Cos, Sin, tl.program_id(0).to(tl.int64), half, BLOCK_HALF, LIBDEVICE)


@jit
def write_cos_sin_row(Pos, InvFreq, Cos, Sin, t, half, BLOCK_HALF: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Row t of the cos/sin table (also called from other kernels that have a program per token)."""
    d = tl.arange(0, BLOCK_HALF)
    mask = d < half
    angle = tl.load(Pos + t).to(tl.float32) * tl.load(InvFreq + d, mask=mask, other=0.0)
    # libdevice: the CUDA math library's precise cosf/sinf, as torch's cos/sin kernels compute them (tl.cos may
    # lower to the approximate hardware instruction); the CPU interpreter has only tl.cos/tl.sin
    if LIBDEVICE:
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    else:
        cos, sin = tl.cos(angle), tl.sin(angle)
    cos = cos.to(Cos.dtype.element_ty)
    sin = sin.to(Sin.dtype.element_ty)
    row = t * 2 * half
    tl.store(Cos + row + d, cos, mask=mask)
    tl.store(Cos + row + half + d, cos, mask=mask)
    tl.store(Sin + row + d, sin, mask=mask)
    tl.store(Sin + row + half + d, sin, mask=mask)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (int), inv_freq [D/2] fp32 -> (cos, sin), each [T, 1, D] in dtype: the angles position *
    inv_freq in fp32, repeated over both halves, then cos/sin rounded to dtype (as rope_cos_sin_reference)."""
    num_tokens, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(num_tokens, 1, 2 * half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    assert positions.is_contiguous() and inv_freq.is_contiguous() and inv_freq.dtype == torch.float32
    if num_tokens:
        _rope_cos_sin[(num_tokens,)](positions, inv_freq, cos, sin, half, BLOCK_HALF=triton.next_power_of_2(half),
                                     LIBDEVICE=not triton_interpreted(), num_warps=1, **pdl_args(positions.device))
    return cos, sin


def rope_cos_sin_reference(positions: torch.Tensor, inv_freq: torch.Tensor,
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2], fp32 like HF
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The models' entry: the kernel on CUDA, the reference elsewhere."""
    if use_fused_kernels(positions) and positions.is_contiguous():
        return rope_cos_sin(positions, inv_freq.float(), dtype)
    return rope_cos_sin_reference(positions, inv_freq, dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place. cos/sin: [T, 1, R] (or [T, R]); the first R dims of each head rotate, the rest pass through."""
    cos, sin = cos.reshape(cos.shape[0], 1, -1), sin.reshape(sin.shape[0], 1, -1)
    rotary = cos.shape[-1]
    if rotary == q.shape[-1]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    q_rot, k_rot = apply_rope_reference(q[..., :rotary], k[..., :rotary], cos, sin)
    return torch.cat([q_rot, q[..., rotary:]], dim=-1), torch.cat([k_rot, k[..., rotary:]], dim=-1)
