"""Accepted-path compaction: after a tree verify, move the K/V of the accepted nodes to the contiguous
sequence indices right after the committed prefix.

Everything is addressed by sequence index through the PageTable, never by page, so it works for any
page_size, including a page shared by the accepted prefix and rejected nodes. The scheduler's
rollback-by-length then releases whatever lies past the new length. Chains need no move: node j already
sits at index n + j.
"""

from __future__ import annotations

import torch

from hyperdraft.kernels.tree_round import TreeAccept
from hyperdraft.kvcache.kv_pool import KVPool
from hyperdraft.kvcache.page_table import PageTable


def compact_accepted(pool: KVPool, moves: torch.Tensor) -> None:
    """moves: [2, M] (dst, src) slots, as compaction_moves makes them: copy every layer's K/V from src to dst."""
    pool.move(moves[0], moves[1])


def compaction_moves(page_table: PageTable, rows: torch.Tensor, base: torch.Tensor, src_offsets: torch.Tensor,
                     count: torch.Tensor, dst_slots: torch.Tensor | None = None) -> torch.Tensor:
    """For each request b and j < count[b]: the K/V at sequence index base[b] + src_offsets[b, j] goes to index
    base[b] + j. Entries j >= count[b] copy onto themselves.
    rows, base, count: [B] int64; src_offsets: [B, D] int64 (entries past count may be -1); dst_slots: [B, D], the
    slots of base + j when the caller has them -> [2, B*D] (dst, src) slots."""
    dst = base[:, None] + torch.arange(src_offsets.shape[1], device=src_offsets.device)
    src = torch.where(dst < (base + count)[:, None], base[:, None] + src_offsets, dst)
    dst_slots = page_table.slots(rows, dst) if dst_slots is None else dst_slots
    return torch.stack([dst_slots.flatten(), page_table.slots(rows, src).flatten()])


def leading_fed_count(fed_on_path: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """fed_on_path: [B, D+1] the draft's fed offset of each accepted-path node (root first), -1 if the draft
    never fed it -> [B] how many accepted nodes below the root the draft holds K/V for, counting from the top."""
    j = torch.arange(fed_on_path.shape[1], device=fed_on_path.device)
    ok = (fed_on_path >= 0) & (j <= num_accepted[:, None])
    return ok[:, 1:].long().cumprod(1).sum(1)


def accept_plan(num_accepted: torch.Tensor, path: torch.Tensor, tokens: torch.Tensor, fed: torch.Tensor,
                room: torch.Tensor, base: torch.Tensor, rows: torch.Tensor, page_table: PageTable,
                compacts_draft: bool = True) -> TreeAccept:
    """A tree walk's result (num_accepted [B], path and tokens [B, D+1]) with what the commit applies: the target's
    compaction, the drafter's (only the path nodes it fed, within its reserved room, counting from the top), the
    last accepted node, the drafter's last kept node's scratch entry, and each path node's verify row. fed [B, N]:
    the drafter's fed offset of each node (-1: never fed); room, base, rows: [B]. compacts_draft False: no draft
    moves (None), for a drafter that keeps no tree K/V. The torch reference of kernels/tree_round.accept_tree, which
    returns the same (draft moves always) from one launch."""
    n = fed.shape[1]
    on_path = path.clamp_min(0)
    fed_on_path = fed.gather(1, on_path)
    fed_on_path = torch.where(fed_on_path <= room[:, None], fed_on_path, -1)
    draft_kv_valid = leading_fed_count(fed_on_path, num_accepted)
    last_node = path.gather(1, num_accepted[:, None])[:, 0]
    last_fed = fed_on_path.gather(1, draft_kv_valid[:, None])[:, 0].clamp_min(0) - 1
    hidden_rows = torch.arange(len(rows), device=path.device)[:, None] * n + on_path
    target_moves = compaction_moves(page_table, rows, base, on_path, num_accepted + 1)
    draft_moves = None
    if compacts_draft:  # to the same destinations
        draft_moves = compaction_moves(page_table, rows, base, fed_on_path.clamp_min(0), 1 + draft_kv_valid,
                                       dst_slots=target_moves[0].view_as(path))
    return TreeAccept(num_accepted, path, tokens, draft_kv_valid, target_moves, draft_moves, last_node, last_fed,
                      hidden_rows)
