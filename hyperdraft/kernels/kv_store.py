"""Store the new tokens' K and V into one layer of the paged pool: one Triton launch for both, beside the
index_copy_ reference (two launches). A program copies one token's every head.

rope_kv_store also applies the layer's RoPE in the same launch: q rotated in place, k rotated on its way into the
pool (the pool is the only reader of the rotated k). A small model's layer is a chain of ~3-5 us launches, so on
SmolLM2-135M (30 layers) the separate RoPE launch cost ~117 us of GPU time per chain-5 round and ~100 us per plain
decode step on an H100 (benchmarks/results/round_host_h100.md). The rotation's arithmetic is kernels/rope.py's,
so the pool and q hold the same bits as after apply_rope then kv_store.

NewTokens hands the store to the attention launch itself (RuntimeOptions.kv_in_attention): store_head_kv is the
per-head store its programs call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperdraft.kernels._triton import jit, tl, triton
from hyperdraft.kernels.pdl import pdl_args, pdl_wait
from hyperdraft.kernels.rope import apply_rope_reference, rotate_heads_in_place, rotated_dims, rotated_halves


# Extends up to this many tokens a request may store their own K/V (NewTokens): verify and draft widths. Every row
# tile of a request stores the new keys it reads, so a prefill's tiles would each store all the keys before theirs.
NEW_TOKENS_MAX_EXTEND = 16


@dataclass(frozen=True)
class NewTokens:
    """A forward's new tokens, for kernels/attention.py's paged_attention to store into the pool itself: each
    program writes the new keys among those it reads before reading them, so the separate store launch
    (rope_kv_store) goes. Programs that read the same key write the same bits. The pool and the output get the bits
    of that launch followed by paged_attention. For small extends (decode, verify, draft steps): a prefill's row
    tiles would each store every new key before theirs; not for deterministic trees (path), whose programs read keys
    out of position order."""

    k: torch.Tensor  # [T, Hkv, D], last dim contiguous (a view into the q/k/v projection)
    v: torch.Tensor  # [T, Hkv, D], last dim contiguous
    slots: torch.Tensor  # [T] int64: each token's pool slot (its request's page-table entry for its position)
    rope: tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin), [T, R] or [T, 1, R]: rotate q and k; None: rotated


@dataclass(frozen=True)
class NewTokenArgs:
    """NewTokens as kernels/attention.py's _attn_stage1 takes them: its tensors (NewK, NewV, NewSlots, Cos, Sin)
    and its scalars (the k and v token and head strides, half the rotary width); placeholders when nothing is
    stored."""

    tensors: tuple
    scalars: tuple

    @classmethod
    def of(cls, new_tokens: NewTokens | None, q: torch.Tensor, max_extend_len: int, path) -> "NewTokenArgs":
        if new_tokens is None:
            return cls((q,) * 5, (0, 0, 0, 0, 0))
        k, v = new_tokens.k, new_tokens.v
        assert max_extend_len <= NEW_TOKENS_MAX_EXTEND and path is None, "new_tokens: small extends, no path"
        assert k.stride(2) == 1 and v.stride(2) == 1 and k.shape == v.shape and k.shape[0] == q.shape[0]
        cos, sin, half = q, q, 0  # placeholders: k is stored as it is
        if new_tokens.rope is not None:
            rotary = new_tokens.rope[0].shape[-1]
            cos, sin = (t.reshape(-1, rotary) for t in new_tokens.rope)
            assert cos.is_contiguous() and sin.is_contiguous() and rotary % 2 == 0 and rotary <= q.shape[2]
            half = rotary // 2
        return cls((k, v, new_tokens.slots, cos, sin), (k.stride(0), k.stride(1), v.stride(0), v.stride(1), half))


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


@jit
def store_head_kv(K, V, KCache, VCache, Slots, Cos, Sin, tok, kvh, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_cs, stride_ch, stride_vcs, stride_vch, head_dim, half, BLOCK_D: tl.constexpr,
                  ROPE: tl.constexpr):
    """Token tok's k (rotated when ROPE; cos/sin rows of 2 * half) and v of kv head kvh into the pool at Slots[tok]:
    one head of _rope_kv_store's work, the same bits, for kernels that store the keys they are about to read
    (kernels/attention.py, a decode's new tokens)."""
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    slot = tl.load(Slots + tok)
    src = K + tok * stride_kt + kvh * stride_kh
    if ROPE:
        k = rotated_dims(src, Cos + tok * 2 * half, Sin + tok * 2 * half, d, d_ok, half)
    else:
        k = tl.load(src + d, mask=d_ok)
    tl.store(KCache + slot * stride_cs + kvh * stride_ch + d, k.to(KCache.dtype.element_ty), mask=d_ok)
    v = tl.load(V + tok * stride_vt + kvh * stride_vh + d, mask=d_ok)
    tl.store(VCache + slot * stride_vcs + kvh * stride_vch + d, v.to(VCache.dtype.element_ty), mask=d_ok)


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


@jit
def _rope_kv_store(Q, K, V, KCache, VCache, Slots, Cos, Sin, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                   stride_vh, stride_cs, stride_ch, stride_vcs, stride_vch, num_q_heads, num_heads, head_dim, half,
                   BLOCK_HQ: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    rotate_heads_in_place(Q, Cos, Sin, t, stride_qt, stride_qh, num_q_heads, half, BLOCK_HQ, BLOCK_HALF)
    slot = tl.load(Slots + t)
    h = tl.arange(0, BLOCK_H)[:, None]
    first, second = rotated_halves(K, Cos, Sin, t, stride_kt, stride_kh, num_heads, half, BLOCK_H, BLOCK_HALF)
    d_half = tl.arange(0, BLOCK_HALF)[None, :]
    half_mask = (h < num_heads) & (d_half < half)
    dst = KCache + slot * stride_cs + h * stride_ch + d_half
    tl.store(dst, first.to(KCache.dtype.element_ty), mask=half_mask)
    tl.store(dst + half, second.to(KCache.dtype.element_ty), mask=half_mask)
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_heads) & (d < head_dim)
    tail = mask & (d >= 2 * half)  # a partial RoPE's unrotated dims go in as they are
    k_tail = tl.load(K + t * stride_kt + h * stride_kh + d, mask=tail)
    tl.store(KCache + slot * stride_cs + h * stride_ch + d, k_tail.to(KCache.dtype.element_ty), mask=tail)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(VCache + slot * stride_vcs + h * stride_vch + d, v.to(VCache.dtype.element_ty), mask=mask)


def rope_kv_store(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first R dims of each head of q (in place; returned) and k (into the pool only: k itself is left
    as it was), then k and v stored at slots. q: [T, Hq, D], k/v: [T, Hkv, D] (last dims contiguous); cos/sin: [T, R]
    or [T, 1, R], contiguous; k_cache/v_cache: [num_slots, Hkv, D]; slots: [T] int64."""
    num_tokens, num_heads, head_dim = k.shape
    rotary = cos.shape[-1]
    cos, sin = cos.reshape(num_tokens, rotary), sin.reshape(num_tokens, rotary)
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert rotary % 2 == 0 and rotary <= head_dim == q.shape[2]
    if num_tokens == 0:
        return q
    half = rotary // 2
    _rope_kv_store[(num_tokens,)](
        q, k, v, k_cache, v_cache, slots, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), q.shape[1], num_heads,
        head_dim, half, BLOCK_HQ=triton.next_power_of_2(q.shape[1]), BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
        **pdl_args(q.device),
    )
    return q


def rope_kv_store_reference(k_cache, v_cache, slots, q, k, v, cos, sin) -> torch.Tensor:
    """rope_kv_store's contract in eager torch: -> the rotated q (a new tensor; the caller's q is left as it was)."""
    q, k = apply_rope_reference(q, k, cos, sin)
    kv_store_reference(k_cache, v_cache, slots, k, v)
    return q


def kv_store_reference(k_cache, v_cache, slots, k, v) -> None:
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
