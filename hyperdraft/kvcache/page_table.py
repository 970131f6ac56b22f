"""PageTable: which KV-pool pages each running request owns.

Slots are numbered page * page_size + offset. The token at sequence index i of
a request lives in slot pages[i // page_size] * page_size + i % page_size.
Page 0 is never handed out: padded or dummy tokens write there, so no real
token's K/V is ever overwritten by padding.

The table is shared by every model in the engine. A draft model's KV pool has
the same number of slots as the target's, so one page table indexes both.

The host owns the allocation (per-row page lists); the device table mirrors it. Changes are queued per entry and
written in one copy and one launch when the device table is next read (`table`, `slots`, `flush`), not as a small
copy per request per step: with page_size 1, every decode would otherwise pay one copy per request.

With prefix caching (radix_tree.py, prefix_cache.py) a row's leading pages may belong to the tree: `attach` starts a
row on cached pages, `share` hands a row's computed pages to the tree (or swaps them for the tree's copies). The row
never frees those; rolling back below them only drops them from the row. When the free list runs short, `reserve`
asks the tree to evict unreferenced pages first. Every page is then free, the tree's, or exactly one row's own.
"""

from __future__ import annotations

import torch

from hyperdraft.core.host_copy import to_device_many
from hyperdraft.kvcache.radix_tree import RadixTree


class PageTable:
    def __init__(self, num_pages: int, page_size: int, max_rows: int, max_pages_per_row: int, device: torch.device,
                 cache: RadixTree | None = None):
        """cache: the prefix tree that owns cached pages and gives unreferenced ones back when the pool runs short."""
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (page 0 is reserved for padding)")
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_pages_per_row = max_pages_per_row
        self._free_pages = list(range(num_pages - 1, 0, -1))
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._row_pages: dict[int, list[int]] = {}
        self._row_shared: dict[int, int] = {}  # leading pages of the row that the prefix tree owns
        self.cache = cache
        self._table = torch.zeros(max_rows, max_pages_per_row, dtype=torch.int64, device=device)  # [rows, pages]
        self._pending: dict[int, int] = {}  # flat entry row * max_pages_per_row + page index -> page, not yet written

    @property
    def table(self) -> torch.Tensor:
        """[rows, pages] the device table, with every queued change written."""
        if self._pending:
            self.flush()
        return self._table

    def flush(self) -> None:
        """Write the queued entries: one host-to-device copy and one launch (entries are unique: the latest wins)."""
        if not self._pending:
            return
        self.write(*to_device_many(list(self.take_pending()), torch.int64, self._table.device))

    def take_pending(self) -> tuple[list[int], list[int]]:
        """The queued entries as (flat index, page) lists, no longer queued: for a caller that sends them in its own
        host-to-device copy and then applies them with write() before anything reads the table."""
        index, pages = list(self._pending), list(self._pending.values())
        self._pending = {}
        return index, pages

    def write(self, index: torch.Tensor, pages: torch.Tensor) -> None:
        """Apply entries taken with take_pending (device tensors, [N] each)."""
        if index.numel():
            self._table.view(-1).index_copy_(0, index, pages)

    @property
    def max_rows(self) -> int:
        return self._table.shape[0]

    @property
    def capacity_slots(self) -> int:
        return (self.num_pages - 1) * self.page_size

    @property
    def num_free_slots(self) -> int:
        return len(self._free_pages) * self.page_size

    @property
    def num_available_slots(self) -> int:
        """Free slots plus the cached ones no running request references (reserve evicts those when it must)."""
        evictable = self.cache.evictable_pages if self.cache is not None else 0
        return (len(self._free_pages) + evictable) * self.page_size

    @property
    def num_private_slots(self) -> int:
        """Slots in pages that one row owns (not the tree's): free + cached + private = capacity."""
        return sum(len(p) - self._row_shared[r] for r, p in self._row_pages.items()) * self.page_size

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def acquire_row(self) -> int:
        row = self._free_rows.pop()
        self._row_pages[row] = []
        self._row_shared[row] = 0
        return row

    def release_row(self, row: int) -> None:
        self.truncate(row, 0)
        del self._row_pages[row], self._row_shared[row]
        self._free_rows.append(row)

    def row_pages(self, row: int, start: int = 0, end: int | None = None) -> list[int]:
        return self._row_pages[row][start:end]

    def slot(self, row: int, position: int) -> int:
        """The K/V slot of the row's token at `position` (host side; token_slots is the batched device form)."""
        return self._row_pages[row][position // self.page_size] * self.page_size + position % self.page_size

    def num_shared_pages(self, row: int) -> int:
        return self._row_shared[row]

    def attach(self, row: int, pages: list[int]) -> None:
        """Start an empty row on cached pages (a prefix-cache hit); the tree keeps owning them."""
        assert not self._row_pages[row], "attach needs an empty row"
        self._set_pages(row, 0, pages)
        self._row_shared[row] = len(pages)

    def share(self, row: int, tree_pages: list[int], start: int = 0) -> None:
        """The tree now holds the row's pages start .. start + len(tree_pages) - 1 (and those before start already):
        where it kept its own copy of a page (the same tokens cached earlier), the row switches to it and frees its
        duplicate."""
        own = self._row_pages[row][start : start + len(tree_pages)]
        self._free_pages.extend(p for p, t in zip(own, tree_pages) if p != t)
        self._set_pages(row, start, tree_pages)
        self._row_shared[row] = max(self._row_shared[row], start + len(tree_pages))

    def _set_pages(self, row: int, start: int, pages: list[int]) -> None:
        row_pages = self._row_pages[row]
        row_pages[start : start + len(pages)] = pages
        base = row * self.max_pages_per_row + start
        self._pending.update(zip(range(base, base + len(pages)), pages))

    def flush_cache(self) -> int:
        """Free every cached page no row references -> how many pages."""
        freed = self.cache.flush() if self.cache is not None else []
        self._free_pages.extend(freed)
        return len(freed)

    def _take(self, need: int) -> bool:
        """need pages on the free list, evicting unreferenced cached pages when it is short."""
        short = need - len(self._free_pages)
        if short > 0 and self.cache is not None and self.cache.evictable_pages:
            self._free_pages.extend(self.cache.evict(short))
        return need <= len(self._free_pages)

    def reserve(self, row: int, num_tokens: int) -> bool:
        """Make room for num_tokens tokens in the row; all or nothing."""
        return self.reserve_all([row], [num_tokens])

    def reserve_all(self, rows: list[int], num_tokens: list[int]) -> bool:
        """reserve() for many rows, all or nothing: every row gets room for its num_tokens, or nothing changes and
        the answer is False (the pool, after evicting unreferenced cached pages, is short). Pages go to the rows in
        order, as one reserve() per row would hand them out. One pass instead of a chain of calls per row: with page
        size 1 every decode takes a page a step, and at 256 requests the per-row calls cost ~1 us each on the host
        (benchmarks/probes/scheduler_host.py)."""
        size, row_pages, width = self.page_size, self._row_pages, self.max_pages_per_row
        needs = [-(-n // size) - len(row_pages[row]) for row, n in zip(rows, num_tokens)]
        total = sum(need for need in needs if need > 0)
        if total == 0:
            return True
        if any(len(row_pages[row]) + need > width for row, need in zip(rows, needs)):
            if width < self.num_pages:  # narrower than the pool: the context's bound, which the scheduler keeps
                raise ValueError(f"a request needs {max(num_tokens)} tokens, more than the page table row holds")
            return False  # as wide as the pool (engine._page_table): more than the pool holds, a short pool's answer
        if not self._take(total):
            return False
        free = self._free_pages
        for row, need in zip(rows, needs):
            if need > 0:
                self._set_pages(row, len(row_pages[row]), [free.pop() for _ in range(need)])
        return True

    def reserve_ahead(self, rows: list[int], num_tokens: list[int]) -> bool:
        """reserve() for work queued ahead of the scheduler (engine/model_worker.py, speculative/verify_ahead.py,
        speculative/proposers/model_proposer.py): every row gets its room or none does and the caller skips the work;
        a row whose room would pass its page-table width is a refusal, not an error. What the next round reads of that
        room survives the commit in between: a verified round keeps decode-reserve tokens of room past its new length
        (Scheduler.commit's truncate), and every tier's queued writes past it fit there (Tier.reserve_tokens)."""
        width = self.max_pages_per_row * self.page_size
        return all(n <= width for n in num_tokens) and self.reserve_all(rows, num_tokens)

    def truncate(self, row: int, num_tokens: int, room: int = 0) -> None:
        """Release the pages past the first num_tokens tokens (rollback by length), but for `room` tokens past them;
        the tree's pages are only dropped from the row, never freed by it."""
        pages = self._row_pages[row]
        keep = self.pages_for(num_tokens + room)
        if keep < len(pages):
            shared = self._row_shared[row]
            self._free_pages.extend(reversed(pages[max(keep, shared):]))
            self._row_shared[row] = min(shared, keep)
            # Released pages stop mapping: a stray write past the row's room lands in the padding page, never in a
            # page since given to another row.
            base = row * self.max_pages_per_row
            self._pending.update(dict.fromkeys(range(base + keep, base + len(pages)), 0))
            del pages[keep:]

    def num_slots(self, row: int) -> int:
        """K/V slots the row holds now (its reserved room)."""
        return len(self._row_pages[row]) * self.page_size

    def token_slots(self, rows: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
        """rows, seq_index: broadcastable ([T] and [T], or [B, 1] and [B, K]) -> pool slots of that shape (indices
        past a row's pages map into page 0)."""
        last = self.max_pages_per_row - 1
        if self.page_size == 1:  # slot = page: one clamp and one gather
            return self.table[rows, seq_index.clamp_max(last)]
        return self.table[rows, (seq_index // self.page_size).clamp_max(last)] * self.page_size + seq_index % self.page_size

    def slots(self, rows: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
        """rows: [B], seq_index: [B, K] -> [B, K] pool slots."""
        return self.token_slots(rows[:, None], seq_index)
