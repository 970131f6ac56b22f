"""The draft tree of SGLang 0.5.23's NGRAM (`--speculative-ngram-match-type BFS|PROB`), built from occurrence lists.

Terms, for one request:
  corpus      what drafts come from: finished requests' tokens (the history, SEPARATOR between sequences), then the
              request's own tokens, newest last
  n-gram      at most max_trie_depth (D) consecutive corpus tokens, never across a SEPARATOR. SGLang keeps every one
              in a trie: the node of n-gram s has a child c for each token that followed s somewhere, with a count
              (freq: how often s + c occurs) and a recency (the latest occurrence of s + c)
  anchor      the n-gram of the request's last w tokens (1 <= w < D) when it has children; used longest first
  tree        N node slots: node 0 the request's last token (the root), then draft tokens, each under its parent,
              a (parent, token) pair made once (later anchors merge into the nodes earlier ones made); at most
              max_breadth children a node (verification tries that many siblings, Tier.topk)

No trie is built. The children of n-gram s = anchor + p are the tokens that follow those occurrences of the anchor
whose continuation starts with p: one pass over the corpus finds every anchor's occurrences (each length's survivors
of the next), and each tree node under an anchor holds the subset of those rows that reach it. A child's freq is its
row count, its recency its latest row. Why: a Python trie holds about D nodes per corpus token (over a million
objects for the 64k-token history); the rows are one int64 an occurrence, and a round touches only the anchor's.

BFS (recency first): an anchor of length w takes breadth(w) = min_breadth + (D' - w) * scale children a node, most
recent first, the breadth falling by scale a level (never below one child), with D' = max(1, D - 1) and
scale = (max_breadth - min_breadth) / D'. A short match says less about what follows, so it branches wider.
PROB (frequency first): a node's max_breadth most frequent children (ties: the smaller token) share its probability
in proportion to freq; nodes join the tree best first, until the tree is full.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from hyperdraft.kernels.ngram import SEPARATOR

MATCH_TYPES = ("BFS", "PROB")
# An anchor keeps its latest MAX_ROWS occurrences. A one-token anchor can occur thousands of times in the history
# (a frequent token of a 64k-token history: 3-17k rows on Zipf-like text, 7-15 ms a tree); the latest 1024 keep the
# recent children BFS ranks first and the counts PROB compares, in about a tenth of the time.
MAX_ROWS = 1024
# A node reached by this many rows or fewer is grouped in Python: about half the nodes of a tree on chat text have one
# row, a quarter 2-4, and numpy's per-call cost (~2 us a call, ~10 calls) was most of a tree's 0.4 ms.
SMALL_NODE = 16


@dataclass(frozen=True)
class TrieTreeShape:
    num_nodes: int  # N: node slots, the root included (speculative_num_draft_tokens)
    max_breadth: int  # most children a node (speculative_ngram_max_bfs_breadth; the tier's topk)
    min_breadth: int  # BFS: the longest anchors' breadth (speculative_ngram_min_bfs_breadth)
    max_trie_depth: int  # D: the longest n-gram (speculative_ngram_max_trie_depth)
    match_type: str  # one of MATCH_TYPES


class _Tree:
    """Nodes in the order they are made, so every parent comes before its children."""

    def __init__(self, root: int, shape: TrieTreeShape):
        self.tokens, self.parents, self.children = [root], [-1], [0]
        self.made: dict[tuple[int, int], int] = {}
        self.shape = shape

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.shape.num_nodes

    def add(self, parent: int, token: int) -> int | None:
        """The node for token under parent, made if needed; None when the tree or the parent has no room."""
        node = self.made.get((parent, token))
        if node is not None:
            return node
        if self.full or self.children[parent] >= self.shape.max_breadth:
            return None
        node = len(self.tokens)
        self.made[(parent, token)] = node
        self.tokens.append(token)
        self.parents.append(parent)
        self.children.append(0)
        self.children[parent] += 1
        return node


class TrieCorpus:
    """Each request's corpus (module doc) without copying the history every round: one buffer holds the history, a
    SEPARATOR, then the request being drafted for (written over the previous one's tokens), and each token's places
    in the history are found once (a scan of the 64k-token history per request per round was ~30 of a BFS tree's
    ~110 us on this repository's CPU, the history's copy ~16 more). Both are rebuilt when the history changes (a new
    array object: NgramHistory.add)."""

    def __init__(self):
        self.history: np.ndarray | None = None
        self.buffer = np.zeros(0, dtype=np.int64)
        self.places: dict[int, np.ndarray] = {}  # token -> its ascending positions in the history

    def corpus(self, history: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """-> (corpus, ends): the corpus as a view of the buffer, valid until the next call, and anchor_ends' ends
        for w = 1 (the positions after each earlier occurrence of seq's last token)."""
        if history is not self.history:
            self.history, self.places = history, {}
            self.buffer = np.concatenate([history, [SEPARATOR]]) if len(history) else history[:0]
        start = len(history) + 1 if len(history) else 0  # where seq goes: after the history's SEPARATOR
        if len(self.buffer) < start + len(seq):
            grown = np.empty(max(start + len(seq), 2 * len(self.buffer)), dtype=np.int64)
            grown[:start] = self.buffer[:start]
            self.buffer = grown
        corpus = self.buffer[: start + len(seq)]
        corpus[start:] = seq
        last = int(seq[-1])
        own = np.flatnonzero(seq[:-1] == last) + (start + 1)
        if not len(history):
            return corpus, own
        places = self.places.get(last)
        if places is None:
            places = self.places[last] = np.flatnonzero(history == last)
        return corpus, np.concatenate([places + 1, own])


def anchor_ends(corpus: np.ndarray, seq: np.ndarray, longest: int, first: np.ndarray | None = None) -> list[np.ndarray]:
    """ends[w - 1]: the ascending positions e < len(corpus) with corpus[e - w : e] == seq[-w:], for w = 1, 2, ...
    while any remain and w <= longest. first: ends[0] when already known (TrieCorpus)."""
    found = []
    ends = np.flatnonzero(corpus[:-1] == seq[-1]) + 1 if first is None else first
    for w in range(1, min(longest, len(seq)) + 1):
        if w > 1:
            at = ends - w
            ends = ends[(at >= 0) & (corpus[np.maximum(at, 0)] == seq[-w])]
        if not len(ends):
            break
        found.append(ends)
    return found


class _Children:
    """The distinct tokens at one level of a node's rows, as lists: tokens ascending, each one's latest row and row
    count; members(i) gives token i's rows, latest first, the same object every time (so _Rows can recognise it)."""

    def __init__(self, corpus: np.ndarray, starts: np.ndarray, level: int, members):
        """starts: where each of the anchor's continuations begins in the corpus, latest first; members: the rows
        that reach this node, ascending (each took a real token at every level above, so none has crossed a
        SEPARATOR)."""
        self._rows: list = []  # token i's rows, made when first asked for
        self._grouped, self._first = None, []
        if len(members) <= SMALL_NODE:
            self._group_in_python(corpus, starts, level, members)
        else:
            self._group_in_numpy(corpus, starts, level, np.asarray(members))

    def members(self, i: int):
        if self._rows[i] is None:  # sliced only when asked for: most children are never expanded
            self._rows[i] = self._grouped[self._first[i]:self._first[i] + self.counts[i]]
        return self._rows[i]

    def _group_in_python(self, corpus: np.ndarray, starts: np.ndarray, level: int, members) -> None:
        groups: dict[int, list[int]] = {}
        for row, at in zip(list(members), (starts[members] + level).tolist()):
            token = int(corpus[at]) if at < len(corpus) else SEPARATOR
            if token != SEPARATOR:
                groups.setdefault(token, []).append(row)
        self.tokens = sorted(groups)
        self._rows = [groups[t] for t in self.tokens]
        self.latest = [r[0] for r in self._rows]  # rows run latest first, so a smaller row is more recent
        self.counts = [len(r) for r in self._rows]

    def _group_in_numpy(self, corpus: np.ndarray, starts: np.ndarray, level: int, members: np.ndarray) -> None:
        at = starts[members] + level
        inside = at < len(corpus)
        members, col = members[inside], corpus[at[inside]]
        keep = col != SEPARATOR
        members, col = members[keep], col[keep]
        order = np.argsort(col, kind="stable")  # one sort groups every child's rows, each group still ascending
        grouped, col = members[order], col[order]
        first = np.flatnonzero(np.concatenate(([True], col[1:] != col[:-1]))) if len(col) else order[:0]
        self.tokens, self.latest = col[first].tolist(), grouped[first].tolist()
        self.counts = (np.append(first[1:], len(col)) - first).tolist()
        self._grouped, self._first, self._rows = grouped, first.tolist(), [None] * len(self.tokens)


class _Rows:
    """One anchor's rows: where its continuations begin (latest first), and each node's children, grouped once.
    Anchors of different lengths often occur at exactly the same places (a repeated phrase: every suffix of it occurs
    wherever the phrase does), and then share one _Rows, so their nodes are grouped once for all of them (a looping
    answer's tree took 17 anchors x the same 23 rows: 1.0 ms, mostly regrouping)."""

    def __init__(self, corpus: np.ndarray, ends: np.ndarray):
        self.corpus, self.starts = corpus, ends[::-1][:MAX_ROWS]
        self.root = np.arange(len(self.starts))
        self._seen: dict[tuple[int, int], tuple[object, _Children]] = {}  # (level, id(members)) -> (members, children)

    def children(self, level: int, members) -> _Children:
        key = (level, id(members))
        seen = self._seen.get(key)
        if seen is None or seen[0] is not members:
            seen = self._seen[key] = (members, _Children(self.corpus, self.starts, level, members))
        return seen[1]


def trie_tree(corpus: np.ndarray, seq: np.ndarray, shape: TrieTreeShape,
              first: np.ndarray | None = None) -> tuple[list[int], list[int]]:
    """corpus ends with seq (the request's own tokens) -> (tokens, parents) of its draft tree, root first. first:
    the one-token anchor's ends when known (TrieCorpus.corpus)."""
    tree = _Tree(int(seq[-1]), shape)
    depth = shape.max_trie_depth
    grow = _grow_by_recency if shape.match_type == "BFS" else _grow_by_frequency
    rows, rows_of = None, None
    for w, ends in reversed(list(enumerate(anchor_ends(corpus, seq, depth - 1, first), start=1))):
        if tree.full:
            break
        if rows is None or not np.array_equal(ends, rows_of):
            rows, rows_of = _Rows(corpus, ends), ends
        grow(tree, rows, depth - w, w)
    return tree.tokens, tree.parents


def _grow_by_recency(tree: _Tree, rows: _Rows, levels: int, w: int) -> None:
    """Under the anchor of length w, whose rows these are, `levels` deep."""
    shape = tree.shape
    longest = max(1, shape.max_trie_depth - 1)
    scale = (shape.max_breadth - shape.min_breadth) / longest
    queue = deque([(0, (longest - w) * scale + shape.min_breadth, rows.root, 0)])
    while queue and not tree.full:
        parent, breadth, members, level = queue.popleft()
        children = rows.children(level, members)
        for i in sorted(range(len(children.tokens)), key=children.latest.__getitem__)[: max(1, int(breadth))]:
            node = tree.add(parent, children.tokens[i])
            if node is not None and level + 1 < levels:
                queue.append((node, breadth - scale, children.members(i), level + 1))
            if tree.full:
                return


def _grow_by_frequency(tree: _Tree, rows: _Rows, levels: int, w: int) -> None:
    heap: list = []
    order = 0  # ties in probability leave the heap first in, first out

    def offer(parent: int, members: np.ndarray, level: int, prob: float) -> None:
        nonlocal order
        if level >= levels:
            return
        children = rows.children(level, members)
        tokens, counts = children.tokens, children.counts
        best = sorted(range(len(tokens)), key=lambda i: (-counts[i], tokens[i]))[: tree.shape.max_breadth]
        total = float(sum(counts[i] for i in best))
        for i in best:
            heapq.heappush(heap, (-(counts[i] / total * prob), order, parent, tokens[i], children.members(i),
                                  level + 1))
            order += 1

    offer(0, rows.root, 0, 1.0)
    while heap and not tree.full:
        neg_prob, _, parent, token, members, level = heapq.heappop(heap)
        node = tree.add(parent, token)
        if node is not None and not tree.full:
            offer(node, members, level, -neg_prob)
