"""Store the new tokens' K and V into one layer of the paged pool: one Triton launch for both, beside the
index_copy_ reference (two launches). A program copies one token's every head."""

from __future__ import annotations

import torch

from hyperdraft.kernels._triton import jit, tl, triton
from hyperdraft.kernels.pdl import pdl_args, pdl_wait


@jit
def _kv_store(K, V, KCache, VCache, Slots, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
              stride_vcs, stride_vch, num_heads, head_dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
              PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(KCache + slot * stride_cs + h * stride_ch + d, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + slot * stride_vcs + h * stride_vch + d, v.to(VCache.dtype.element_ty), mask=mask)


def kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache/v_cache: [num_slots, Hkv, D] (one layer); slots: [T] int64; k/v: [T, Hkv, D] (last dim contiguous)."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _kv_store[(num_tokens,)](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), num_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
        **pdl_args(k.device),
    )


def kv_store_reference(k_cache, v_cache, slots, k, v) -> None:
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
