"""Scheduler: continuous batching over one shared paged KV pool.

Each step, in order:
  1. every decoding request gets room for decode_reserve new tokens (1, or
     the largest verify width under speculation); when the pool runs dry the
     newest running requests are retracted (KV freed, recomputed later);
  2. unfinished prefills continue, then waiting requests are admitted FCFS,
     under a prefill token budget (chunked prefill) and max_running_requests.
     With the prefix cache, an admitted request first takes the longest cached
     prefix of its sequence (whole pages, locked) and prefills only the rest
     (a hybrid model: the longest with a state snapshot; its first chunk ends
     where a deeper cached prefix lacks one, so that it gets one). At most one
     request is mid-prefill: nobody is admitted behind a chunk that leaves its
     request's prompt unfinished. A dense chunk does so only by using up the
     budget; a hybrid's snapshot cut leaves budget, and a request admitted
     with it could take the pages the cut request still needs, with no decode
     running to retract: both stalled for good.
Decodes and prefill chunks share one forward; the batch lists the decodes first and
says how many there are. A step that finds nothing to run while requests remain
is a bug (nothing it waits for can change by stepping again): it raises rather
than leave the caller stepping forever.

After the forward, commit() applies the worker's results: K/V kept by
length (and the next round's room), tokens appended one at a time through the StopChecker, finished
requests freed. The prefix cache takes a request's computed whole pages after
each prefill chunk, and when it finishes or is retracted; pages it holds that
no running request references are evicted (LRU) before anyone is retracted.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

from hyperdraft.core.schedule import RequestResult, ScheduledBatch, ScheduledRequest, StepOutput
from hyperdraft.engine.stop import StopChecker
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.kvcache.prefix_cache import PrefixCache
from hyperdraft.request import Request


class Scheduler:
    def __init__(self, page_table: PageTable, stop: StopChecker, max_running_requests: int, prefill_budget: int,
                 chunked_prefill: bool, decode_reserve: int = 1, cache: PrefixCache | None = None):
        self.page_table = page_table
        self.stop = stop
        self.max_running = max_running_requests
        self.prefill_budget = prefill_budget
        self.chunked_prefill = chunked_prefill
        self.decode_reserve = decode_reserve  # K/V room a decode needs beyond the tokens it already has
        self.cache = cache  # None: every prompt is computed from scratch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.live_rids: set[str] = set()  # waiting or running: a caller's rid must not name two requests
        self._numbers = itertools.count()  # the rids of requests a caller did not name

    # ---- bookkeeping --------------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self.live_rids.add(req.rid)

    def rid_for(self, rid: str | None) -> str:
        """A caller's own rid, checked unique among live requests (abort(rid) would stop two), or else the next
        number not taken by one."""
        if rid is None:
            rid = next(r for r in (f"req-{n}" for n in self._numbers) if r not in self.live_rids)
        elif not isinstance(rid, str):
            raise ValueError(f"rid must be a string, got {type(rid).__name__}")
        elif rid in self.live_rids:
            raise ValueError(f"rid must be unique among live requests; {rid!r} is waiting or running")
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, rids: set[str]) -> list[Request]:
        """Finish the requests with these ids, waiting or running, in one pass over the queue (aborting a stream's
        thousands of queued requests one by one was quadratic: 3.5 s for 32k of them)."""
        waiting = [r for r in self.waiting if r.rid in rids]
        if waiting:
            self.waiting = deque(r for r in self.waiting if r.rid not in rids)
        for req in waiting:
            self._end(req, "abort")
        running = [r for r in self.running if r.rid in rids]
        for req in running:
            self._finish(req, "abort")
        return waiting + running

    # ---- schedule -----------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        decoding, prefilling = [], []
        for req in self.running:
            (decoding if req.is_decoding else prefilling).append(req)
        items = self._schedule_decodes(decoding)
        num_decodes = len(items)
        prefilling = [r for r in prefilling if r.row is not None]  # a retraction above may have taken one back
        items += self._schedule_prefills(prefilling, self.prefill_budget)
        if not items and self.has_unfinished():  # never waits for anything: stepping again would change nothing
            raise RuntimeError(f"scheduler stalled, a bug: nothing fits with {len(self.running)} running and "
                               f"{len(self.waiting)} waiting requests (running: "
                               + ", ".join(f"{r.rid} {r.num_computed}/{r.seq_len}" for r in self.running[:8])
                               + f"; free slots {self.page_table.num_available_slots})")
        return ScheduledBatch(items, num_decodes) if items else None

    def _schedule_decodes(self, decoding: list[Request]) -> list[ScheduledRequest]:
        reserve = self.decode_reserve
        if self.page_table.reserve_all([r.row for r in decoding], [r.num_computed + reserve for r in decoding]):
            return [ScheduledRequest(req, 1, True) for req in decoding]  # the common step: the pool had room for all
        items = []
        for req in decoding:
            if req.finished or req.row is None:
                continue  # retracted (or aborted) earlier in this loop
            while not self.page_table.reserve(req.row, req.num_computed + self.decode_reserve):
                victim = self.running[-1]
                if victim is req and len(self.running) == 1:
                    # Alone, and the full verify width does not fit: verify fewer drafts (the spec worker drafts only
                    # into the reserved room), down to a plain one-token decode. Abort only when even that does not
                    # fit, exactly where decoding without speculation would.
                    width = self.decode_reserve - 1
                    while width and not self.page_table.reserve(req.row, req.num_computed + width):
                        width -= 1
                    if not width:
                        # the pool can never hold it: unreachable while StopChecker ends a request at the pool's
                        # size with "length" (engine.py), kept so a miscount cannot hang the engine
                        self._finish(req, "abort")
                    break
                self._retract(victim)
                if victim is req:
                    break
            if req.row is not None and not req.finished:
                items.append(ScheduledRequest(req, 1, True))
        return items

    def _schedule_prefills(self, prefilling: list[Request], budget: int) -> list[ScheduledRequest]:
        items = []
        for req in prefilling:
            chunk = min(req.num_uncomputed, budget)
            if req.num_computed < req.prefill_cut:  # chunked: the cut may lie past the first chunk
                chunk = min(chunk, req.prefill_cut - req.num_computed)
            if chunk <= 0 or not self.page_table.reserve(req.row, req.num_computed + chunk):
                return items
            items.append(ScheduledRequest(req, chunk, chunk == req.num_uncomputed))
            budget -= chunk
            if chunk < req.num_uncomputed:  # still mid-prefill (a snapshot cut): nobody goes behind it
                return items
        fresh: list[Request] = []  # admitted by this call
        while self.waiting and len(self.running) < self.max_running and self.page_table.num_free_rows:
            chunk = self._admit(self.waiting[0], budget, bool(items), fresh)
            if chunk is None:
                break
            items.append(ScheduledRequest(self.waiting[0], chunk, chunk == self.waiting[0].num_uncomputed))
            fresh.append(self.waiting[0])
            self.running.append(self.waiting.popleft())
            budget -= chunk
            if not items[-1].samples:  # admitted mid-prefill: nobody goes behind it
                break
        return items

    def _admit(self, req: Request, budget: int, batch_has_items: bool, fresh: list[Request]) -> int | None:
        """Give the first waiting request a row, its cached prefix and room for its first chunk -> the chunk's length,
        or None when it does not fit this step, or should wait for a prefix a request admitted in this same step is
        about to cache (nothing changed then)."""
        hit = self.cache.match(req) if self.cache is not None else None
        cached = hit.computed if hit is not None else 0
        own = cached - hit.num_pages * self.page_table.page_size if hit is not None else 0  # a snapshot's K/V slot
        if self.cache is not None and _shares_uncached(req, cached, fresh):
            self._release_hit(hit)
            return None
        uncomputed = req.seq_len - cached
        chunk = min(uncomputed, budget) if self.chunked_prefill else uncomputed
        if hit is not None and hit.cut:  # a hybrid model: end a chunk where the cache wants a state snapshot
            chunk = min(chunk, hit.cut - cached)
        # Headroom: keep one decode's worth of room per running request so admission does not force retraction.
        # With nothing running the whole pool is free and the request fits (prompt checks, retraction sizes):
        # demanding headroom then would leave a request that fits only alone waiting forever.
        headroom = self.decode_reserve * len(self.running) + self.page_table.page_size if self.running else 0
        if (chunk <= 0 or (not self.chunked_prefill and batch_has_items and chunk > budget)
                or self.page_table.num_available_slots < own + chunk + headroom):
            self._release_hit(hit)
            return None
        req.row = self.page_table.acquire_row()
        req.prefill_cut = hit.cut if hit is not None else 0
        if self.cache is not None:
            self.cache.attach(req, req.row, hit)
        if not self.page_table.reserve(req.row, req.num_computed + chunk):
            raise AssertionError("reserve failed after the free-slot check")
        return chunk

    def _release_hit(self, hit) -> None:
        if hit is not None:
            self.cache.unlock(hit)

    def _retract(self, req: Request) -> None:
        """Free a running request's K/V and queue it first for recompute; its tokens so far are kept."""
        self.running.remove(req)
        self._release(req, keep_cached=True)
        req.num_computed, req.draft_num_computed, req.prefill_cut = 0, 0, 0
        req.num_retractions += 1
        self.waiting.appendleft(req)

    # ---- commit -------------------------------------------------------------------------------------------------
    def commit(self, batch: ScheduledBatch, results: list[RequestResult]) -> list[StepOutput]:
        outputs = []
        now = time.perf_counter()
        for i, (item, res) in enumerate(zip(batch.items, results)):
            req = item.req
            if req.finished:
                continue  # aborted while its step ran
            prefill = i >= batch.num_decodes
            req.num_computed += res.num_committed
            if res.num_drafted is not None and not res.keeps_room:  # rollback by length after a verify: room past
                # the next round's goes back. The next schedule reserves decode_reserve past the new length for every
                # decode, so releasing the rejected drafts' slots only to take them again cost each request a page
                # round trip per round (benchmarks/probes/scheduler_host.py); their stale K/V is rewritten before it
                # is read. A plain step keeps all its room: a decode queued ahead wrote the next index
                # (engine/model_worker.py).
                self.page_table.truncate(req.row, req.num_computed, room=self.decode_reserve)
            if prefill and self.cache is not None:  # a later request with this prefix skips it (no decode pays this)
                self.cache.save(req)
            if not item.samples:
                continue
            if res.num_drafted is not None:
                req.spec_verify_ct += 1
                req.spec_draft_tokens += res.num_drafted
                req.spec_accepted_tokens += res.num_accepted
            appended, reason = self.stop.append(req, res.new_tokens, res.logprobs)
            if reason is not None:
                self._finish(req, reason)
            if req.first_token_time is None:
                req.first_token_time = now
            outputs.append(StepOutput(req, appended, req.finished))
        return outputs

    def _finish(self, req: Request, reason: str) -> None:
        """A running request ends."""
        if req in self.running:
            self.running.remove(req)
        self._end(req, reason)

    def _end(self, req: Request, reason: str) -> None:
        """A request out of both queues ends: its row goes (its whole pages to the prefix cache, unless aborted)."""
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self.live_rids.discard(req.rid)
        if req.row is not None:
            self._release(req, keep_cached=reason != "abort")

    def _release(self, req: Request, keep_cached: bool) -> None:
        """Free the request's row; with keep_cached, its computed whole pages stay in the prefix cache first."""
        if self.cache is not None:
            if keep_cached:
                self.cache.save(req)
            self.cache.release(req)
        self.page_table.release_row(req.row)
        req.row = None


# A waiting request that shares at least this many tokens past its cached prefix with a request admitted in the same
# step waits one step: that request caches them when its chunk commits, and the next step's match finds them (a
# shared system prompt, n > 1 siblings), instead of every request of the burst computing them again.
IN_STEP_SHARE_TOKENS = 32


def _shares_uncached(req: Request, cached: int, fresh: list[Request]) -> bool:
    ids, want = req.prompt_ids, cached + IN_STEP_SHARE_TOKENS
    for other in fresh:  # compares at most IN_STEP_SHARE_TOKENS tokens per request admitted this step
        n = cached
        while n < want and n < len(ids) and n < len(other.prompt_ids) and ids[n] == other.prompt_ids[n]:
            n += 1
        if n == want:
            return True
    return False
