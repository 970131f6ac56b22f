"""Lossless verification of chains of draft tokens.

Terms, for one request with k draft tokens d_0 .. d_{k-1}:
  p_j        the target's sampling distribution for the token at draft index j (verify row j; row 0 follows
             the last committed token), after the request's penalties, temperature, top-k/top-p/min-p
  q_j        the distribution d_j was drawn from; one-hot when the drafter is deterministic (NGRAM, greedy drafts)
  accepted   the leading drafts that pass the test below
  recovered  the token drawn from norm(max(0, p_a - q_a)) at the first rejected index a
  bonus      the token drawn from p_k when every draft passes
Output = accepted drafts + one recovered-or-bonus token: 1 .. k+1 tokens.

Greedy requests have a one-hot p, so the same rule accepts exactly the drafts that equal the argmax, and the
recovered/bonus token is the argmax: greedy output is token-for-token that of plain decoding.
"""

from __future__ import annotations

import torch

from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels.draft_plan import accept_chain
from hyperdraft.sample.rng import DOMAIN_ACCEPT, DOMAIN_SAMPLE, sample_from_probs, uniform


def verify_chain(
    p: torch.Tensor,  # [B, K+1, V] target distributions per verify row
    draft: torch.Tensor,  # [B, K] int64 draft tokens, padded past draft_len
    draft_len: torch.Tensor,  # [B] int64 real drafts per request (0 .. K)
    q: torch.Tensor | None,  # [B, K, V] draft distributions, or None for one-hot drafts
    seeds: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64, sequence index of d_0
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (num_accepted [B], tokens [B, K+1]); tokens[b, :num_accepted[b] + 1] is request b's output."""
    bsz, k = draft.shape
    idx = torch.arange(k, device=draft.device)
    p_draft = p[:, :k].gather(2, draft[..., None])[..., 0]  # [B, K]
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(2, draft[..., None])[..., 0]
    coins = uniform(seeds.repeat_interleave(k), (seq_lens[:, None] + idx).flatten(), DOMAIN_ACCEPT).view(bsz, k)

    # Accept d_j iff u_j < min(1, p_j(d_j) / q_j(d_j)), written without division: u_j * q_j(d_j) < p_j(d_j).
    passed = (coins * q_draft < p_draft) & (idx < draft_len[:, None])
    num_accepted = passed.long().cumprod(1).sum(1)  # [B]

    rows = torch.arange(bsz, device=draft.device)
    p_last = p[rows, num_accepted]  # [B, V] target distribution at the first rejection (or after the last draft)
    rejected = num_accepted < draft_len
    at = num_accepted.clamp_max(max(k - 1, 0))
    if k > 0:
        q_last = torch.zeros_like(p_last).scatter_(1, draft[rows, at][:, None], 1.0) if q is None else q[rows, at]
        residual = (p_last - q_last).clamp_min(0)
        mass = residual.sum(-1, keepdim=True)
        # A zero residual means p == q at this row, where rejection has probability zero; fall back to p.
        use_residual = rejected[:, None] & (mass > 0)
        p_last = torch.where(use_residual, residual / mass.clamp_min(1e-30), p_last)
    last_token = sample_from_probs(p_last, seeds, seq_lens + num_accepted, DOMAIN_SAMPLE)

    tokens = torch.cat([draft, draft.new_zeros(bsz, 1)], 1)
    tokens[rows, num_accepted] = last_token
    return num_accepted, tokens


def verify_greedy_chain(target: torch.Tensor, draft: torch.Tensor, draft_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """verify_chain when every p is one-hot and q is None, from the argmax tokens alone (p never materialised).
    target: [B, K+1] int64, the argmax of each verify row -> (num_accepted [B], tokens [B, K+1]).

    The same tokens without the coins and the vocabulary-wide race: each coin u lies in (0, 1), so u * 1 < p(d)
    holds exactly when p(d) = 1; the residual of two one-hots, or p itself after the last draft, is the one-hot of
    p's argmax, which the race always picks. On CUDA one launch (kernels/draft_plan.accept_chain)."""
    if use_fused_kernels(target):
        return accept_chain(target, draft, draft_len)
    bsz, k = draft.shape
    idx = torch.arange(k, device=draft.device)
    num_accepted = ((draft == target[:, :k]) & (idx < draft_len[:, None])).long().cumprod(1).sum(1)
    rows = torch.arange(bsz, device=draft.device)
    tokens = torch.cat([draft, draft.new_zeros(bsz, 1)], 1)
    tokens[rows, num_accepted] = target[rows, num_accepted]
    return num_accepted, tokens
