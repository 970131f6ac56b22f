"""Proposal: the draft tokens of one round, for the decoding requests of a batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, K] int64 on the device, padded with 0 past each request's length
    lens: list[int]  # [B] real draft tokens per request, host copy (0 .. K)
    q: torch.Tensor | None = None  # [B, K, V] draft distributions the tokens were sampled from; None = one-hot
    # [B] int64: the real counts where only the device knows them (a lookup queued ahead, proposers/ngram.py); lens
    # then holds the width K, and the round reads the counts back with its results
    device_lens: torch.Tensor | None = None

    @property
    def max_len(self) -> int:
        return self.tokens.shape[1]


@dataclass
class TreeProposal:
    tokens: torch.Tensor  # [B, N] int64, node 0 = the root (last committed token)
    parents: torch.Tensor  # [B, N] int64, -1 for the root; parents come before children
    fed: torch.Tensor  # [B, N] int64, offset past the root's index where the draft holds the node's K/V, -1 if none
    q: torch.Tensor | None = None  # [B, N, V] q each node's children were drawn from (sampled trees); None = top-k
    # [B] host counts of real nodes, the root included, where trees differ in size (NGRAM's trie tree); the nodes
    # past them are padding, never verified. None = all N
    num_nodes: list[int] | None = None
