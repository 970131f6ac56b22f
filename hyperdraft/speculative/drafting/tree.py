"""The tree draft of a round: after the catch-up, a beam (tree_draft.grow_tree) or a sampled tree
(tree_sampled.grow_sampled_tree) grown over draft steps whose batches are built on the device (DraftAnchor).

draft_tree is shared by both drafters (an EAGLE head feeds each node its parent's head output; a STANDALONE draft
model feeds tokens only) and by both paths: greedy beams run as one CUDA graph per round (draft_graphs.py), every
other round runs the same function through the runner's graph-or-eager dispatch, one forward per depth.
"""

from __future__ import annotations

from typing import Callable

import torch

from hyperdraft.core.forward_batch import ForwardBatch
from hyperdraft.speculative.drafting.anchor import DraftAnchor
from hyperdraft.speculative.drafting.beam import grow_tree
from hyperdraft.speculative.drafting.sampled_tree import grow_sampled_tree

# (logits [R, V], rows per request k) -> [R, V]: log q for a beam, q for a sampled tree. The R = B*k rows are k
# siblings per request (k = 1 at the root), which share that request's sampling parameters.
NodeDistribution = Callable[[torch.Tensor, int], torch.Tensor]


def draft_tree(forward, catch_up: ForwardBatch, first, anchor: DraftAnchor, steps: int, topk: int, num_nodes: int,
               distribution: NodeDistribution | None, page_table, feeds_hidden: bool,
               sampled_streams: tuple[torch.Tensor, torch.Tensor] | None = None,
               stateful: bool = False) -> tuple[torch.Tensor, ...]:
    """-> (tokens [B, N], parents [B, N], fed [B, N]) of a beam; with sampled_streams = (seeds [B], positions [B])
    a sampled tree, plus q_nodes [B, N, V]. first: the catch-up's ForwardOutput; its logits rows give the root's
    children, and the root (node 0) is the catch-up's last real token. distribution None: a greedy, unpenalised
    beam, whose children are each row's top-k log-probabilities straight from its logits (ForwardOutput.top_logprobs:
    on CUDA never the [R, V] log-softmax). stateful: a recurrent draft model; each node's state goes to scratch (its
    offset - 1), from its parent's (tree_state_nodes)."""
    last = catch_up.logits_indices
    bsz = last.shape[0]
    roots = catch_up.input_ids[last]
    root_hidden = first.hidden_at_logits(last) if feeds_hidden else None
    anchor.plan(steps - 1, topk, topk, page_table)  # a beam's frontiers (a sampled tree's may be narrower)

    def nodes(out, k: int):
        """A forward's R = B*k rows -> what the tree grows from: a sampled tree's q [B, k, V]; a beam's most likely
        children, (log-probs, tokens) [B, k, topk]."""
        if sampled_streams is not None:
            return distribution(out.target_logits(), k).view(bsz, k, -1)
        if distribution is None:
            lp, tok = out.top_logprobs(topk)
        else:
            lp, tok = distribution(out.target_logits(), k).topk(topk, dim=-1)
        return lp.view(bsz, k, topk), tok.view(bsz, k, topk)

    def step(depth: int, tokens: torch.Tensor, offsets: torch.Tensor, mask: torch.Tensor, parent_hidden):
        """Feed the frontier tokens [B, k] (written at offsets 1 + (depth-1)*topk + f past the root) under their
        ancestor mask -> (nodes(...), head outputs [B, k, H] | None)."""
        k = tokens.shape[1]
        hidden_in = parent_hidden.flatten(0, 1) if parent_hidden is not None else None
        state = tree_state_nodes(offsets, mask) if stateful else None
        out = forward(anchor.step_batch(depth, topk, tokens.flatten(), page_table, hidden_in, mask, state))
        hidden = out.hidden.view(bsz, k, -1) if feeds_hidden else None
        return nodes(out, k), hidden

    if sampled_streams is not None:
        seeds, positions = sampled_streams
        return grow_sampled_tree(nodes(first, 1)[:, 0], root_hidden, step, steps, topk, roots, num_nodes, seeds,
                                 positions)
    root_lp, root_tok = nodes(first, 1)
    return grow_tree((root_lp[:, 0], root_tok[:, 0]), root_hidden, step, steps, topk, roots, num_nodes)


def tree_state_nodes(offsets: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """offsets [B, k]: the frontier's offsets past the root; mask [B, k, W]: its ancestor mask (column o = offset o)
    -> (parents, targets) [B*k] scratch indices: each node's parent is its deepest ancestor, the latest column the
    mask opens before its own (0: the root, whose state is the committed one: -1)."""
    cols = torch.arange(mask.shape[2], device=mask.device)
    parent = torch.where(mask & (cols < offsets[:, :, None]), cols, 0).amax(dim=2)
    return (parent - 1).flatten(), (offsets - 1).flatten()
