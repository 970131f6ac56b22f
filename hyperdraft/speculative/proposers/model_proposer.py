"""ModelProposer: propose() for a drafter that runs a model of its own (a STANDALONE draft model, an EAGLE head).

A round is a catch-up (the positions the drafter has not consumed yet, ending at the root: the last committed token)
followed by the draft steps, as a chain (drafting/chain.py) or a tree (drafting/tree.py). A round that fits a
captured graph runs as one (drafting/graphs.py: greedy, drawn from q or penalised); any other runs the catch-up and
each step through the runner's own graph-or-eager dispatch. Either way the step batches are the ones DraftAnchor
builds on the device.

Draft-ahead (capabilities.drafts_ahead): right after a round's verify and accept are queued, and before its results
reach the host, draft_ahead() queues the NEXT round's whole draft graph (greedy; drawn from q or penalised once that
round's graph exists, its sampling rows moved on by the tokens the round commits), its catch-up packed on the device
from the accepted tokens (the subclass's ahead_catch_up). The GPU drafts while the host commits and schedules,
instead of idling until the next propose(). That propose() takes the queued drafts when its batch is the same
requests under the same tier and sampling key (nothing finished, joined or was retracted) and discards them
otherwise. Discarding is harmless: the queued graph wrote only draft K/V that the next catch-up rewrites (catch-up
positions, with the same values) or that no one reads before a draft step overwrites it, in slots reserved for it
when it was queued, or since released and written by their new owner after it (one stream). The drafts equal those
propose() would make. RuntimeOptions.draft_ahead turns it off. EAGLE heads and STANDALONE draft models draft ahead,
chains and trees. A draft model's K/V of accepted drafts is kept across rounds (draft_num_computed reaches past the
committed tokens), so the part of the queued draft's room that the next round reads must survive the commit that
follows: it does, as the commit keeps the decode reserve past the new length (Scheduler.commit), which covers what any
tier writes past it (Tier.reserve_tokens); the next round finds that K/V in the row's own pages.

A subclass gives:
  catch_up_tokens(req)                  the tokens its catch-up feeds, from index req.draft_num_computed on (>= 1);
                                        the last is the root (the last committed token)
  catch_up_batch(reqs, tokens, width)   the catch-up ForwardBatch, ragged (width None) or padded to width
  catch_up_hidden(rows, width)          the padded catch-up's hidden inputs [B * width, H], or None
  caught_up(reqs)                       record what the catch-up fed
  catch_up_width(tier)                  the widest catch-up a round of tier can leave for the next one
  ahead_catch_up(reqs, a, tokens, out)  (drafting ahead only) the next round's packed catch-up from this round's
                                        results, written into out (padding rows too)
  queued_room(tier)                     (drafting ahead only) tokens of room past n the queued round writes with
                                        its catch-up at catch_up_width(tier), or None where the subclass does not
                                        draft this tier ahead
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hyperdraft.core.forward_batch import ForwardBatch
from hyperdraft.request import Request, same_requests
from hyperdraft.runner.model_runner import ForwardOutput, GraphedRunner
from hyperdraft.sample.logits_ops import SamplingBatch
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.speculative.drafting.anchor import CatchUpRows, DraftAnchor
from hyperdraft.speculative.drafting.chain import choose_argmax, draft_chain
from hyperdraft.speculative.drafting.choice import SamplingKey, chain_chooser, draws_from_q, tree_distribution
from hyperdraft.speculative.drafting.graphs import DraftLoopGraphs, RoundKey
from hyperdraft.speculative.drafting.tree import draft_tree
from hyperdraft.speculative.graph_plan import CapturePlan, draft_loop_plan, draft_step_shapes
from hyperdraft.speculative.proposal import Proposal, TreeProposal
from hyperdraft.speculative.proposer import Proposer, ProposerCapabilities, ProposerContext


@dataclass
class AheadDraft:
    """A round's draft queued before the round's requests were known for sure."""

    reqs: list[Request]
    tier: Tier
    sampling: SamplingKey | None  # drafts drawn from q or penalised under this key; None: greedy, unpenalised
    proposal: Proposal | TreeProposal  # over the round graph's static outputs (DraftLoopGraphs.run)

    def serves(self, reqs: list[Request], tier: Tier, sampling: SamplingKey | None) -> bool:
        return tier == self.tier and sampling == self.sampling and same_requests(reqs, self.reqs)


class ModelProposer(Proposer):
    def __init__(self, ctx: ProposerContext, runner: GraphedRunner, capabilities: ProposerCapabilities):
        """capabilities.drafts_ahead: the subclass can pack an ahead catch-up; it holds only where whole-round graphs
        exist and the options allow it."""
        self.runner = runner
        self.timer = ctx.timer
        self.sample_drafts = ctx.spec.use_rejection_sampling  # True: draw from q; False: greedy / top-k; None: auto
        self.coupled = ctx.spec.sampling == "coupled"
        loops = runner.graphs is not None and ctx.options.draft_loop_graphs
        self.draft_loop = DraftLoopGraphs(runner, capabilities.feeds_hidden, self.catch_up_hidden,
                                          ctx.options.sampling_round_graphs) if loops else None
        self.capabilities = replace(capabilities, runs_as_graph=True,
                                    drafts_ahead=capabilities.drafts_ahead and loops and ctx.options.draft_ahead)
        self.ahead: AheadDraft | None = None
        self.ahead_used = 0  # rounds served by a queued draft, and queued drafts thrown away (tests, benchmarks)
        self.ahead_discarded = 0

    def propose(self, reqs: list[Request], tier: Tier, sampling: SamplingBatch) -> Proposal | TreeProposal:
        sampled = self._draws(tier, sampling)
        key = self._sampling_key(tier, sampling, sampled)
        ahead = self._take_ahead(reqs, tier, key)
        if ahead is not None:
            return ahead
        rows = self._catch_up_rows(reqs)
        fit = self._loop_fit(tier, rows, key)
        if fit is not None:
            proposal = _graph_proposal(self.draft_loop.run(rows, RoundKey(tier, *fit, key), sampling), tier, len(reqs))
        else:
            fb, first = self.catch_up(reqs, rows.tokens)
            anchor = DraftAnchor.after(fb, rows.step_bases)
            draft = self._draft_tree if tier.is_tree else self._draft_chain
            proposal = draft(fb, first, anchor, tier, sampling, sampled, key)
        self.caught_up(reqs)
        return proposal

    def _draft_chain(self, fb: ForwardBatch, first: ForwardOutput, anchor: DraftAnchor, tier: Tier,
                     sampling: SamplingBatch, sampled: bool, key: SamplingKey | None) -> Proposal:
        """A chain of tier.steps drafts per request, step by step. Without a sampling key (greedy, unpenalised) it
        takes the argmax as the draft-loop graphs do: over a draft vocabulary's own logits, never spread."""
        choose = choose_argmax if key is None else chain_chooser(sampling, sampled, self.coupled)
        tokens, qs = draft_chain(self.runner.forward, fb, first, anchor, tier.steps, choose, self.runner.page_table,
                                 self.capabilities.feeds_hidden, self.capabilities.recurrent_state)
        return Proposal(tokens, [tier.steps] * fb.batch_size, torch.stack(qs, 1) if qs else None)

    def _draft_tree(self, fb: ForwardBatch, first: ForwardOutput, anchor: DraftAnchor, tier: Tier,
                    sampling: SamplingBatch, sampled: bool, key: SamplingKey | None) -> TreeProposal:
        """A tree of tier.num_draft_tokens per request: a beam over top-k children, or children drawn from q (a
        sampled tree, verified with the real q). Depth d's frontier sits at RoPE position root + d, written at
        offsets 1 + (d-1)*topk + f past the root."""
        distribution = tree_distribution(sampling, sampled, tier.topk)
        plain_beam = key is None  # greedy rows read no parameter: top-k of the logits
        out = draft_tree(self.runner.forward, fb, first, anchor, tier.steps, tier.topk, tier.num_draft_tokens,
                         None if plain_beam else distribution, self.runner.page_table, self.capabilities.feeds_hidden,
                         (sampling.seeds, sampling.positions) if sampled else None, self.capabilities.recurrent_state)
        return TreeProposal(*out)

    def draft_ahead(self, reqs: list[Request], tier: Tier, sampling: SamplingBatch, num_accepted: torch.Tensor,
                    tokens: torch.Tensor, kept: torch.Tensor | None = None) -> Proposal | TreeProposal | None:
        """Queue the next round's draft for these requests from this round's results (num_accepted [B], tokens
        [B, steps + 1]: the accepted drafts or accepted path, then the bonus token), if a whole-round graph can run
        it; -> the proposal the next round's propose() returns if the round is the one it was queued for, or None.
        Called before the scheduler commits this round: req.num_computed is still this round's n. Drafts drawn
        from q or penalised are drafted ahead by their round graph if one was captured already (never captured
        here), its sampling rows moved on by the round's a + 1 committed tokens on the device (RoundSampling)."""
        self.discard_ahead()
        if not self.capabilities.drafts_ahead:
            return None
        sampling_key = self._sampling_key(tier, sampling, self._draws(tier, sampling))
        width = self.catch_up_width(tier)
        fit = self.draft_loop.padded(tier, len(reqs), width)
        key = None if fit is None else RoundKey(tier, *fit, sampling_key)
        room = None if fit is None else self._padded_room(tier, fit[1])
        if room is None or tokens.shape[1] < width or not self.draft_loop.has(key):
            return None
        # Reserve the room the queued round writes now, as the next schedule would have. Up to index n (reach 1) the
        # round itself had it: a step-0 round's catch-up needs nothing more, and skips a call per request.
        if room > 1 and not self.runner.page_table.reserve_ahead([r.row for r in reqs],
                                                                 [r.num_computed + room for r in reqs]):
            return None
        self.ahead_catch_up(reqs, num_accepted, tokens, self.draft_loop.packed_rows(*fit), kept)
        if sampling_key is not None:
            self.draft_loop.sampling.load(sampling, committed=(num_accepted, tokens))
        proposal = _graph_proposal(self.draft_loop.run_packed(key, len(reqs)), tier, len(reqs))
        self.ahead = AheadDraft(list(reqs), tier, sampling_key, proposal)
        return proposal

    def ahead_room(self, tier: Tier, batch_size: int) -> int | None:
        """The queued round's room at the width its graph pads the catch-up to: under adaptive tiers a batch size's
        graphs take the widest catch-up of any tier routed there (graph_plan.catch_up_widths), and the padding
        writes K/V past the tier's own reach (the draft steps overwrite it before anything attends to it). Without
        the padding in the room, and before it was allowed at all, only the widest tier at a batch size drafted
        ahead: EMA adaptive on chat at batch 1 (tier 3 under a 7-step ladder) queued no draft and no verify ahead,
        0.78x plain against fixed chain 3's 1.03x on an H200 (real_accept_h200.md, session 32)."""
        fit = None if self.draft_loop is None else self.draft_loop.padded(tier, batch_size, self.catch_up_width(tier))
        return None if fit is None else self._padded_room(tier, fit[1])

    def _padded_room(self, tier: Tier, graph_width: int) -> int | None:
        room = self.queued_room(tier)
        return None if room is None else room + graph_width - self.catch_up_width(tier)

    def discard_ahead(self) -> None:
        self.ahead_discarded += self.ahead is not None
        self.ahead = None

    def capture_graphs(self, plan: CapturePlan) -> None:
        """The per-step draft and catch-up shapes of every tier the plan can run, then the whole-round graphs."""
        graphs = self.runner.graphs
        # A drafter that catches up at step 0 (an EAGLE head) runs its one-token forward there too, as a graph.
        if graphs is None or (not any(t.steps > 0 for t in plan.tier_sizes) and self.capabilities.idle_at_step_zero):
            return
        for mode, shapes in draft_step_shapes(plan, self.catch_up_width).items():
            graphs.capture(shapes, mode)
        loops = draft_loop_plan(plan, self.catch_up_width, step_zero=not self.capabilities.idle_at_step_zero)
        if self.draft_loop is not None and loops:
            self.draft_loop.capture(loops)

    def release_graphs(self) -> None:
        self.ahead = None
        if self.draft_loop is not None:
            self.draft_loop.release()
        self.runner.release_graphs()

    def _draws(self, tier: Tier, sampling: SamplingBatch) -> bool:
        """Whether this round's drafts are drawn from q. Coupled trees keep the beam over the draft's top-k:
        verification takes any tokens, and the beam's children are the likeliest winners of the target's race."""
        return draws_from_q(self.sample_drafts, sampling) and not (self.coupled and tier.is_tree)

    def _sampling_key(self, tier: Tier, sampling: SamplingBatch, sampled: bool) -> SamplingKey | None:
        """The round graph's sampling key; None at step 0, which chooses no draft (its graph is the catch-up alone)."""
        return SamplingKey.of(sampling, sampled, self.coupled) if tier.steps > 0 else None

    def _take_ahead(self, reqs: list[Request], tier: Tier, key: SamplingKey | None) -> Proposal | TreeProposal | None:
        """The proposal queued for exactly this round, or None (a queued draft for another batch, tier or
        sampling key is thrown away). The same requests sample at the positions it drew for, with the output counts
        it penalised with: each one's committed length and outputs moved on by exactly the a + 1 tokens it was
        queued with."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return None
        if not ahead.serves(reqs, tier, key):
            self.ahead_discarded += 1
            return None
        self.ahead_used += 1
        self.caught_up(reqs)
        return ahead.proposal

    def _catch_up_rows(self, reqs: list[Request]) -> CatchUpRows:
        return CatchUpRows([r.row for r in reqs], [r.draft_num_computed for r in reqs],
                           [self.catch_up_tokens(r) for r in reqs])

    def _loop_fit(self, tier: Tier, rows: CatchUpRows, key: SamplingKey | None):
        """(padded batch size, width) of the whole-round graph that can run this round, or None."""
        if self.draft_loop is None:
            return None
        return self.draft_loop.padded(tier, len(rows.rows), rows.widest, key)

    def catch_up(self, reqs: list[Request], tokens_in: list[list[int]] | None = None):
        """Run the catch-up alone -> (its ForwardBatch, its ForwardOutput): padded to a captured width when a
        per-step graph can run it, else ragged and eager."""
        tokens_in = tokens_in or [self.catch_up_tokens(r) for r in reqs]
        graphs = self.runner.graphs
        width = graphs.extend_width(len(reqs), max(map(len, tokens_in))) if graphs is not None else None
        fb = self.catch_up_batch(reqs, tokens_in, width)
        with self.timer.phase("draft_extend"):
            return fb, self.runner.forward(fb)

    # ---- what a subclass gives (see the module doc) ---------------------------------------------------------------
    def catch_up_tokens(self, req: Request) -> list[int]:
        raise NotImplementedError

    def catch_up_batch(self, reqs: list[Request], tokens: list[list[int]], width: int | None) -> ForwardBatch:
        raise NotImplementedError

    def catch_up_hidden(self, rows: torch.Tensor, width: int) -> torch.Tensor | None:
        raise NotImplementedError

    def caught_up(self, reqs: list[Request]) -> None:
        raise NotImplementedError

    def catch_up_width(self, tier: Tier) -> int:
        raise NotImplementedError

    def ahead_catch_up(self, reqs: list[Request], num_accepted: torch.Tensor, tokens: torch.Tensor,
                       out: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not draft ahead")

    def queued_room(self, tier: Tier) -> int | None:
        raise NotImplementedError(f"{type(self).__name__} does not draft ahead")


def _graph_proposal(outputs: tuple[torch.Tensor, ...], tier: Tier, batch_size: int) -> Proposal | TreeProposal:
    """A round graph's outputs (DraftLoopGraphs.run) as the proposal the step-by-step round would return."""
    if tier.is_tree:
        return TreeProposal(*outputs)
    return Proposal(outputs[0], [tier.steps] * batch_size, *outputs[1:])
