"""DraftRounds: propose() and propose_tree() for a drafter whose rounds run through draft_chain / draft_tree.

A greedy round that fits a captured graph runs as one (draft_graphs.DraftLoopGraphs); any other round runs the
catch-up and each draft step through the runner's own graph-or-eager dispatch. Either way the step batches are the
ones DraftAnchor builds on the device.

Draft-ahead: right after a greedy round's verify and accept are queued, and before its results reach the host,
draft_ahead() queues the NEXT round's whole draft graph, its catch-up packed on the device from the accepted tokens
(the drafter's ahead_catch_up). The GPU drafts while the host commits and schedules, instead of idling until the
next propose(). That propose() takes the queued drafts when its batch is the same requests under the same tier
(nothing finished, joined or was retracted) and discards them otherwise. Discarding is harmless: the queued graph
wrote only draft K/V that the next catch-up rewrites (catch-up positions, with the same values) or that no one reads
before a draft step overwrites it, in slots reserved for it when it was queued, or since released and written by
their new owner after it (one stream). The drafts equal those propose() would make. HYPERDRAFT_DRAFT_AHEAD=0 turns it
off. EAGLE heads give ahead_catch_up; a STANDALONE draft model does not: its K/V of accepted drafts is kept across
rounds (draft_num_computed reaches past the committed tokens), and the commit that follows the queuing releases those
slots before the next schedule reserves them again, possibly as other pages.

A drafter gives: runner, sample_drafts, feeds_hidden, and
  catch_up_tokens(req)                  the tokens its catch-up feeds, from index req.draft_num_computed on (>= 1);
                                        the last is the root (the last committed token)
  catch_up_batch(reqs, tokens, width)   the catch-up ForwardBatch, ragged (width None) or padded to width
  catch_up_hidden(rows, width)          the padded catch-up's hidden inputs [B * width, H], or None
  caught_up(reqs)                       record what the catch-up fed
  catch_up_width(tier)                  the widest catch-up a round of tier can leave for the next one
  ahead_catch_up(reqs, a, tokens, out)  optional: the next round's packed catch-up from this round's results,
                                        written into out (padding rows too)
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from hyperdraft.request import Request, same_requests
from hyperdraft.sample.logits_ops import SamplingBatch, penalised_logits
from hyperdraft.speculative.drafting.chain import draft_chain
from hyperdraft.speculative.drafting.anchor import CatchUpRows, DraftAnchor
from hyperdraft.speculative.drafting.choice import choose_draft, draws_from_q
from hyperdraft.speculative.drafting.graphs import DraftLoopGraphs
from hyperdraft.speculative.proposal import Proposal, TreeProposal
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.speculative.drafting.tree import draft_tree
from hyperdraft.speculative.drafting.sampled_tree import draft_q


DRAFT_AHEAD_ENV = "HYPERDRAFT_DRAFT_AHEAD"  # "0": no draft-ahead (A/B benchmarks, tests)


@dataclass
class AheadDraft:
    """A round's draft queued before the round's requests were known for sure."""

    reqs: list[Request]
    tier: Tier
    outputs: tuple[torch.Tensor, ...]  # static graph outputs (DraftLoopGraphs.run)

    def serves(self, reqs: list[Request], tier: Tier) -> bool:
        return tier == self.tier and same_requests(reqs, self.reqs)


class DraftRounds:
    draft_loop: DraftLoopGraphs | None = None
    timer = None  # a PhaseTimer, set by the SpecWorker
    ahead: AheadDraft | None = None
    ahead_used = 0  # rounds served by a queued draft, and queued drafts thrown away (tests, benchmarks)
    ahead_discarded = 0

    def propose(self, reqs: list[Request], steps: int, sampling: SamplingBatch) -> Proposal:
        """A chain of `steps` drafts per request."""
        sampled = draws_from_q(self.sample_drafts, sampling)
        ahead = self._take_ahead(reqs, Tier(steps), sampled, sampling)
        if ahead is not None:
            return Proposal(ahead[0], [steps] * len(reqs))
        rows = self._catch_up_rows(reqs)
        fit = self._loop_fit(Tier(steps), rows, sampled, sampling)
        qs: list[torch.Tensor] = []
        if fit is not None:
            (tokens,) = self.draft_loop.run(rows, Tier(steps), *fit)
        else:
            fb, first = self.catch_up(reqs, rows.tokens)

            def choose(j: int, out, prefix: torch.Tensor, dest: torch.Tensor):
                tokens, q = choose_draft(out.target_logits(), sampling.at_offset(prefix), sampled)
                dest.copy_(tokens)
                return q

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
        tier = Tier(steps, topk, num_nodes)
        ahead = self._take_ahead(reqs, tier, sampled, sampling)
        if ahead is not None:
            return TreeProposal(*ahead)
        rows = self._catch_up_rows(reqs)
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

    def draft_ahead(self, reqs: list[Request], tier: Tier, sampling: SamplingBatch, num_accepted: torch.Tensor,
                    tokens: torch.Tensor) -> None:
        """Queue the next round's draft for these requests from this round's results (num_accepted [B], tokens
        [B, steps + 1]: the accepted drafts or accepted path, then the bonus token), if a whole-round graph can run
        it. Called before the scheduler commits this round: req.num_computed is still this round's n."""
        self.ahead_discarded += self.ahead is not None
        self.ahead = None
        if (self.draft_loop is None or not hasattr(self, "ahead_catch_up")
                or os.environ.get(DRAFT_AHEAD_ENV, "1") == "0"
                or draws_from_q(self.sample_drafts, sampling) or sampling.penalties is not None):
            return
        width = self.catch_up_width(tier)
        fit = self.draft_loop.padded(tier, len(reqs), width)
        if fit is None or fit[1] != width or tokens.shape[1] < width:
            return
        # The next round writes catch-up positions from n (padded to width) and its steps up to
        # width + (steps-1)*topk - 1 past n: reserve them now, as the next schedule would have (it keeps them, or they
        # are released at commit).
        reach = width + (tier.steps - 1) * tier.topk
        if not self.runner.page_table.reserve_ahead([r.row for r in reqs], [r.num_computed + reach for r in reqs]):
            return
        self.ahead_catch_up(reqs, num_accepted, tokens, self.draft_loop.packed_rows(*fit))
        self.ahead = AheadDraft(list(reqs), tier, self.draft_loop.run_packed(tier, *fit, len(reqs)))

    def _take_ahead(self, reqs: list[Request], tier: Tier, sampled: bool, sampling: SamplingBatch):
        """The outputs of the draft queued for exactly this round, or None (a queued draft for another batch or tier
        is thrown away)."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        if not ahead.serves(reqs, tier) or sampled or sampling.penalties is not None:
            self.ahead_discarded += 1
            return None
        self.ahead_used += 1
        self.caught_up(reqs)
        return ahead.outputs

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
