"""The accepted-path compaction copy: every layer's K and V from src slots to dst slots.

Sources and destinations overlap (an accepted node's new index can be another accepted node's old one), so
the copy is two launches, each over all layers and both of K and V: gather every source row into a scratch
buffer, then scatter it. Within one launch no program reads what another writes.
"""

from __future__ import annotations

import torch

from hyperdraft.kernels._triton import jit, tl, triton

BLOCK = 1024


@jit
def _kv_rows(KPool, VPool, Slots, Scratch, num_moves, stride_layer, stride_slot, row_elems,
             GATHER: tl.constexpr, BLOCK: tl.constexpr):
    """Program (j, layer, chunk): pool row of slot j <-> scratch[0 or 1 (K or V), layer, j]."""
    j = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = e < row_elems
    pool_off = layer * stride_layer + tl.load(Slots + j) * stride_slot + e
    k_off = (layer * num_moves + j) * row_elems + e
    v_off = k_off + tl.num_programs(1).to(tl.int64) * num_moves * row_elems
    if GATHER:
        tl.store(Scratch + k_off, tl.load(KPool + pool_off, mask=mask), mask=mask)
        tl.store(Scratch + v_off, tl.load(VPool + pool_off, mask=mask), mask=mask)
    else:
        tl.store(KPool + pool_off, tl.load(Scratch + k_off, mask=mask), mask=mask)
        tl.store(VPool + pool_off, tl.load(Scratch + v_off, mask=mask), mask=mask)


def kv_move(k_pool: torch.Tensor, v_pool: torch.Tensor, dst_slots: torch.Tensor, src_slots: torch.Tensor) -> None:
    """k_pool/v_pool: [L, slots, Hkv, D] contiguous, same layout; dst_slots/src_slots: [N] int64."""
    num_layers, _, num_heads, head_dim = k_pool.shape
    n = dst_slots.shape[0]
    if n == 0:
        return
    row = num_heads * head_dim
    scratch = torch.empty(2, num_layers, n, row, dtype=k_pool.dtype, device=k_pool.device)
    grid = (n, num_layers, triton.cdiv(row, BLOCK))
    for slots, gather in ((src_slots, True), (dst_slots, False)):
        _kv_rows[grid](k_pool, v_pool, slots, scratch, n, k_pool.stride(0), k_pool.stride(1), row,
                       GATHER=gather, BLOCK=BLOCK, num_warps=4)


def kv_move_reference(k_pool, v_pool, dst_slots, src_slots) -> None:
    k_pool[:, dst_slots] = k_pool[:, src_slots]  # advanced indexing gathers into a new tensor first
    v_pool[:, dst_slots] = v_pool[:, src_slots]
