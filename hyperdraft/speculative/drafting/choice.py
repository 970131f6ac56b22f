"""How a draft model turns its logits into a draft token: greedy (q one-hot) or a draw from q."""

from __future__ import annotations

import torch

from hyperdraft.kernels.argmax import argmax_rows
from hyperdraft.sample.logits_ops import SamplingBatch, penalised_logits, probs_from_logits
from hyperdraft.sample.rng import DOMAIN_DRAFT, sample_from_probs


def draws_from_q(forced: bool | None, sampling: SamplingBatch) -> bool:
    """Draw drafts from q this step? Forced by speculative_use_rejection_sampling, else whenever a request samples:
    measured to accept more at temperature > 0, while all-greedy batches do better with greedy / top-k drafts."""
    return forced if forced is not None else not sampling.all_greedy


def choose_draft(logits: torch.Tensor, sb: SamplingBatch, sampled: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits: [B, V] -> (draft tokens [B], q [B, V] when drawn from q, else None: q is one-hot)."""
    logits = penalised_logits(logits, sb)
    if not sampled:
        return argmax_rows(logits), None
    q = probs_from_logits(logits, sb)  # the same transform that defines the target's p
    return sample_from_probs(q, sb.seeds, sb.positions, DOMAIN_DRAFT), q
