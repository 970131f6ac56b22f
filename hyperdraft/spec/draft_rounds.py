"""DraftRounds: propose() and propose_tree() for a drafter whose rounds run through draft_chain / draft_tree.

A greedy round that fits a captured graph runs as one (draft_graphs.DraftLoopGraphs); any other round runs the
catch-up and each draft step through the runner's own graph-or-eager dispatch. Either way the step batches are the
ones DraftAnchor builds on the device.

A drafter gives: runner, sample_drafts, feeds_hidden, and
  catch_up_tokens(req)                  the tokens its catch-up feeds, from index req.draft_num_computed on (>= 1);
                                        the last is the root (the last committed token)
  catch_up_batch(reqs, tokens, width)   the catch-up ForwardBatch, ragged (width None) or padded to width
  catch_up_hidden(rows, width)          the padded catch-up's hidden inputs [B * width, H], or None
  caught_up(reqs)                       record what the catch-up fed
"""

from __future__ import annotations

import contextlib

import torch

from hyperdraft.request import Request
from hyperdraft.sample.logits_ops import SamplingBatch, penalised_logits
from hyperdraft.spec.chain_loop import draft_chain
from hyperdraft.spec.draft_anchor import CatchUpRows, DraftAnchor
from hyperdraft.spec.draft_choice import choose_draft, draws_from_q
from hyperdraft.spec.draft_graphs import DraftLoopGraphs
from hyperdraft.spec.proposal import Proposal, TreeProposal
from hyperdraft.spec.tier import Tier
from hyperdraft.spec.tree_loop import draft_tree
from hyperdraft.spec.tree_sampled import draft_q


class DraftRounds:
    draft_loop: DraftLoopGraphs | None = None
    timer = None  # a PhaseTimer, set by the SpecWorker

    def propose(self, reqs: list[Request], steps: int, sampling: SamplingBatch) -> Proposal:
        """A chain of `steps` drafts per request."""
        sampled = draws_from_q(self.sample_drafts, sampling)
        rows = self._catch_up_rows(reqs)
        fit = self._loop_fit(Tier(steps), rows, sampled, sampling)
        qs: list[torch.Tensor] = []
        if fit is not None:
            (tokens,) = self.draft_loop.run(rows, Tier(steps), *fit)
        else:
            fb, first = self.catch_up(reqs, rows.tokens)

            def choose(j: int, logits: torch.Tensor, prefix: torch.Tensor):
                return choose_draft(logits, sampling.at_offset(prefix), sampled)

            tokens, qs = draft_chain(self.runner.forward, fb, first, DraftAnchor.after(fb, rows.step_bases), steps,
                                     choose, self.runner.page_table, self.feeds_hidden)
        self.caught_up(reqs)
        return Proposal(tokens, [steps] * len(reqs), torch.stack(qs, 1) if qs else None)

    def propose_tree(self, reqs: list[Request], steps: int, topk: int, num_nodes: int,
                     sampling: SamplingBatch) -> TreeProposal:
        """A tree of num_nodes per request: a beam over top-k children, or children drawn from q (a sampled tree,
        verified with the real q). Depth d's frontier sits at RoPE position root + d, written at offsets
        1 + (d-1)*topk + f past the root."""
        sampled = draws_from_q(self.sample_drafts, sampling)
        rows = self._catch_up_rows(reqs)
        tier = Tier(steps, topk, num_nodes)
        fit = self._loop_fit(tier, rows, sampled, sampling)
        if fit is not None:
            out = self.draft_loop.run(rows, tier, *fit)
        else:
            fb, first = self.catch_up(reqs, rows.tokens)

            def distribution(logits: torch.Tensor, k: int) -> torch.Tensor:
                siblings = sampling if k == 1 else sampling.repeat_rows(k)
                if sampled:
                    return draft_q(logits, siblings, topk)
                return torch.log_softmax(penalised_logits(logits, siblings), -1)

            out = draft_tree(self.runner.forward, fb, first, DraftAnchor.after(fb, rows.step_bases), steps, topk,
                             num_nodes, distribution, self.runner.page_table, self.feeds_hidden,
                             (sampling.seeds, sampling.positions) if sampled else None)
        self.caught_up(reqs)
        return TreeProposal(*out)

    def _catch_up_rows(self, reqs: list[Request]) -> CatchUpRows:
        return CatchUpRows([r.row for r in reqs], [r.draft_num_computed for r in reqs],
                           [self.catch_up_tokens(r) for r in reqs])

    def _loop_fit(self, tier: Tier, rows: CatchUpRows, sampled: bool, sampling: SamplingBatch):
        """(padded batch size, width) of the whole-round graph that can run this round, or None."""
        if self.draft_loop is None or sampled or sampling.penalties is not None:
            return None
        return self.draft_loop.padded(tier, len(rows.rows), rows.widest)

    def catch_up(self, reqs: list[Request], tokens_in: list[list[int]] | None = None):
        """Run the catch-up alone -> (its ForwardBatch, its ForwardOutput): padded to a captured width when a
        per-step graph can run it, else ragged and eager."""
        tokens_in = tokens_in or [self.catch_up_tokens(r) for r in reqs]
        graphs = self.runner.graphs
        width = graphs.extend_width(len(reqs), max(map(len, tokens_in))) if graphs is not None else None
        fb = self.catch_up_batch(reqs, tokens_in, width)
        with self.timer.phase("draft_extend") if self.timer is not None else contextlib.nullcontext():
            return fb, self.runner.forward(fb)
