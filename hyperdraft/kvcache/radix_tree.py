"""RadixTree: cached K/V pages keyed by the token sequence that produced them (prefix caching).

Each edge holds a run of keys whose length is a multiple of page_size, and the pages that hold their K/V: key j of an
edge lives in pages[j // page_size]. Every edge is page-aligned, so a match shares only whole pages; the partial page
after it belongs to the new request alone (it is recomputed there), and no request ever writes into a page the tree
owns. A key is a token id, or whatever the caller derives from the tokens (prefix_cache.py pairs each token with the
next one for drafters whose K/V at a position depends on it); the tree only compares keys.

  match(keys)          the longest cached page-aligned prefix of keys -> (node, its pages); an edge the match ends
                       inside is split there, so the node covers exactly the match
  insert(keys, pages)  cache pages for keys; where the tree already holds a prefix, its pages win (the caller drops
                       its duplicates) -> (node, the tree's pages for all of keys); below=node: keys continue that
                       node's path (a request's next prefill chunk below the node its last save locked)
  lock / unlock(node)  a running request's reference to a node and all its ancestors; referenced nodes never go
  evict(num_pages)     frees least-recently-used unreferenced leaves (a parent left childless and unreferenced becomes
                       one) until num_pages pages are freed or nothing unreferenced is left -> the freed pages

A node may also hold a snapshot: the index of a hybrid model's recurrent state saved at the node's end
(state_snapshots.py). The tree only carries it: a split leaves it with the lower half, whose end it is, and an evicted
node's snapshot goes to dropped_snapshots for its store to take back.

A locked node's ancestors are locked too, so every unreferenced node can be evicted once its subtree has been:
evictable_pages counts them all, and is what the pool can win back.

Eviction candidates live in a heap kept up as leaves appear (insert, unlock, a parent left childless) rather than
found by walking the tree: once the pool is full of cached pages every reservation evicts, and a walk per call over
a tree of a few 10k nodes made a long greedy run on an H100 (25k ShareGPT answers, 256 running) ten times slower
per chunk by its end. Entries go stale (the node was used again, locked, extended or evicted) and are checked when
popped; a used-again node is pushed back under its new time, so leaves still leave in exact LRU order.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    key: list[Hashable]
    pages: list[int]
    parent: Node | None
    children: dict[tuple, Node] = field(default_factory=dict)
    refs: int = 0  # running requests whose locked path passes through this node
    last_use: int = 0  # logical clock of the latest match or insert that walked through it
    snapshot: int = -1  # a hybrid model's recurrent state at this node's end (state_snapshots.py); -1: none


class RadixTree:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.root = Node([], [], None)
        self.root.refs = 1  # never evicted, never counted
        self.num_pages = 0  # pages the tree owns
        self.evictable_pages = 0  # of those, in unreferenced nodes
        self.evicted_pages = 0  # pages freed by evict() so far (metrics)
        self.dropped_snapshots: list[int] = []  # snapshots of evicted nodes, until their store takes them back
        self._clock = itertools.count(1)
        self._now = 0  # the clock value of the latest walk
        self._order = itertools.count()  # ties in last_use break by push order, never by comparing nodes
        self._candidates: list[tuple[int, int, Node]] = []  # heap of (last_use when pushed, order, node)

    # ---- lookups ------------------------------------------------------------------------------------------------
    def match(self, keys: Sequence[Hashable]) -> tuple[Node, list[int]]:
        node, pages, _ = self._walk(list(keys))
        return node, pages

    def insert(self, keys: Sequence[Hashable], pages: Sequence[int], below: Node | None = None) -> tuple[Node, list[int]]:
        """keys: a multiple of page_size; pages: one per page of keys. New pages become the tree's; over a prefix the
        tree already holds, the tree keeps its own and returns them in their place. below: a node (locked, so still
        in the tree) whose path the keys continue: the walk starts there, the path above it marked used."""
        assert len(keys) % self.page_size == 0 and len(pages) * self.page_size == len(keys)
        keys = list(keys)
        node, tree_pages, pos = self._walk(keys, below)
        if pos < len(keys):
            leaf = Node(keys[pos:], list(pages[pos // self.page_size:]), node, last_use=self._now)
            node.children[self._first(keys, pos)] = leaf
            self.num_pages += len(leaf.pages)
            self.evictable_pages += len(leaf.pages)
            self._push(leaf)
            node, tree_pages = leaf, tree_pages + leaf.pages
        return node, tree_pages

    def _walk(self, keys: list[Hashable], start: Node | None = None) -> tuple[Node, list[int], int]:
        """Follow keys down from start (default: the root) over whole matching pages -> (deepest node, the pages
        below start on its path, keys matched). Splits an edge the match ends inside, and marks the path from the
        root as used now."""
        now = self._now = next(self._clock)
        ps = self.page_size
        node, pages, pos = start or self.root, [], 0
        above = node
        while above is not self.root:
            above.last_use, above = now, above.parent
        while len(keys) - pos >= ps:
            child = node.children.get(self._first(keys, pos))
            if child is None:
                break
            k = self._matching_keys(child.key, keys, pos)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_use = now
            node, pos = child, pos + k
            pages += child.pages
        return node, pages, pos

    @staticmethod
    def path_pages(node: Node) -> int:
        """Pages on the path from the root to node."""
        count = 0
        while node is not None:
            count, node = count + len(node.pages), node.parent
        return count

    def _matching_keys(self, edge: list[Hashable], keys: list[Hashable], pos: int) -> int:
        """How many keys of edge equal keys[pos:], in whole pages (the first page is known to). List slices compare
        in C: a whole edge at once, else a bisection for the first mismatch; page by page in Python, a 2k-token
        history took 4 ms per walk, and a cached turn 2 walks twice (match, then insert)."""
        ps = self.page_size
        n = min(len(edge), len(keys) - pos)
        n -= n % ps
        if edge[:n] == keys[pos:pos + n]:
            return n
        same, differs = ps, n  # edge[:same] matches, edge[:differs] does not
        while differs - same > 1:
            mid = (same + differs) // 2
            if edge[same:mid] == keys[pos + same:pos + mid]:
                same = mid
            else:
                differs = mid
        return same - same % ps

    def _first(self, keys: Sequence[Hashable], pos: int) -> tuple:
        return tuple(keys[pos:pos + self.page_size])

    def _split(self, child: Node, k: int) -> Node:
        """Cut child's edge after k keys: a new node takes the first k (and their pages) and becomes its parent. The
        new node lies on exactly the locked paths child did, so it takes child's reference count."""
        parent = child.parent
        head = Node(child.key[:k], child.pages[:k // self.page_size], parent, refs=child.refs, last_use=child.last_use)
        parent.children[self._first(child.key, 0)] = head
        child.key, child.pages, child.parent = child.key[k:], child.pages[k // self.page_size:], head
        head.children[self._first(child.key, 0)] = child
        return head

    # ---- references ---------------------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.refs == 0:
                self.evictable_pages -= len(node.pages)
            node.refs += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.refs -= 1
            assert node.refs >= 0, "unlock without a lock"
            if node.refs == 0:
                self.evictable_pages += len(node.pages)
                if not node.children:  # an inner node becomes a candidate when its last child goes (_evict)
                    self._push(node)
            node = node.parent

    # ---- eviction -----------------------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> list[int]:
        """Free unreferenced leaves, least recently used first, until num_pages pages are freed (whole leaves: it may
        free more) or none is left."""
        freed = self._evict(num_pages)
        self.evicted_pages += len(freed)
        return freed

    def flush(self) -> list[int]:
        """Free every unreferenced page (not counted as evictions)."""
        return self._evict(self.num_pages)

    def _evict(self, num_pages: int) -> list[int]:
        heap = self._candidates
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            pushed_use, _, leaf = heapq.heappop(heap)
            if leaf.parent is None or leaf.children or leaf.refs:  # evicted already, extended, or locked since
                continue
            if leaf.last_use != pushed_use:  # used again since: it waits under its new time
                self._push(leaf)
                continue
            parent = leaf.parent
            del parent.children[self._first(leaf.key, 0)]
            leaf.parent = None
            freed += leaf.pages
            if leaf.snapshot >= 0:
                self.dropped_snapshots.append(leaf.snapshot)
            if parent is not self.root and not parent.children and parent.refs == 0:
                self._push(parent)
        self.num_pages -= len(freed)
        self.evictable_pages -= len(freed)
        return freed

    def nodes(self) -> list[Node]:
        """Every node but the root (a walk of the whole tree: for checks and reports, never the hot path)."""
        nodes, stack = [], list(self.root.children.values())
        while stack:
            nodes.append(stack.pop())
            stack.extend(nodes[-1].children.values())
        return nodes

    def _push(self, node: Node) -> None:
        """node may now be an unreferenced leaf (checked again when popped). Every lock/unlock cycle pushes, evictions
        may be rare, so once the entries outnumber the nodes (each holds at least a page) the heap is rebuilt with
        one entry per live candidate, under its current time."""
        heap = self._candidates
        if len(heap) > 2 * self.num_pages + 64:
            live = {id(e[2]): e[2] for e in heap if e[2].parent is not None and not e[2].children and not e[2].refs}
            heap[:] = [(n.last_use, next(self._order), n) for n in live.values()]
            heapq.heapify(heap)
        heapq.heappush(heap, (node.last_use, next(self._order), node))
