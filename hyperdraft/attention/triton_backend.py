"""Triton paged attention on CUDA: the default backend there.

It reads only the ForwardBatch's device tensors and static bounds, never its host lists, so plan + every
layer's forward can be captured in a CUDA graph and replayed after the same tensors are refilled in place:
no host sync, no data-dependent shapes, launch grids from tensor shapes and max_extend_len / max_seq_len only.
Kernels live in hyperdraft/kernels (each beside its torch reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperdraft.attention.base import AttentionBackend
from hyperdraft.core.forward_batch import ForwardBatch
from hyperdraft import options
from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels.attention import paged_attention
from hyperdraft.kernels.attention_tiles import (Tiles, attention_workspace, invariant_num_splits, invariant_tiles,
                                                num_kv_splits, num_row_tiles, split_tiles, tail_paths, tile_config)
from hyperdraft.kernels.kv_store import NEW_TOKENS_MAX_EXTEND, NewTokens, kv_store, rope_kv_store
from hyperdraft.kernels.rope import apply_rope_reference


@dataclass
class TritonAttentionMeta:
    req_rows: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    extend_starts: torch.Tensor  # [B] int32
    extend_lens: torch.Tensor  # [B] int32
    tail_mask: torch.Tensor | None  # [B, Q, W] bool, or None = causal
    max_extend_len: int  # static bound: sizes the row tiles
    max_seq_len: int  # static bound: sizes the key splits
    invariant: bool  # deterministic mode: batch-invariant tiles and splits (kernels/attention.py)
    path: tuple[torch.Tensor, torch.Tensor] | None  # deterministic trees: tail_paths(tail_mask)
    # Filled by the first layer (the query head count is known only there) and reused by every later one.
    num_splits: int = 0
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None
    tiles: Tiles | None = None


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, pool, page_table):
        super().__init__(pool, page_table)
        self.num_sms = torch.cuda.get_device_properties(pool.k.device).multi_processor_count

    def plan(self, fb: ForwardBatch) -> TritonAttentionMeta:
        if fb.seq_lens_t is None or fb.extend_starts_t is None or fb.extend_lens_t is None:
            raise ValueError("the triton attention backend needs ForwardBatch.seq_lens_t, extend_starts_t and "
                             "extend_lens_t (build it with build_forward_batch)")
        # The kernels index these with stride 1: a strided view would read other fields (a no-op when contiguous).
        deterministic = options.current().deterministic
        path = tail_paths(fb.tail_mask) if deterministic and fb.tail_mask is not None else None
        return TritonAttentionMeta(fb.req_rows.contiguous(), fb.seq_lens_t.contiguous(), fb.extend_starts_t.contiguous(),
                                   fb.extend_lens_t.contiguous(), fb.tail_mask, fb.max_extend_len, fb.max_seq_len,
                                   deterministic, path)

    def forward(self, layer_id, q, k, v, fb, meta: TritonAttentionMeta, rope=None):
        k_cache, v_cache = self.pool.layer(layer_id)
        new_tokens = None
        if meta.max_extend_len <= NEW_TOKENS_MAX_EXTEND and meta.path is None and options.current().kv_in_attention:
            new_tokens = NewTokens(k, v, fb.out_slots, rope)  # stored by the attention launch itself
        elif rope is not None and use_fused_kernels(q):  # RoPE in the store's launch: one launch per layer less
            q = rope_kv_store(k_cache, v_cache, fb.out_slots, q, k, v, *rope)
        else:
            if rope is not None:
                q, k = apply_rope_reference(q, k, *rope)
            kv_store(k_cache, v_cache, fb.out_slots, k, v)
        if meta.num_splits == 0:
            self._size_splits(meta, q)
        return paged_attention(
            q, k_cache, v_cache, self.page_table.table, meta.req_rows, meta.seq_lens, meta.extend_starts,
            meta.extend_lens, page_size=self.page_table.page_size, max_extend_len=meta.max_extend_len,
            tail_mask=meta.tail_mask, num_splits=meta.num_splits, workspace=meta.workspace, tiles=meta.tiles,
            path=meta.path, invariant=meta.invariant, new_tokens=new_tokens,
        )

    def _size_splits(self, meta: TritonAttentionMeta, q: torch.Tensor) -> None:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = self.pool.k.shape[2]
        group = num_heads // num_kv_heads
        if meta.invariant:  # batch-invariant: fixed tiles, splits at fixed key positions (kernels/attention.py)
            meta.num_splits = invariant_num_splits(meta.max_extend_len, meta.max_seq_len)
            meta.tiles = invariant_tiles(group, head_dim, q.dtype)
            meta.workspace = attention_workspace(num_tokens, num_heads, head_dim, meta.num_splits, q.device)
            return
        tiles = tile_config(group, meta.max_extend_len, head_dim, q.dtype)
        row_tiles = num_row_tiles(group, meta.max_extend_len, tiles.m)
        meta.num_splits = num_kv_splits(meta.req_rows.shape[0], num_kv_heads, row_tiles, meta.max_seq_len, self.num_sms)
        meta.tiles = split_tiles(tiles, meta.max_seq_len, meta.num_splits)
        meta.workspace = attention_workspace(num_tokens, num_heads, head_dim, meta.num_splits, q.device)
