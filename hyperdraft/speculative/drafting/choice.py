"""How a draft model turns its logits into a draft token: greedy (q one-hot), a draw from q verified by rejection
sampling, or a draw from q with the target's own noise (coupled verification, verify/coupled.py)."""

from __future__ import annotations

import torch

from hyperdraft.kernels.argmax import argmax_rows
from hyperdraft.sample.logits_ops import SamplingBatch, penalised_logits, probs_from_logits
from hyperdraft.sample.rng import DOMAIN_DRAFT, DOMAIN_SAMPLE, sample_from_probs


def draws_from_q(forced: bool | None, sampling: SamplingBatch) -> bool:
    """Draw drafts from q this step? Forced by speculative_use_rejection_sampling, else whenever a request samples:
    measured to accept more at temperature > 0, while all-greedy batches do better with greedy / top-k drafts."""
    return forced if forced is not None else not sampling.all_greedy


def choose_draft(logits: torch.Tensor, sb: SamplingBatch, sampled: bool,
                 coupled: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits: [B, V] -> (draft tokens [B], q [B, V] when rejection sampling needs it, else None).

    coupled: the draw uses the noise the target's keyed sample will use at this position (DOMAIN_SAMPLE), so the
    two races pick the same token whenever q is close to p; verification needs no q."""
    logits = penalised_logits(logits, sb)
    if not sampled:
        return argmax_rows(logits), None
    q = probs_from_logits(logits, sb)  # the same transform that defines the target's p
    if coupled:
        return sample_from_probs(q, sb.seeds, sb.positions, DOMAIN_SAMPLE), None
    return sample_from_probs(q, sb.seeds, sb.positions, DOMAIN_DRAFT), q
