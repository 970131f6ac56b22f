"""Sampled tree drafting: trees whose children are draws from the draft distribution q, verified with the real q.

Recursive rejection sampling (tree_verify.py, sample_without_replacement=True) is lossless when, at every node v,
the children tried are c_1, c_2, ... drawn from q_v without replacement, and HOW MANY of them are kept does not
depend on which tokens they are. Otherwise the draw is biased by the selection. So this grower:
  - draws each node's children by Gumbel-top-k on log q_v (an ordered sample without replacement);
  - keeps, at depth d, a fixed budget b_d of nodes chosen by (parent's cumulative score, child's draw rank):
    information about the parent, never about the child's own token;
  - expands, as the next frontier, the best kept nodes by their own cumulative score (that only decides
    whether a node gets children, which is upstream of those children).
Greedy requests use q_v = uniform over the draft's top-k tokens, so they get the deterministic top-k children (in a
random order, which RRS handles exactly) and stay token-for-token identical to plain decoding.
"""

from __future__ import annotations

import torch

from hyperdraft.sample.rng import DOMAIN_DRAFT, uniform
from hyperdraft.speculative.adaptive.tier import TREE_NODE_LIMIT


def level_budgets(num_nodes: int, steps: int, topk: int) -> list[int]:
    """Split the num_nodes - 1 draft nodes over the depths: one per depth first (as far as they go), then the rest
    shallow-first, never more than the previous level's frontier can produce."""
    left = num_nodes - 1
    budgets = [0] * steps
    for d in range(steps):
        if left:
            budgets[d], left = 1, left - 1
    for d in range(steps):
        cap = topk if d == 0 else min(topk, budgets[d - 1]) * topk
        extra = min(left, cap - budgets[d])
        budgets[d] += extra
        left -= extra
    return [b for b in budgets if b]


def gumbel_topk(q: torch.Tensor, k: int, seeds: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """q: [R, V] -> [R, k] tokens drawn from q without replacement, in draw order. stream: [R] int64, a distinct
    counter per row (position and node), so every node draws independently."""
    gumbel = -torch.log(-torch.log(uniform(seeds, stream, DOMAIN_DRAFT, q.shape[-1])))
    return (torch.log(q) + gumbel).topk(k, dim=-1).indices


def greedy_q(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """Uniform over the top-k tokens: the children of a greedy request are the draft's top-k, in random order."""
    top = logits.topk(topk, dim=-1).indices
    return torch.zeros_like(logits).scatter_(-1, top, 1.0 / topk)


def draft_q(logits: torch.Tensor, sb, topk: int) -> torch.Tensor:
    """The q a node's children are drawn from: the request's own sampling transform (the one that defines p), or,
    for greedy requests, uniform over the draft's top-k. logits: [R, V]; sb: a SamplingBatch of R rows."""
    from hyperdraft.sample.logits_ops import penalised_logits, probs_from_logits

    logits = penalised_logits(logits, sb)
    return torch.where(sb.greedy[:, None], greedy_q(logits, topk), probs_from_logits(logits, sb))


def grow_sampled_tree(root_q, root_hidden, step, steps: int, topk: int, roots, num_nodes: int, seeds, positions):
    """root_q: [B, V] q of the root's children; root_hidden: [B, H] | None, fed with the root's children.
    step(depth, tokens [B, k], offsets [B, k], mask, parent_hidden) feeds a frontier (k <= topk nodes) and returns
    (q [B, k, V] over each fed node's children, hidden [B, k, H] | None).
    seeds: [B]; positions: [B] sequence index of the root's children.
    -> (tokens [B, N], parents [B, N], fed [B, N], q_nodes [B, N, V]); N = num_nodes, node 0 = the root."""
    from hyperdraft.speculative.drafting.beam import Candidates, step_mask

    bsz, vocab = root_q.shape
    device = root_q.device
    tokens, parents = [roots[:, None]], [torch.full((bsz, 1), -1, dtype=torch.int64, device=device)]
    fed, score = [torch.zeros(bsz, 1, dtype=torch.int64, device=device)], [torch.zeros(bsz, 1, device=device)]
    q_nodes = [root_q[:, None]]
    frontier = torch.zeros(bsz, 1, dtype=torch.int64, device=device)  # node ids whose children are drawn next
    frontier_q = root_q[:, None]  # [B, kf, V]
    frontier_hidden = None if root_hidden is None else root_hidden[:, None]  # [B, kf, H]: fed with their children
    budgets = level_budgets(num_nodes, steps, topk)
    count = 1
    for depth, budget in enumerate(budgets, start=1):
        kf = frontier.shape[1]
        stream = (positions[:, None] + depth - 1) * TREE_NODE_LIMIT + frontier  # one stream per (position, parent)
        child = gumbel_topk(frontier_q.flatten(0, 1), topk, seeds.repeat_interleave(kf), stream.flatten()).view(bsz, kf * topk)
        slot = torch.arange(kf, device=device).repeat_interleave(topk)[None].expand(bsz, -1)  # parent's frontier slot
        rank = torch.arange(topk, device=device).repeat(kf)[None].expand(bsz, -1)
        parent_score = torch.cat(score, 1).gather(1, frontier).gather(1, slot)
        # Keep by (parent score desc, draw rank asc) -- never by the child's own token.
        order = torch.sort(rank, dim=1, stable=True).indices
        order = order.gather(1, torch.sort(parent_score.gather(1, order), dim=1, descending=True, stable=True).indices)
        kept = order[:, :budget]
        kept_slot = slot.gather(1, kept)
        tok = child.gather(1, kept)
        q_parent = frontier_q.gather(1, kept_slot[:, :, None].expand(-1, -1, vocab))
        own = parent_score.gather(1, kept) + torch.log(q_parent.gather(2, tok[:, :, None])[:, :, 0])
        tokens.append(tok)
        parents.append(frontier.gather(1, kept_slot))
        score.append(own)
        fed.append(torch.full_like(tok, -1))
        q_nodes.append(torch.zeros(bsz, budget, vocab, device=device))
        if depth == len(budgets):
            break
        pick = own.topk(min(topk, budget), dim=1).indices  # next frontier: the best kept nodes by their own score
        offsets = 1 + (depth - 1) * topk + torch.arange(pick.shape[1], device=device)[None].expand(bsz, -1)
        fed[-1].scatter_(1, pick, offsets)
        frontier = count + pick
        count += budget
        cands = Candidates(torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(score, 1), torch.cat(fed, 1))
        parent_hidden = None
        if frontier_hidden is not None:
            parent_hidden = frontier_hidden.gather(1, kept_slot.gather(1, pick)[:, :, None].expand(-1, -1, frontier_hidden.shape[2]))
        frontier_q, frontier_hidden = step(depth, tok.gather(1, pick), offsets, step_mask(cands, frontier, offsets, depth, topk), parent_hidden)
        q_nodes[-1].scatter_(1, pick[:, :, None].expand(-1, -1, vocab), frontier_q)
    return torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(fed, 1), torch.cat(q_nodes, 1)
