"""Dynamic tree drafting (topk > 1), independent of which model drafts.

A round grows a beam, SGLang/EAGLE-2 style. Step 0 takes the topk children of the root. Every later step
expands each of the topk frontier nodes by its topk children and keeps the best topk of those topk*topk
candidates, by cumulative draft log-probability, as the next frontier. Every candidate ever produced is
remembered. The verify tree is then the root plus the num_draft_tokens - 1 best candidates.

The selection is stable-sorted by score with candidates in creation order. A child's score never exceeds
its parent's, so a kept child's parent is always kept too. Keeping creation order puts parents before
children.

Candidate bookkeeping is per request, as [B, C] tensors with C growing by topk*topk per step:
  cand_tokens  token of each candidate
  cand_parent  candidate index of its parent, -1 for children of the root
  cand_score   cumulative draft log-probability
  cand_fed     offset (past the root's sequence index) where the draft wrote the candidate's K/V, -1 if never fed
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Candidates:
    tokens: torch.Tensor  # [B, C] int64
    parent: torch.Tensor  # [B, C] int64
    score: torch.Tensor  # [B, C] float32
    fed: torch.Tensor  # [B, C] int64

    def extend(self, tokens, parent, score) -> "Candidates":
        return Candidates(torch.cat([self.tokens, tokens], 1), torch.cat([self.parent, parent], 1),
                          torch.cat([self.score, score], 1), torch.cat([self.fed, torch.full_like(tokens, -1)], 1))


def root_candidates(root_lp: torch.Tensor, root_tok: torch.Tensor) -> Candidates:
    """root_lp, root_tok: [B, topk] the root's most likely children (log-probabilities, tokens), largest first."""
    return Candidates(root_tok, torch.full_like(root_tok, -1), root_lp, torch.full_like(root_tok, -1))


def expand(cands: Candidates, frontier: torch.Tensor, child_lp: torch.Tensor, child_tok: torch.Tensor, topk: int):
    """frontier: [B, k] candidate indices just fed; child_lp, child_tok: [B, k, topk] each one's most likely
    children. -> (candidates with k*k new children appended, the next frontier [B, k] of candidate indices,
        each new frontier node's parent as a slot of the old frontier [B, k])."""
    bsz, k = frontier.shape
    child_score = cands.score.gather(1, frontier)[:, :, None] + child_lp
    parent = frontier[:, :, None].expand(bsz, k, topk)
    base = cands.tokens.shape[1]
    cands = cands.extend(child_tok.flatten(1), parent.flatten(1), child_score.flatten(1))
    best = child_score.flatten(1).topk(k, dim=-1).indices  # [B, k] among the new k*topk
    return cands, base + best, best // topk


def ancestors_fed(cands: Candidates, nodes: torch.Tensor, depth: int) -> torch.Tensor:
    """nodes: [B, k] candidate indices at `depth` -> [B, k, depth] fed offsets of their ancestors below the
    root (deepest last), for the draft's attention mask."""
    out, cur = [], nodes
    for _ in range(depth):
        parent = cands.parent.gather(1, cur)
        out.append(cands.fed.gather(1, parent.clamp_min(0)))
        cur = parent.clamp_min(0)
    return torch.stack(out[::-1], 2) if out else nodes.new_zeros(*nodes.shape, 0)


def select_tree(cands: Candidates, root_tokens: torch.Tensor, num_nodes: int):
    """-> (tokens [B, N], parents [B, N], fed [B, N]) with node 0 the root and the N-1 best candidates after it."""
    bsz, c = cands.tokens.shape
    order = torch.sort(cands.score, dim=1, descending=True, stable=True).indices[:, : num_nodes - 1]
    chosen = order.sort(dim=1).values  # creation order: parents first
    node_of = torch.full((bsz, c + 1), -1, dtype=torch.int64, device=chosen.device)  # candidate -> node; slot c = root
    node_of.scatter_(1, chosen, torch.arange(1, num_nodes, device=chosen.device).expand(bsz, -1))
    node_of[:, c] = 0
    parent_cand = cands.parent.gather(1, chosen)
    parents = node_of.gather(1, torch.where(parent_cand < 0, torch.full_like(parent_cand, c), parent_cand))
    root = torch.zeros(bsz, 1, dtype=torch.int64, device=chosen.device)
    tokens = torch.cat([root_tokens[:, None], cands.tokens.gather(1, chosen)], 1)
    return tokens, torch.cat([root - 1, parents], 1), torch.cat([root, cands.fed.gather(1, chosen)], 1)


def step_mask(cands: Candidates, frontier: torch.Tensor, offsets: torch.Tensor, depth: int, topk: int) -> torch.Tensor:
    """[B, k, 1 + (depth-1)*topk + k] tail mask for feeding the k frontier nodes at `depth`: the root (column 0),
    each frontier node's fed ancestors, and itself. Column o is the key at offset o past the root's index, and the
    tail ends at the last key fed (earlier depths fed topk nodes each)."""
    bsz, k = frontier.shape
    mask = torch.zeros(bsz, k, 1 + (depth - 1) * topk + k, dtype=torch.bool, device=frontier.device)
    mask[:, :, 0] = True
    anc = ancestors_fed(cands, frontier, depth - 1)  # [B, k, depth-1]
    if anc.shape[2]:
        mask.scatter_(2, anc, True)
    return mask.scatter_(2, offsets[:, :, None], True)


def grow_tree(root_children, root_hidden, step, steps: int, topk: int, root_tokens, num_nodes: int):
    """Run the beam for `steps` levels with any drafter.
    root_children: (log-probs, tokens) [B, topk] of the root's most likely children; root_hidden: [B, H] or None,
    what the root's children are fed with (EAGLE: the head's output at the root). step(depth, tokens [B, k],
    offsets [B, k], mask [B, k, 1+depth*k], parent_hidden [B, k, H] | None) feeds the frontier and returns
    ((log-probs, tokens) [B, k, topk] of each one's most likely children, hidden [B, k, H] | None).
    -> (tokens [B, N], parents [B, N], fed [B, N])."""
    bsz = root_tokens.shape[0]
    device = root_tokens.device
    cands = root_candidates(*root_children)
    frontier = torch.arange(topk, device=device).expand(bsz, topk)
    parent_hidden = None if root_hidden is None else root_hidden[:, None].expand(bsz, topk, -1)
    for depth in range(1, steps):
        offsets = 1 + (depth - 1) * topk + torch.arange(topk, device=device).expand_as(frontier)
        cands.fed.scatter_(1, frontier, offsets)
        mask = step_mask(cands, frontier, offsets, depth, topk)
        (child_lp, child_tok), hidden = step(depth, cands.tokens.gather(1, frontier), offsets, mask, parent_hidden)
        cands, frontier, parent_slot = expand(cands, frontier, child_lp, child_tok, topk)
        if hidden is not None:
            parent_hidden = hidden.gather(1, parent_slot[:, :, None].expand(-1, -1, hidden.shape[2]))
    return select_tree(cands, root_tokens, num_nodes)
