"""The chain draft of a round: after the catch-up, steps 1 .. K-1, each feeding the token the step before chose.

draft_chain runs it for both drafters (an EAGLE head, a STANDALONE draft model). Its step batches are built on the
device from the catch-up batch (draft_anchor.DraftAnchor), so the whole loop is capturable: greedy rounds run as one
CUDA graph (draft_graphs.py), and the eager path runs the same function through the runner's graph-or-eager dispatch.
"""

from __future__ import annotations

from typing import Callable

import torch

from hyperdraft.core.forward_batch import ForwardBatch
from hyperdraft.runner.model_runner import ForwardOutput
from hyperdraft.speculative.drafting.anchor import DraftAnchor

# (step j, the step's forward output (logits [B, V] or [B, Vd] with its vocab map), draft tokens chosen so far
# [B, j], destination [B]) -> q [B, V], or None when q is one-hot; writes the chosen draft tokens into the destination
Chooser = Callable[[int, ForwardOutput, torch.Tensor, torch.Tensor], torch.Tensor | None]


def draft_chain(forward, catch_up: ForwardBatch, first, anchor: DraftAnchor, steps: int, choose: Chooser, page_table,
                feeds_hidden: bool, stateful: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """-> (draft tokens [B, steps], the q of each step when drafts are drawn from q).

    first: the catch-up's ForwardOutput, whose logits rows give d_0. forward(fb) -> ForwardOutput runs step j,
    which feeds d_{j-1} (and, for an EAGLE head, feeds_hidden: the head's own output at the step before) and gives
    d_j. stateful: a recurrent draft model; step j's state goes to scratch j - 1, from step j - 1's (-1: the
    committed state, which the catch-up left after the root)."""
    out, hidden = first, first.hidden_at_logits(catch_up.logits_indices)
    anchor.plan(steps - 1, 1, 1, page_table)
    tokens = torch.empty(out.logits.shape[0], steps, dtype=torch.int64, device=out.logits.device)  # every column chosen
    qs = []
    for j in range(steps):
        if j > 0:
            state = chain_state_nodes(j, tokens.shape[0], tokens.device) if stateful else None
            out = forward(anchor.step_batch(j, 1, tokens[:, j - 1], page_table, hidden if feeds_hidden else None,
                                            state_nodes=state))
            hidden = out.hidden
        q = choose(j, out, tokens[:, :j], tokens[:, j])
        if q is not None:
            qs.append(q)
    return tokens, qs


def chain_state_nodes(j: int, bsz: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents, targets) [B] of chain step j: scratch j - 2 (-1: committed) into scratch j - 1."""
    return torch.full((bsz,), j - 2, device=device), torch.full((bsz,), j - 1, device=device)


def choose_argmax(j: int, out: ForwardOutput, prefix: torch.Tensor, dest: torch.Tensor) -> None:
    out.greedy_tokens(dest)  # straight into the token grid
