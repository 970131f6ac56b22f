"""RadixTree against a simple reference model: a dict from every cached page-aligned prefix to its page.

A randomized run (fixed seeds) interleaves inserts, matches, locks held by "running requests", their release
(finishes and aborts) and evictions, and after every operation checks the tree against the reference: the same
matches and pages, the same page count, evictable exactly what no lock covers, and evictions that free only
unreferenced leaves, oldest first among the leaves."""

from __future__ import annotations

import random

import pytest

from hyperdraft.kvcache.radix_tree import RadixTree


class Reference:
    def __init__(self, page_size: int):
        self.ps = page_size
        self.pages: dict[tuple, int] = {}  # page-aligned prefix -> the page holding its last page_size keys

    def match(self, keys: list) -> list[int]:
        out = []
        for end in range(self.ps, len(keys) + 1, self.ps):
            page = self.pages.get(tuple(keys[:end]))
            if page is None:
                break
            out.append(page)
        return out

    def insert(self, keys: list, pages: list[int]) -> list[int]:
        for j, end in enumerate(range(self.ps, len(keys) + 1, self.ps)):
            self.pages.setdefault(tuple(keys[:end]), pages[j])
        return self.match(keys)

    def locked(self, locks: list[tuple]) -> set[tuple]:
        return {prefix for prefix in self.pages for lock in locks if lock[: len(prefix)] == prefix}


def check(tree: RadixTree, ref: Reference, locks: list[tuple]) -> None:
    assert tree.num_pages == len(ref.pages)
    pages = [p for n in tree.nodes() for p in n.pages]
    assert sorted(pages) == sorted(ref.pages.values()) and len(set(pages)) == len(pages)
    assert tree.evictable_pages == len(ref.pages) - len(ref.locked(locks))


@pytest.mark.parametrize("page_size", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_match_the_reference(page_size, seed):
    rng = random.Random(seed)
    tree, ref = RadixTree(page_size), Reference(page_size)
    next_page, locks, handles = 1, [], []  # locks: matched key prefixes of running requests; handles: their nodes

    def random_keys() -> list[int]:
        return [rng.randrange(3) for _ in range(rng.randrange(0, 8) * page_size + rng.randrange(page_size))]

    for step in range(600):
        op = rng.random()
        keys = random_keys()
        if op < 0.35:  # a request finished: insert its pages (duplicates of cached prefixes are dropped)
            whole = len(keys) // page_size * page_size
            own = list(range(next_page, next_page + whole // page_size))
            next_page += len(own)
            node, tree_pages = tree.insert(keys[:whole], own)
            assert tree_pages == ref.insert(keys[:whole], own)
            assert sum(len(n.pages) for n in _path(node)) == len(tree_pages)
        elif op < 0.65:  # admission: match and lock
            node, pages = tree.match(keys)
            assert pages == ref.match(keys)
            tree.lock(node)
            locks.append(tuple(keys[: len(pages) * page_size]))
            handles.append(node)
        elif op < 0.85 and locks:  # a running request finishes or is aborted: its lock goes
            i = rng.randrange(len(locks))
            tree.unlock(handles.pop(i))
            locks.pop(i)
        else:  # the pool runs short
            _evict_and_check(tree, ref, locks, rng.randrange(1, 6))
        check(tree, ref, locks)
    for node in handles:
        tree.unlock(node)
    assert sorted(tree.flush()) == sorted(ref.pages.values())
    assert tree.num_pages == tree.evictable_pages == 0


def _evict_and_check(tree: RadixTree, ref: Reference, locks: list[tuple], want: int) -> None:
    leaves = [n for n in tree.nodes() if not n.children and n.refs == 0]
    # the candidate heap's invariant: every unreferenced leaf waits in it under a time no later than its last use
    queued = {}
    for pushed_use, _, node in tree._candidates:
        queued[id(node)] = min(pushed_use, queued.get(id(node), pushed_use))
    assert all(id(n) in queued and queued[id(n)] <= n.last_use for n in leaves)
    oldest = min(leaves, key=lambda n: n.last_use).pages if leaves else []
    evictable = tree.evictable_pages
    freed = tree.evict(want)
    assert len(freed) >= min(want, evictable) and len(set(freed)) == len(freed)
    assert freed[: len(oldest)] == oldest, "the least recently used unreferenced leaf goes first"
    by_page = {page: prefix for prefix, page in ref.pages.items()}
    gone = {by_page[p] for p in freed}
    assert not gone & ref.locked(locks), "evicted a page a running request references"
    for prefix in gone:  # only whole subtrees go: whatever extended an evicted prefix went with it
        assert all(p in gone for p in ref.pages if p[: len(prefix)] == prefix)
    for prefix in gone:
        del ref.pages[prefix]


def _path(node):
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out


def test_lru_evicts_the_oldest_leaf_first():
    tree = RadixTree(2)
    a, _ = tree.insert([1, 1, 2, 2], [1, 2])
    b, _ = tree.insert([1, 1, 3, 3], [3, 4])
    c, _ = tree.insert([5, 5], [5])
    tree.match([1, 1, 2, 2])  # a's leaf is now newer than b's and c's
    assert tree.evict(1) == [4]  # b's leaf ([3, 3]), the oldest; the shared [1, 1] stays (a still extends it)
    assert tree.evict(1) == [5]
    assert sorted(tree.evict(5)) == [1, 2]
    assert tree.num_pages == tree.evictable_pages == 0


def test_locked_paths_survive_and_splits_keep_references():
    tree = RadixTree(1)
    leaf, _ = tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    tree.lock(leaf)
    node, pages = tree.match([1, 2, 9])  # splits the locked edge after [1, 2]
    assert pages == [10, 11] and node.refs == 1 and tree.evictable_pages == 0
    tree.insert([1, 2, 7], [20, 21, 22])  # a new unreferenced branch below the split
    assert tree.evictable_pages == 1
    assert tree.evict(10) == [22]
    tree.unlock(leaf)
    assert tree.evictable_pages == 4 and sorted(tree.evict(10)) == [10, 11, 12, 13]


def test_partial_pages_never_match():
    tree = RadixTree(4)
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8], [1, 2])
    assert tree.match([1, 2, 3, 4, 5, 6, 7])[1] == [1]  # the second page is only partly present in the query
    assert tree.match([1, 2, 3, 9, 5, 6, 7, 8])[1] == []  # a mismatch inside the first page shares nothing


def test_lock_unlock_churn_without_evictions_keeps_the_candidate_heap_bounded():
    """Every unlock queues a candidate, and evictions may never come (a pool that does not fill): the queue must stay
    about the size of the tree, not grow with the number of requests served."""
    tree = RadixTree(1)
    node, _ = tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    other, _ = tree.insert([1, 2, 7], [10, 11, 14])
    for _ in range(5000):
        for n in (node, other):
            tree.lock(n)
            tree.unlock(n)
    assert len(tree._candidates) <= 2 * tree.num_pages + 65
    assert sorted(tree.evict(100)) == [10, 11, 12, 13, 14]  # the queue still knows every leaf


def test_a_snapshot_stays_at_its_end_through_splits_and_returns_when_evicted():
    """A node's snapshot marks the state at the node's end: a split above it leaves it with the lower half (whose end
    is unchanged), and evicting the node hands its index to dropped_snapshots, once."""
    tree = RadixTree(2)
    node, _ = tree.insert(list(range(8)), [10, 11, 12, 13])
    node.snapshot = 5
    head, pages = tree.match(list(range(4)) + [99, 98])  # splits the edge after 4 keys
    assert pages == [10, 11] and head.snapshot == -1 and head.children
    assert [n.snapshot for n in tree.nodes() if n is not head] == [5]
    assert sorted(tree.evict(4)) == [10, 11, 12, 13]
    assert tree.dropped_snapshots == [5]
