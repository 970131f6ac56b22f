"""Draft trees for tree speculative decoding (topk > 1), batched over requests.

Terms, for one request b of a batch of B, with N node slots:
  node       a slot i in 0 .. N-1 holding one token; node 0 is the root, the request's last committed token
             (already in the KV cache or verified with the tree); nodes 1 .. are draft tokens
  parent     parents[b, i] < i: the node whose successor node i proposes (parents come before children, so a
             node's whole ancestry has smaller indices); the root has parent -1
  depth      edges from the root (root 0); a node at depth d proposes the token at sequence index
             root_seq_index + d, so positions = root_seq_index + depth
  children   the nodes whose parent is i; siblings are linked first_child -> next_sibling -> ... in increasing
             node index, which is the order verification tries them
  mask       mask[b, i, j]: node j is node i or an ancestor of node i, i.e. the attention mask of the tree
             (node i may attend to node j); a chain of n nodes gives the causal lower-triangular mask
  q          q[b, i]: the draft distribution the children of node i were drawn from (the drafter's distribution
             for the token following node i); None = deterministic children (one-hot q per child: NGRAM,
             greedy top-k drafts)
  padding    with num_nodes given, nodes i >= num_nodes[b] are not part of request b's tree: they get parent -1,
             depth 0, no links, and a mask row with only the diagonal (so an attention row is never empty)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels.tree_round import tree_plan


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] int64; node 0 is the root = the request's last committed token
    parents: torch.Tensor  # [B, N] int64; parents[:, 0] = -1; parents[b, i] < i for real nodes
    depth: torch.Tensor  # [B, N] int64; root 0
    mask: torch.Tensor  # [B, N, N] bool; mask[b, i, j] = node j is node i or an ancestor of node i
    q: torch.Tensor | None = None  # [B, N, V] distribution the children of node i were drawn from; None = one-hot
    num_nodes: torch.Tensor | None = None  # [B] int64 real nodes per request (<= N); None = all N real

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[1]

    def real(self) -> torch.Tensor:
        """-> [B, N] bool, True for nodes that belong to the request's tree."""
        idx = torch.arange(self.num_slots, device=self.tokens.device)
        if self.num_nodes is None:
            return torch.ones_like(self.tokens, dtype=torch.bool)
        return idx[None, :] < self.num_nodes[:, None]

    # The sibling links are derived on first use: greedy verification (verify_greedy_tree) never reads them, and
    # building them took 21 of a greedy tree round's 374 host calls (host_overhead --alpha -1 --cases eagle3-tree).
    @cached_property
    def first_child(self) -> torch.Tensor:
        """[B, N] int64: the smallest i with parents[i] == v, -1 when none (parentless nodes go to a dummy column)."""
        bsz, n = self.tokens.shape
        idx = torch.arange(n, device=self.tokens.device)
        slot = torch.where(self.parents >= 0, self.parents, n)
        first = torch.full((bsz, n + 1), n, dtype=torch.int64, device=self.tokens.device)
        first.scatter_reduce_(1, slot, idx.expand(bsz, n), reduce="amin", include_self=True)
        return torch.where(first[:, :n] < n, first[:, :n], -1)

    @cached_property
    def next_sibling(self) -> torch.Tensor:
        """[B, N] int64: the smallest j > i with the same parent, -1 when none (siblings linked in index order)."""
        n = self.num_slots
        idx = torch.arange(n, device=self.tokens.device)
        parents = self.parents
        same = (parents[:, :, None] == parents[:, None, :]) & (parents >= 0)[:, :, None] & (idx[None, :] > idx[:, None])
        later = torch.where(same, idx[None, None, :], n).amin(dim=2)
        return torch.where(later < n, later, -1)

    def num_children(self) -> torch.Tensor:
        """-> [B, N] int64 children per node."""
        counts = torch.zeros(self.batch_size, self.num_slots + 1, dtype=torch.int64, device=self.tokens.device)
        slot = torch.where(self.parents >= 0, self.parents, self.num_slots)  # parentless nodes count in a dummy slot
        counts.scatter_add_(1, slot, torch.ones_like(slot))
        return counts[:, : self.num_slots]


def build_tree(
    tokens: torch.Tensor,  # [B, N] int64 node tokens (tokens[:, 0] = the root's committed token)
    parents: torch.Tensor,  # [B, N] int64; parents[:, 0] = -1 and parents[b, i] < i for real nodes
    q: torch.Tensor | None = None,  # [B, N, V] float, distribution the children of node i were drawn from
    num_nodes: torch.Tensor | None = None,  # [B] int64 real nodes per request (1 .. N); None = all N
    validate: bool = False,  # check the parent invariants (a host sync); for tests and debugging
) -> DraftTree:
    """Derive depth and the ancestor mask from the parent pointers, for all requests at once (the sibling links on
    first use: DraftTree.first_child, next_sibling). On CUDA one launch (kernels/tree_round.tree_plan)."""
    bsz, n = tokens.shape
    device = tokens.device
    if num_nodes is not None and not validate and use_fused_kernels(tokens):
        parents, depth, mask = tree_plan(parents.to(torch.int64), num_nodes)
        return DraftTree(tokens=tokens.to(torch.int64), parents=parents, depth=depth, mask=mask, q=q,
                         num_nodes=num_nodes)
    idx = torch.arange(n, device=device)
    real = torch.ones(bsz, n, dtype=torch.bool, device=device) if num_nodes is None else idx[None] < num_nodes[:, None]
    parents = torch.where(real, parents.to(torch.int64), -1)
    if validate:
        assert bool((parents[:, 0] == -1).all()), "the root (node 0) must have parent -1"
        assert bool((parents < idx[None]).all()), "parents must come before their children"
        assert bool(((parents[:, 1:] >= 0) | ~real[:, 1:]).all()), "every real non-root node needs a parent"
        if num_nodes is not None:
            assert bool(((num_nodes >= 1) & (num_nodes <= n)).all()), "num_nodes must be in 1 .. N"

    # Ancestor mask by repeated squaring of "self or parent" (0/1 float matrices: every product and sum is exact):
    # after s squarings each node reaches its ancestors up to 2^s levels up, so ceil(log2(N - 1)) squarings reach the
    # root, a few launches where a loop over nodes took N. Depth = ancestors, self not counted.
    has_parent = parents >= 0  # [B, N]
    reach = torch.eye(n, device=device).repeat(bsz, 1, 1)
    reach.scatter_add_(2, parents.clamp_min(0)[:, :, None], has_parent[:, :, None].float())
    for _ in range(max(n - 2, 0).bit_length()):
        reach = torch.bmm(reach, reach).clamp_max_(1.0)
    mask = reach > 0
    depth = mask.sum(-1) - 1

    return DraftTree(tokens=tokens.to(torch.int64), parents=parents, depth=depth, mask=mask, q=q, num_nodes=num_nodes)


def positions(
    tree: DraftTree,
    root_seq_index: torch.Tensor,  # [B] int64 sequence index of the root token
) -> torch.Tensor:
    """-> [B, N] int64 sequence index of every node (root_seq_index + depth); padding nodes get the root's."""
    return root_seq_index[:, None] + tree.depth
