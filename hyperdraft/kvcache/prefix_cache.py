"""PrefixCache: what the scheduler asks of the radix tree, in terms of requests.

  match(req)         at admission: the longest cached prefix of the request's sequence, locked -> a Hit (or None);
                     at most seq_len - 2 tokens, so the request still runs a prefill of at least two tokens and joins
                     the batch as a prefill, with every drafter's prefill path run over it
  attach(req, row, hit)   the request starts on the hit's pages: num_computed = draft_num_computed = hit length
                     (a hybrid model's state: the hit node's snapshot is copied into the row's slot)
  save(req)          after a prefill chunk, and when a request finishes or is retracted: its computed whole pages go
                     into the tree (pages already cached swap to the tree's copies), and its lock moves down to them
  release(req)       drop the request's lock (its row is being released)

What may be cached is what every pool indexed by the page table holds for those tokens: the target's K/V up to
num_computed (accepted tokens only: a verify's rejected drafts are rolled back before save runs, and drafts in flight
are past num_computed), and, for a drafter with K/V of its own, only up to draft_num_computed. An EAGLE head's K/V at
position i is computed from (target hidden h_i, token t_{i+1}): it depends on the NEXT token too. So with
`lookahead` 1 the tree's keys are (t_i, t_{i+1}) pairs: a match then implies the following token matched as well,
which is exactly when the head's cached K/V is the one it would compute. The head's hidden-state buffer needs nothing
from the cache: after a hit of m tokens the head has consumed positions < m, and its prefill resumes at m from the
target states of the new chunk (speculative/proposers/eagle.py).

A hybrid model also needs its recurrent state where a hit ends (state_snapshots.py). save snapshots the request's
committed state when what it caches ends exactly there (its num_computed, page-aligned: at page size 1 always), and a
match stops at the deepest matched node holding a snapshot. When the match went deeper, to a node without one (a
shared system prompt that one request cached in passing, n > 1 siblings, a history saved at an unaligned length), the
Hit carries that depth as `cut`: the scheduler ends the request's first chunk there, and its save snapshots the node,
so every later request sharing that prefix starts from it. The cut costs that one request a second prefill step.

With an EAGLE or MTP head (lookahead 1) on a hybrid target the head's K/V trails the target by one token: after a
prefill chunk, or a round that accepted no draft, the target has computed L + 1 tokens and the head L, with the
target's hidden state h_L waiting for it. That is what a snapshot then keeps at the node ending at L (the pair keys
fix token L as well): the target's state after L + 1 tokens, the target's K/V at position L, and h_L. A hit restores
all three and starts the request with num_computed = L + 1 and draft_num_computed = L, where such a prefill chunk
would have left it (speculative/proposers/eagle.py).

A parked EAGLE head (adaptive step 0 over a dense target, speculative/proposers/slot_hidden.py) has consumed its
request only up to draft_num_computed = d, but the target states of positions d and on wait at their own K/V slots.
So a parked request's pages are cached as far as the target's, and those at or past d are marked headless (from d
within the first such page). A hit whose path runs into headless pages starts the request with draft_num_computed at
the first headless position and ends at the last page of that headless run; the head's prefill then first extends
over the states kept in the hit's own slots (speculative/proposers/eagle.py), writing the K/V it would have written
(the same values into the shared pages). A page's mark is set or cleared whenever a request that owns it saves it.
A hybrid target never parks its head (engine._plain_step_zero), so no hit is both walked back to a snapshot and
trimmed to a headless run: trimmed below its node, it would restore the node's state past its own end, and trimmed to
no pages, attach would leave its node locked for good. The constructor refuses the pair.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.kvcache.radix_tree import Node, RadixTree
from hyperdraft.kvcache.state_snapshots import StateSnapshots
from hyperdraft.request import Request


@dataclass(frozen=True)
class Hit:
    node: Node  # locked (the root when nothing is restorable)
    pages: list[int]
    computed: int  # the request's num_computed once attached: the pages' tokens (+1: a lookahead snapshot's)
    cut: int = 0  # hybrid models: a deeper cached prefix without a snapshot, where the first chunk should end (0: none)
    head_computed: int | None = None  # the first headless position in the hit (a parked head's), or None: none

    @property
    def num_pages(self) -> int:
        return len(self.pages)


class ParkedHeads(Protocol):
    """Which requests' EAGLE heads are parked: their K/V stops at draft_num_computed, and the target states of the
    positions past it wait at those positions' own K/V slots (speculative/proposers/slot_hidden.SlotHidden)."""

    def is_parked(self, req: Request) -> bool: ...


@dataclass
class CacheStats:
    lookup_tokens: int = 0  # prompt tokens of admitted requests looked up
    hit_tokens: int = 0  # of those, served from the cache


class PrefixCache:
    def __init__(self, tree: RadixTree, page_table: PageTable, lookahead: int, draft_kv: bool,
                 snapshots: StateSnapshots | None = None, draft_state: bool = False, parked: ParkedHeads | None = None):
        """lookahead: 1 when a drafter's K/V at a position depends on the next token (EAGLE heads), else 0;
        draft_kv: a drafter keeps K/V of its own (its draft_num_computed bounds what may be cached); snapshots: a
        hybrid model's recurrent states at cached ends (None without one); draft_state: the draft model is hybrid
        (its state is snapshot with the target's, so both must be at the node's end); parked: the engine's parked
        heads (module doc), or None."""
        self.tree, self.page_table = tree, page_table
        self.page_size = page_table.page_size
        self.lookahead, self.draft_kv = lookahead, draft_kv
        self.snapshots, self.draft_state = snapshots, draft_state
        if snapshots is not None and parked is not None:
            raise AssertionError("parked heads on a hybrid target: a headless hit cannot restore a state snapshot")
        self.parked = parked
        self.headless: dict[int, int] = {}  # cached page -> offset in it of its first headless position
        self.stats = CacheStats()

    def keys(self, req: Request, length: int, start: int = 0) -> list:
        """The tree's keys for the request's positions start .. length - 1."""
        tokens = req.token_ids(start, length + self.lookahead)
        return list(zip(tokens, tokens[1:])) if self.lookahead else tokens

    def match(self, req: Request) -> Hit | None:
        usable = (req.seq_len - 2) // self.page_size * self.page_size
        if usable <= 0:
            return None
        node, pages = self.tree.match(self.keys(req, usable))
        cut, extra = 0, 0
        if self.snapshots is not None:
            deepest = len(pages)
            node, pages = self._restorable(node, pages)
            cut = deepest * self.page_size + self.lookahead if deepest > len(pages) else 0
            extra = self.lookahead if pages else 0
        head = None
        if self.headless:
            head, pages = self._headless_run(pages)
        if not pages and not cut:
            return None
        self.tree.lock(node)  # may lie below the pages kept: it keeps them from eviction all the same
        return Hit(node, pages, len(pages) * self.page_size + extra, cut, head)

    def _headless_run(self, pages: list[int]) -> tuple[int | None, list[int]]:
        """-> (the first headless position on the path, or None; the path cut after the run of headless pages that
        starts there, so every position from that one to the hit's end has a kept target state). A run of one
        position, the hit's last, is left out with its page: the head's prefill would take that position as one a
        previous chunk left pending, which a hit never did."""
        for i, page in enumerate(pages):
            offset = self.headless.get(page)
            if offset is not None:
                end = i + 1
                while end < len(pages) and self.headless.get(pages[end]) == 0:
                    end += 1
                head = i * self.page_size + offset
                if head == end * self.page_size - 1:
                    return None, pages[:i]
                return head, pages[:end]
        return None, pages

    def _restorable(self, node: Node, pages: list[int]) -> tuple[Node, list[int]]:
        """The deepest node at or above `node` that holds a snapshot, and its path's pages (the root and none)."""
        while node is not self.tree.root and node.snapshot < 0:
            pages = pages[: len(pages) - len(node.pages)]
            node = node.parent
        return node, pages

    def unlock(self, hit: Hit) -> None:
        """A hit the scheduler could not admit after all."""
        self.tree.unlock(hit.node)

    def attach(self, req: Request, row: int, hit: Hit | None) -> None:
        """Start the request in `row` on the hit's pages (or on nothing), and count the lookup."""
        cached = hit.computed if hit is not None else 0
        if req.num_retractions == 0:  # a recompute after retraction is no new prompt
            self.stats.lookup_tokens += len(req.prompt_ids)
            self.stats.hit_tokens += min(cached, len(req.prompt_ids))
            req.cached_tokens = min(cached, len(req.prompt_ids))
        if hit is None or not hit.pages:
            return
        self.page_table.attach(row, hit.pages)
        req.cache_node = hit.node
        req.num_computed = req.draft_num_computed = cached
        if hit.head_computed is not None:
            req.draft_num_computed = hit.head_computed
        if self.snapshots is None:
            return
        kv_slot = None
        if self.lookahead:  # position L's target K/V goes to the row's own page (the scheduler counted its slot)
            if not self.page_table.reserve(row, cached):
                raise AssertionError("reserve failed after the free-slot check")
            kv_slot = self.page_table.slot(row, cached - 1)
            req.draft_num_computed = cached - 1
        self.snapshots.restore(hit.node, row, kv_slot)

    def save(self, req: Request) -> None:
        """Cache the request's computed whole pages (see the module doc for what counts as computed)."""
        length = min(req.num_computed, req.seq_len - self.lookahead)
        parked = self.parked is not None and self.parked.is_parked(req)
        if self.draft_kv and not parked:
            length = min(length, req.draft_num_computed)
        num_pages = length // self.page_size
        shared = self.page_table.num_shared_pages(req.row)
        if num_pages <= shared:
            return
        # A request saved before (an earlier prefill chunk) continues below the node it locked then: inserting its
        # whole sequence from the root again made every chunk's save cost the tokens so far (an audit: 8 ms a save
        # at 64k tokens, 33 ms at 128k; ~1 s of host time over a 128k prompt in 2k-token chunks).
        below = req.cache_node if req.cache_node is not None and self.tree.path_pages(req.cache_node) == shared else None
        first = shared if below is not None else 0  # the first page inserted
        pages = self.page_table.row_pages(req.row, first, num_pages)
        node, tree_pages = self.tree.insert(self.keys(req, num_pages * self.page_size, first * self.page_size), pages,
                                            below)
        if self.parked is not None:  # over the shared pages too: the head may have written its K/V over them since
            shared_pages = self.page_table.row_pages(req.row, 0, first)  # the tree's own
            self._mark_headless(shared_pages + pages, shared_pages + tree_pages,
                                req.draft_num_computed if parked else length)
        self.page_table.share(req.row, tree_pages, first)
        end = num_pages * self.page_size
        if self.snapshots is not None and node.snapshot < 0 and self._state_at(req, end):
            self.snapshots.take(req.row, node, self.page_table.slot(req.row, end) if self.lookahead else None)
        self.tree.lock(node)
        self.release(req)
        req.cache_node = node

    def _mark_headless(self, pages: list[int], tree_pages: list[int], head_end: int) -> None:
        """The request's own pages on the cached path (not those the tree kept in their place) are headless from
        head_end on, whole before it."""
        for i, (mine, kept) in enumerate(zip(pages, tree_pages)):
            if mine != kept:
                continue
            start = i * self.page_size
            if start + self.page_size > head_end:
                self.headless[mine] = max(0, head_end - start)
            else:
                self.headless.pop(mine, None)

    def _state_at(self, req: Request, end: int) -> bool:
        """Whether the request's committed state is the one a hit ending at `end` restores: its state after `end`
        tokens, or, with a lookahead head, after end + 1 with the head at end (module doc)."""
        if not self.lookahead:
            return req.num_computed == end and (not self.draft_state or req.draft_num_computed == end)
        return req.num_computed == end + 1 and req.draft_num_computed == end

    def release(self, req: Request) -> None:
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
            req.cache_node = None

    def report(self) -> dict:
        """Sizes in tokens and counters (the engine's internal_state, /metrics)."""
        tree, ps, stats = self.tree, self.page_size, self.stats
        snapshots = {"cache_state_snapshots": self.snapshots.count - self.snapshots.num_free} if self.snapshots else {}
        return {"radix_cache": True, "cache_tokens": tree.num_pages * ps, "cache_evictable_tokens": tree.evictable_pages * ps,
                "cache_evicted_tokens": tree.evicted_pages * ps, "cache_lookup_tokens": stats.lookup_tokens,
                "cache_hit_tokens": stats.hit_tokens,
                "cache_hit_rate": stats.hit_tokens / stats.lookup_tokens if stats.lookup_tokens else 0.0, **snapshots}

    def flush(self) -> int:
        """Free every unreferenced cached page -> how many pages."""
        return self.page_table.flush_cache()
