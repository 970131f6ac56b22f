"""Tier: one speculative shape the engine can run a step with. Adaptive speculation switches between tiers.

The bounds of a tier and the K/V room a round of it needs are written here once; the speculative config, the
adaptive config and the pools all ask a Tier.
"""

from __future__ import annotations

from dataclasses import dataclass


# A sampled tree draws each parent's children from one random stream, keyed (position + depth - 1) * TREE_NODE_LIMIT +
# the parent's node id (drafting/sampled_tree.py): with more nodes than this, two parents of one round could share a
# stream. Greedy and NGRAM trees draw nothing, but one bound for every tree keeps the tiers simple.
TREE_NODE_LIMIT = 4096


def max_tree_tokens(steps: int, topk: int) -> int:
    """The most tokens a tree of this depth and branching can verify: the root, the root's topk children, then
    topk^2 candidates at each later depth (each frontier node's topk children), and never over TREE_NODE_LIMIT."""
    return min(1 + topk + max(steps - 1, 0) * topk * topk, TREE_NODE_LIMIT)


@dataclass(frozen=True, order=True)
class Tier:
    steps: int  # draft depth; 0 = no speculation (a plain one-token decode per request)
    topk: int = 1  # branching factor; 1 = chain
    num_draft_tokens: int = 0  # verified tokens per request, root included; 0 = derive (chain: steps + 1)

    def __post_init__(self):
        if self.steps < 0 or self.topk < 1:
            raise ValueError(f"a tier needs steps >= 0 and topk >= 1, got steps={self.steps} topk={self.topk}")
        if self.num_draft_tokens == 0:
            object.__setattr__(self, "num_draft_tokens", self.steps + 1 if self.topk == 1 else 0)
        if self.topk > 1:
            if self.steps < 1:  # said on its own: the range below would name the count, which is not what is wrong
                raise ValueError(f"tree tier topk={self.topk} needs steps >= 1, got steps={self.steps}")
            most = max_tree_tokens(self.steps, self.topk)
            if not 2 <= self.num_draft_tokens <= most:
                raise ValueError(f"tree tier steps={self.steps} topk={self.topk} needs num_draft_tokens in [2, {most}], "
                                 f"got {self.num_draft_tokens}")
        elif self.num_draft_tokens != self.steps + 1:
            raise ValueError(f"chain tier steps={self.steps} needs num_draft_tokens={self.steps + 1}, got {self.num_draft_tokens}")

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    @property
    def reserve_tokens(self) -> int:
        """K/V room past the committed tokens a round of this tier can touch: the verify tree, or the draft's own
        fed nodes (root + (steps-1)*topk), whichever is larger. Pools are sized for the largest tier."""
        return max(self.num_draft_tokens, 1 + max(self.steps - 1, 0) * self.topk)

    def describe(self) -> str:
        return f"{self.steps}" if not self.is_tree else f"{self.steps}x{self.topk}/{self.num_draft_tokens}"
