"""Accepted-path compaction: after a tree verify, move the K/V of the accepted nodes to the contiguous
sequence indices right after the committed prefix.

Everything is addressed by sequence index through the PageTable, never by page, so it works for any
page_size, including a page shared by the accepted prefix and rejected nodes. The scheduler's
rollback-by-length then releases whatever lies past the new length. Chains need no move: node j already
sits at index n + j.
"""

from __future__ import annotations

import torch

from hyperdraft.kvcache.kv_pool import KVPool
from hyperdraft.kvcache.page_table import PageTable


def compact_accepted(pool: KVPool, page_table: PageTable, rows: torch.Tensor, base: torch.Tensor,
                     src_offsets: torch.Tensor, count: torch.Tensor) -> None:
    """For each request b and j < count[b], copy the K/V at sequence index base[b] + src_offsets[b, j] to index
    base[b] + j (every layer). Entries j >= count[b] are left alone.
    rows, base, count: [B] int64; src_offsets: [B, D] int64 (entries past count may be -1)."""
    j = torch.arange(src_offsets.shape[1], device=src_offsets.device)
    dst = base[:, None] + j
    src = torch.where(j < count[:, None], base[:, None] + src_offsets, dst)  # unused entries copy onto themselves
    pool.move(page_table.slots(rows, dst).flatten(), page_table.slots(rows, src).flatten())


def leading_fed_count(fed_on_path: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """fed_on_path: [B, D+1] the draft's fed offset of each accepted-path node (root first), -1 if the draft
    never fed it -> [B] how many accepted nodes below the root the draft holds K/V for, counting from the top."""
    j = torch.arange(fed_on_path.shape[1], device=fed_on_path.device)
    ok = (fed_on_path >= 0) & (j <= num_accepted[:, None])
    return ok[:, 1:].long().cumprod(1).sum(1)
