"""How a draft model turns its logits into a draft token: greedy (q one-hot), a draw from q verified by rejection
sampling, or a draw from q with the target's own noise (coupled verification, verify/coupled.py).

chain_chooser and tree_distribution build the per-step choice of a round from its SamplingBatch; the step-by-step
path and the whole-round graphs of drawn drafts (drafting/graphs.py) both call them, so a graph runs the same ops.
Which ops those are is decided by the batch's host flags alone (SamplingKey), never by device values."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperdraft.kernels.argmax import argmax_rows
from hyperdraft.sample.logits_ops import SamplingBatch, penalised_logits, probs_from_logits
from hyperdraft.sample.rng import DOMAIN_DRAFT, DOMAIN_SAMPLE, sample_from_probs
from hyperdraft.speculative.drafting.sampled_tree import draft_q


def draws_from_q(forced: bool | None, sampling: SamplingBatch) -> bool:
    """Draw drafts from q this step? Forced by speculative_use_rejection_sampling, else whenever a request samples:
    measured to accept more at temperature > 0, while all-greedy batches do better with greedy / top-k drafts."""
    return forced if forced is not None else not sampling.all_greedy


@dataclass(frozen=True)
class SamplingKey:
    """Everything that picks the ops of a round whose drafts read its sampling rows (drawn from q, or penalised):
    whether they are drawn, whether penalties apply, and for draws the SamplingBatch's host flags (probs_from_logits
    branches on them) and coupled verification (its draws need no q). Two rounds with the same key run the same
    kernels, whatever their rows' values, so a graph captured for one replays the other exactly."""

    drawn: bool
    penalised: bool
    all_greedy: bool = False
    any_greedy: bool = False
    need_top_k: bool = False
    need_top_p: bool = False
    need_min_p: bool = False
    coupled: bool = False

    @classmethod
    def of(cls, sb: SamplingBatch, drawn: bool, coupled: bool) -> "SamplingKey | None":
        """None for greedy, unpenalised drafts (argmax chains and top-k beams read no sampling row). Undrawn,
        penalised drafts take the argmax (chains) or top-k (beams) of the penalised logits: no flag matters."""
        penalised = sb.penalties is not None
        if not drawn:
            return cls(False, True) if penalised else None
        return cls(True, penalised, sb.all_greedy, sb.any_greedy, sb.need_top_k, sb.need_top_p, sb.need_min_p, coupled)


def chain_chooser(sampling: SamplingBatch, sampled: bool, coupled: bool):
    """A chain step's choice (drafting/chain.Chooser): step j draws for position + j; q when rejection needs it."""

    def choose(j: int, out, prefix: torch.Tensor, dest: torch.Tensor) -> torch.Tensor | None:
        tokens, q = choose_draft(out.target_logits(), sampling.at_offset(prefix), sampled, coupled)
        dest.copy_(tokens)
        return q

    return choose


def tree_distribution(sampling: SamplingBatch, sampled: bool, topk: int):
    """A tree node's distribution (drafting/tree.NodeDistribution): q for a sampled tree, else log q for a beam;
    k siblings per request share its row of parameters."""
    def distribution(logits: torch.Tensor, k: int) -> torch.Tensor:
        siblings = sampling if k == 1 else sampling.repeat_rows(k)
        if sampled:
            return draft_q(logits, siblings, topk)
        return torch.log_softmax(penalised_logits(logits, siblings), -1)

    return distribution


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
