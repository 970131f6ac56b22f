"""Simulated acceptance: a LOSSY, benchmark-only replacement for the accept decision.

System speed at a known acceptance is what a speculative-decoding benchmark wants to measure, but random-weight
models (or a draft that does not match its target) accept almost nothing. With a simulated accept rate alpha,
every draft and verify kernel still runs exactly as usual; only the decision changes:

  chain  draft j is accepted iff coin_j < alpha and drafts 0 .. j-1 were accepted (so E[accepted] follows the
         geometric law of a per-token acceptance alpha), then one token is drawn from the target's p at the first
         unaccepted row, exactly like a bonus token
  tree   one coin u per level; the walk moves to the node's child of rank r (children in the order verification
         tries them) for the smallest r with u < 1 - (1 - alpha) * (1 - s)^r, and stops when no child has: rank 0
         matches with probability alpha, and each later sibling with probability s when those before it did not
         (the sibling rate s, speculative_simulate_sibling_rate). s unset (0): only the first child can match, and
         a tree accepts like a chain at alpha, whatever its width

Accepted drafts are NOT checked against the target, so outputs differ from the target model's. The engine
therefore refuses this mode unless asked for explicitly, and marks every output produced under it.
"""

from __future__ import annotations

import torch

from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels.draft_plan import accept_chain
from hyperdraft.sample.rng import DOMAIN_ACCEPT, DOMAIN_SAMPLE, sample_from_probs, uniform
from hyperdraft.speculative.verify.tree_buffers import DraftTree


def simulate_chain(
    p: torch.Tensor | None,  # [B, K+1, V] target distributions per verify row (None with greedy_target)
    draft: torch.Tensor,  # [B, K] int64 draft tokens
    draft_len: torch.Tensor,  # [B] int64 real drafts per request
    alpha: float,
    seeds: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64, sequence index of d_0
    greedy_target: torch.Tensor | None = None,  # [B, K+1] argmax of every row, when every p is one-hot (p unused)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as verify_chain: -> (num_accepted [B], tokens [B, K+1]). Greedy targets on CUDA: one launch
    (kernels/draft_plan.accept_chain)."""
    if greedy_target is not None and use_fused_kernels(draft):
        return accept_chain(greedy_target, draft, draft_len, (alpha, seeds, seq_lens, DOMAIN_ACCEPT))
    bsz, k = draft.shape
    idx = torch.arange(k, device=draft.device)
    coins = uniform(seeds.repeat_interleave(k), (seq_lens[:, None] + idx).flatten(), DOMAIN_ACCEPT).view(bsz, k)
    passed = (coins < alpha) & (idx < draft_len[:, None])
    num_accepted = passed.long().cumprod(1).sum(1)
    rows = torch.arange(bsz, device=draft.device)
    if greedy_target is not None:  # the race over a one-hot p picks its argmax
        last = greedy_target[rows, num_accepted]
    else:
        last = sample_from_probs(p[rows, num_accepted], seeds, seq_lens + num_accepted, DOMAIN_SAMPLE)
    tokens = torch.cat([draft, draft.new_zeros(bsz, 1)], 1)
    tokens[rows, num_accepted] = last
    return num_accepted, tokens


def simulate_tree(
    p: torch.Tensor | None,  # [B, N, V] (None with greedy_target)
    tree: DraftTree,
    alpha: float,
    seeds: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int64
    max_depth: int,
    greedy_target: torch.Tensor | None = None,  # [B, N] argmax of every node's row, when every p is one-hot
    sibling_rate: float | None = None,
    max_children: int = 1,  # siblings tried per node (the tier's topk)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as verify_tree: -> (num_accepted [B], path [B, D+1], tokens [B, D+1])."""
    bsz, device = tree.tokens.shape[0], tree.tokens.device
    rows = torch.arange(bsz, device=device)
    cur = torch.zeros(bsz, dtype=torch.int64, device=device)
    going = torch.ones(bsz, dtype=torch.bool, device=device)
    num_accepted = torch.zeros_like(cur)
    path = torch.full((bsz, max_depth + 1), -1, dtype=torch.int64, device=device)
    path[:, 0] = 0
    out = torch.full_like(path, -1)
    ranks = max_children if sibling_rate else 1  # without a sibling rate only first children can match
    miss = [(1.0 - alpha) * (1.0 - (sibling_rate or 0.0)) ** r for r in range(ranks)]
    # every level's coin in one draw (the bits of a draw per level: a row's uniform depends on its seed and position)
    positions = (seq_lens[:, None] + torch.arange(max_depth, device=device)).flatten()
    coins = uniform(seeds.repeat_interleave(max_depth), positions, DOMAIN_ACCEPT)[:, 0].view(bsz, max_depth)
    for d in range(max_depth):
        child, found = _matching_child(tree, rows, cur, coins[:, d], miss)
        going &= found
        child = child.clamp_min(0)
        num_accepted += going.long()
        path[:, d + 1] = torch.where(going, child, -1)
        out[:, d] = torch.where(going, tree.tokens[rows, child], out[:, d])
        cur = torch.where(going, child, cur)
    if greedy_target is not None:  # the race over a one-hot p picks its argmax
        out[rows, num_accepted] = greedy_target[rows, cur]
    else:
        out[rows, num_accepted] = sample_from_probs(p[rows, cur].float(), seeds, seq_lens + num_accepted, DOMAIN_SAMPLE)
    return num_accepted, path, out


def _matching_child(tree: DraftTree, rows: torch.Tensor, cur: torch.Tensor, coin: torch.Tensor,
                    miss: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """The child of each row's current node whose rank r is the smallest with coin < 1 - miss[r] (miss[r]: the
    chance that ranks 0..r all miss) -> (child [B], found [B] bool)."""
    child = tree.first_child[rows, cur]
    picked = torch.full_like(child, -1)
    for r, missed in enumerate(miss):
        hit = (picked < 0) & (child >= 0) & (coin < 1.0 - missed)
        picked = torch.where(hit, child, picked)
        child = torch.where(child >= 0, tree.next_sibling[rows, child.clamp_min(0)], child)
    return picked, picked >= 0
