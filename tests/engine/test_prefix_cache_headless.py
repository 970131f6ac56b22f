"""PrefixCache's headless pages (kvcache/prefix_cache.py): a parked head's request is cached as far as the target's
K/V, its pages from the head's draft_num_computed on marked; a hit through them starts the head there and ends with
the run of headless pages, so every position from the head's start to the hit's end has a kept target state."""

from __future__ import annotations

import torch

from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.kvcache.prefix_cache import PrefixCache
from hyperdraft.kvcache.radix_tree import RadixTree
from hyperdraft.request import Request
from hyperdraft.sampling_params import SamplingParams


class Parked:
    """The engine's parked heads, as the cache sees them (SlotHidden.is_parked): a set of requests."""

    def __init__(self):
        self.reqs: list[Request] = []

    def is_parked(self, req: Request) -> bool:
        return any(r is req for r in self.reqs)


def _cache(page_size: int) -> tuple[PrefixCache, PageTable, Parked]:
    tree = RadixTree(page_size)
    table = PageTable(96, page_size, 4, 32, torch.device("cpu"), cache=tree)
    parked = Parked()
    return PrefixCache(tree, table, lookahead=1, draft_kv=True, parked=parked), table, parked


def _computed(table: PageTable, tokens: list[int], computed: int, head: int) -> Request:
    """A running request: `computed` tokens with target K/V, its head's K/V up to `head`."""
    req = Request("r", list(tokens), SamplingParams(), seed=0)
    req.row = table.acquire_row()
    assert table.reserve(req.row, computed)
    req.num_computed, req.draft_num_computed = computed, head
    return req


def test_a_parked_request_is_cached_past_its_head_and_a_hit_starts_the_head_there():
    cache, table, parked = _cache(page_size=2)
    tokens = list(range(10, 30))  # 20 tokens
    a = _computed(table, tokens, computed=19, head=7)
    parked.reqs.append(a)
    cache.save(a)  # 18 tokens cached (pages of 2, the last token's pair key needs token 18)
    pages = table.row_pages(a.row)[:9]
    assert cache.headless == {pages[3]: 1, **{p: 0 for p in pages[4:9]}}  # position 7 sits at offset 1 of page 3
    b = Request("b", tokens + [99, 98], SamplingParams(), seed=1)
    hit = cache.match(b)
    assert (hit.computed, hit.head_computed) == (18, 7)
    b.row = table.acquire_row()
    cache.attach(b, b.row, hit)
    assert (b.num_computed, b.draft_num_computed) == (18, 7)


def test_a_hit_ends_where_the_headless_run_ends():
    """A head-valid request that computed a longer sequence itself caches its own pages past a parked one's: the
    path is headless pages, then whole ones. A hit through both ends with the headless run (the whole pages past it
    hold no kept states to extend the head over); the head-valid request's save leaves the parked pages marked."""
    cache, table, parked = _cache(page_size=1)
    tokens = list(range(40, 60))
    a = _computed(table, tokens[:12], computed=11, head=6)
    parked.reqs.append(a)
    cache.save(a)  # positions 0-10 (the pair key of 10 is token 11): 6-10 headless
    b = _computed(table, tokens, computed=19, head=19)  # computed the same 12 tokens and more on its own pages
    cache.save(b)  # 0-10 are the tree's (a's) already, 11-18 b's own
    assert sorted(cache.headless.values()) == [0] * 5
    c = Request("c", tokens + [1, 2], SamplingParams(), seed=2)
    hit = cache.match(c)
    assert (hit.computed, hit.head_computed) == (11, 6)
    cache.unlock(hit)


def test_a_whole_save_clears_the_marks_of_its_own_pages():
    """A request attached to headless pages whose prefill wrote its head's K/V over them saves them whole."""
    cache, table, parked = _cache(page_size=1)
    tokens = list(range(70, 90))
    a = _computed(table, tokens[:10], computed=9, head=3)
    parked.reqs.append(a)
    cache.save(a)
    assert len(cache.headless) == 6  # positions 3-8 of the 9 cached
    b = Request("b", tokens[:10] + [5, 5, 5], SamplingParams(), seed=3)
    hit = cache.match(b)
    b.row = table.acquire_row()
    cache.attach(b, b.row, hit)
    assert table.reserve(b.row, 12)
    b.num_computed, b.draft_num_computed = 12, 11  # its prefill: the head extended over the kept states, then on
    cache.save(b)
    assert cache.headless == {}


def test_a_lone_headless_last_position_stays_out_of_the_hit():
    """Only the last cached position headless: a hit through it would start the head one short of the hit's end, which
    its prefill reads as a position a previous chunk left pending in its hidden buffer. The hit ends before it."""
    cache, table, parked = _cache(page_size=1)
    tokens = list(range(100, 110))
    a = _computed(table, tokens, computed=9, head=8)
    parked.reqs.append(a)
    cache.save(a)  # positions 0-8, only 8 headless
    assert list(cache.headless.values()) == [0]
    hit = cache.match(Request("b", tokens + [3, 3], SamplingParams(), seed=4))
    assert (hit.computed, hit.head_computed) == (8, None)
    cache.unlock(hit)
