"""Sampler: raw logits -> one token per row (plus its log-probability)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hyperdraft.kernels.argmax import argmax_rows
from hyperdraft.sample.logits_ops import SamplingBatch, penalised_logits, probs_from_logits, token_logprobs
from hyperdraft.sample.rng import DOMAIN_SAMPLE, sample_from_probs


class SampledTokens(NamedTuple):
    tokens: torch.Tensor  # [N] int64
    # [N] float32, under the model distribution after penalties, before temperature and filtering; None when no
    # row's request asked for them (SamplingBatch.want_logprobs)
    logprobs: torch.Tensor | None


def sampled_rows(host: SampledTokens) -> list[tuple[list[int], list[float]]]:
    """SampledTokens as host lists -> per row (its one new token, that token's logprob, or none when the step
    computed none)."""
    logprobs = host.logprobs if host.logprobs is not None else [None] * len(host.tokens)
    return [([int(token)], [] if logprob is None else [logprob]) for token, logprob in zip(host.tokens, logprobs)]


class Sampler:
    def sample(self, logits: torch.Tensor, sb: SamplingBatch) -> SampledTokens:
        """logits: [N, V] -> one token per row and, when some row wants it, its logprob."""
        logits = penalised_logits(logits.float(), sb)
        if sb.all_greedy:
            tokens = argmax_rows(logits)
        else:
            probs = probs_from_logits(logits, sb)
            tokens = sample_from_probs(probs, sb.seeds, sb.positions, DOMAIN_SAMPLE)
        return SampledTokens(tokens, token_logprobs(logits, tokens) if sb.want_logprobs else None)
