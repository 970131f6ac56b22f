"""StateSnapshots: a hybrid model's recurrent states saved at the ends of cached prefixes, for the prefix cache.

A Gated DeltaNet layer's state is folded over every token before it, so the K/V pages of a cached prefix cannot restart
a request there on their own. A radix-tree node whose end some request's committed state reached may therefore hold a
snapshot: a copy of that state (every linear layer's conv inputs and recurrence), taken when the request's computed
tokens are cached (after a prefill chunk, at finish, before retraction). On a hybrid model a hit ends at the deepest
matched node that holds one; attaching the hit copies the snapshot into the request's slot, and its prefill resumes
from there (a prefill that does not start at position 0 reads its slot: attention/linear_backend.py).

  take(row, node, kv_slot)      copy the committed state of the request in `row` into a free snapshot, now node's
  restore(node, row, kv_slot)   copy node's snapshot into the slot of `row`
With an EAGLE or MTP head (prefix_cache.py says why) a snapshot also keeps one position's target K/V, from and to
the K/V pool slot kv_slot, and the head's pending input hidden state (its hidden_buf entry 0 of the row).

There are as many snapshots as page-table rows, counted in the memory budget beside the state pool. When none is free,
the least recently used node gives its snapshot back; its pages stay cached, and a later match either stops above it
or cuts its first chunk there and snapshots it again (prefix_cache.py). An evicted node's snapshot comes back through
the tree's dropped_snapshots.

  conv       per pool [L, N, C, K-1]      as StatePool.conv, N snapshots instead of slots
  recurrent  per pool [L, N, HV, dk, dv]  as StatePool.recurrent
  k, v       [A, N, Hkv, D]      one position's K/V of the target's A attention layers (a head only)
  hidden     [N, Hd]             the head's pending hidden state, in the head's own width (a head only)
Shapes come from the pools themselves, so under tensor parallelism each rank keeps its own heads' states.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hyperdraft.kvcache.kv_pool import KVPool
from hyperdraft.kvcache.radix_tree import Node, RadixTree
from hyperdraft.kvcache.state_pool import StatePool


class StateSnapshots:
    def __init__(self, pools: list[StatePool], count: int, tree: RadixTree, locate: Callable[[int], int],
                 kv: KVPool | None = None, head_hidden: torch.Tensor | None = None):
        """pools: every recurrent state a request has, the target's and a hybrid draft model's (each saved and
        restored together under one index). locate(row): where the committed state of the request in `row` is now:
        -1 its slot, j >= 0 scratch entry j (where a plain decode queued ahead left it: engine/model_worker.py). kv,
        head_hidden: the target's K/V pool and the head's hidden_buf [rows, W, Hd], with an EAGLE or MTP head."""
        self.pools, self.tree, self.locate, self.count = pools, tree, locate, count
        self.conv = [p.conv.new_zeros((p.conv.shape[0], count, *p.conv.shape[2:])) for p in pools]
        self.recurrent = [p.recurrent.new_zeros((p.recurrent.shape[0], count, *p.recurrent.shape[2:])) for p in pools]
        self.kv, self.head_hidden = kv, head_hidden
        if kv is not None:
            self.k = kv.k.new_zeros((kv.k.shape[0], count, *kv.k.shape[2:]))
            self.v = kv.v.new_zeros((kv.v.shape[0], count, *kv.v.shape[2:]))
            self.hidden = head_hidden.new_zeros((count, head_hidden.shape[-1]))
        self._free = list(range(count - 1, -1, -1))
        self._owners: dict[int, Node] = {}

    @property
    def num_free(self) -> int:
        self._take_back_dropped()
        return len(self._free)

    def take(self, row: int, node: Node, kv_slot: int | None = None) -> None:
        index = self._allocate()
        slot, entry = row + 1, self.locate(row)
        for pool, conv, recurrent in zip(self.pools, self.conv, self.recurrent):
            if entry < 0:
                conv[:, index] = pool.conv[:, slot]
                recurrent[:, index] = pool.recurrent[:, slot]
            else:
                conv[:, index] = pool.conv_scratch[:, slot, entry]
                recurrent[:, index] = pool.recurrent_scratch[:, slot, entry]
        if self.kv is not None:
            self.k[:, index] = self.kv.k[:, kv_slot]
            self.v[:, index] = self.kv.v[:, kv_slot]
            self.hidden[index] = self.head_hidden[row, 0]
        node.snapshot = index
        self._owners[index] = node

    def restore(self, node: Node, row: int, kv_slot: int | None = None) -> None:
        index = node.snapshot
        assert index >= 0 and self._owners.get(index) is node, "restoring a snapshot the node lost"
        for pool, conv, recurrent in zip(self.pools, self.conv, self.recurrent):
            pool.conv[:, row + 1] = conv[:, index]
            pool.recurrent[:, row + 1] = recurrent[:, index]
        if self.kv is not None:
            self.kv.k[:, kv_slot] = self.k[:, index]
            self.kv.v[:, kv_slot] = self.v[:, index]
            self.head_hidden[row, 0] = self.hidden[index]

    def _allocate(self) -> int:
        self._take_back_dropped()
        if not self._free:  # O(rows), and only once every snapshot is in use: at most once per cached request
            index, victim = min(self._owners.items(), key=lambda owned: owned[1].last_use)
            victim.snapshot = -1
            del self._owners[index]
            self._free.append(index)
        return self._free.pop()

    def _take_back_dropped(self) -> None:
        for index in self.tree.dropped_snapshots:
            del self._owners[index]
            self._free.append(index)
        self.tree.dropped_snapshots.clear()
