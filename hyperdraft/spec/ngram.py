"""NgramProposer: prompt lookup. No model: the draft is what followed the most recent earlier occurrence of
the sequence's own suffix (longest suffix first, from max_window down to min_window)."""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from hyperdraft.request import Request
from hyperdraft.spec.proposal import Proposal


def ngram_match(tokens: np.ndarray, k: int, min_window: int, max_window: int) -> np.ndarray:
    """tokens: the whole sequence -> up to k tokens that followed the latest earlier match of its suffix."""
    n = len(tokens)
    for w in range(min(max_window, n - 1), min_window - 1, -1):
        # Windows of tokens[:-1] all have a successor, and none of them is the suffix itself.
        hits = np.flatnonzero((sliding_window_view(tokens[:-1], w) == tokens[n - w :]).all(axis=1))
        if len(hits):
            start = hits[-1] + w
            return tokens[start : start + k]
    return tokens[:0]


class NgramProposer:
    def __init__(self, min_window: int, max_window: int, device: torch.device):
        self.min_window, self.max_window, self.device = min_window, max_window, device

    def prefill(self, items, target_hidden=None) -> None:
        pass  # nothing to keep in sync

    def propose(self, reqs: list[Request], steps: int, sampling) -> Proposal:
        if steps == 0:  # adaptive step 0: no speculation, and no drafter state to keep warm
            return Proposal(torch.zeros(len(reqs), 0, dtype=torch.int64, device=self.device), [0] * len(reqs))
        drafts = [ngram_match(np.asarray(r.prompt_ids + r.output_ids), steps, self.min_window, self.max_window) for r in reqs]
        padded = np.zeros((len(reqs), steps), dtype=np.int64)
        for b, d in enumerate(drafts):
            padded[b, : len(d)] = d
        return Proposal(torch.from_numpy(padded).to(self.device), [len(d) for d in drafts])

    def commit(self, reqs: list[Request], steps: int, num_accepted: list[int]) -> None:
        pass
