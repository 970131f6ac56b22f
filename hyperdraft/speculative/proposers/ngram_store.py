"""DeviceSequences: NGRAM's copy of each drafting request's tokens on the device, kept by K/V slot, and of the
history, so that the next round's lookup (kernels/ngram.py) can be queued right after a round's accept, from its
accepted tokens on the device, before the host has read them (draft-ahead, as EAGLE heads do).

What is on the device is tracked per request as a count: its tokens 0 .. count-1 sit in their slots. A lookup first
copies each request's missing tokens from the host (all of a new request's, then only what steps without a lookup
committed), in one host-to-device copy; the lookup's own append writes the round's a + 1 committed tokens, so a
request drafted ahead round after round never copies again. Those rounds commit after the lookup: `settle` counts
them at the proposer's next call, when the round has committed and nothing else has.

Slots beat a [rows, max length] buffer: a 128k-context model at 256 rows would need 128 MiB for it, the pool's
slots a few MiB. A prefix-cache hit shares pages whose tokens are the same, and a page freed and taken by another
request is rewritten by the new owner's copy before any lookup of it reads there.
"""

from __future__ import annotations

import numpy as np
import torch

from hyperdraft.core.host_copy import host_to_device, to_device_many
from hyperdraft.kernels.ngram import SEPARATOR, NgramDrafts, TokenStore, ngram_draft_ahead
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.request import Request


class DeviceSequences:
    def __init__(self, page_table: PageTable, history_capacity: int, min_window: int, max_window: int):
        self.page_table, self.min_window, self.max_window = page_table, min_window, max_window
        device = page_table.table.device
        self.tokens = torch.full((page_table.num_pages * page_table.page_size,), SEPARATOR, dtype=torch.int32,
                                 device=device)
        self.history = torch.full((max(history_capacity, 1),), SEPARATOR, dtype=torch.int32, device=device)
        self.history_len = 0
        self.uploaded: np.ndarray | None = None  # the host history array the device copy was made from
        self.counts: dict[str, tuple[Request, int | None, int]] = {}  # rid -> (request, row, tokens on the device)
        self.pending: list[tuple[Request, int]] = []  # drafted ahead: (request, slots its row held then)

    def settle(self) -> None:
        """The requests drafted ahead have committed their round since, and the device wrote exactly its tokens
        (as far as their rows had slots)."""
        for req, reach in self.pending:
            self.counts[req.rid] = (req, req.row, min(req.seq_len, reach))
        self.pending = []

    def forget(self, live: set[str]) -> None:
        for rid in self.counts.keys() - live:
            del self.counts[rid]

    def draft_ahead(self, reqs: list[Request], num_accepted: torch.Tensor, accepted: torch.Tensor, k: int,
                    history: np.ndarray | None) -> NgramDrafts:
        """Called before the scheduler commits the round (req.seq_len is still n + 1): num_accepted [B], accepted
        [B, K+1] on the device -> the next round's K drafts per request, as ngram_match would find them after the
        commit."""
        self.settle()
        bases = [r.seq_len for r in reqs]
        gap_rows, gap_positions, gap_tokens = [], [], []
        for req, length in zip(reqs, bases):
            count = self._count(req)
            if count < length:
                gap_rows += [req.row] * (length - count)
                gap_positions += range(count, length)
                gap_tokens += req.token_ids(count, length)
        rows, starts, gap_rows_t, gap_positions_t, gap_tokens_t = to_device_many(
            [[r.row for r in reqs], bases, gap_rows, gap_positions, gap_tokens], torch.int64, self.tokens.device)
        if gap_tokens:
            self.tokens[self.page_table.token_slots(gap_rows_t, gap_positions_t)] = gap_tokens_t.to(torch.int32)
        self._upload(history)
        store = TokenStore(self.tokens, self.page_table.table, self.page_table.page_size)
        drafts = ngram_draft_ahead(store, rows, starts, num_accepted, accepted, self.history, self.history_len,
                                   max(bases) + accepted.shape[1], k, self.min_window, self.max_window)
        self.pending = [(r, self.page_table.num_slots(r.row)) for r in reqs]
        return drafts

    def _count(self, req: Request) -> int:
        owner, row, count = self.counts.get(req.rid, (None, None, 0))
        return count if owner is req and row == req.row else 0

    def _upload(self, history: np.ndarray | None) -> None:
        """The device history follows the host's array (a new array object whenever it changes)."""
        if history is self.uploaded:
            return
        self.uploaded = history
        self.history_len = 0 if history is None else len(history)
        if self.history_len:
            self.history[: self.history_len] = host_to_device(torch.from_numpy(history.astype(np.int32)),
                                                              self.history.device)
