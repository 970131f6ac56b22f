"""TreeRound: a round whose drafts form a tree of N nodes per request (node 0 = the last committed token), verified in
one forward with an ancestor mask (tree_rejection.py walks it); the accepted path is then compacted to contiguous
indices (compaction.py)."""

from __future__ import annotations

from functools import cached_property
from typing import NamedTuple

import torch

from hyperdraft.core.forward_batch import ForwardInput, leading_tail_mask
from hyperdraft.core.host_copy import to_device_many
from hyperdraft.core.schedule import RequestResult
from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels.argmax import argmax_rows
from hyperdraft.kernels.tree_round import TreeAccept, accept_tree
from hyperdraft.request import Request
from hyperdraft.sample.logits_ops import SamplingBatch, penalised_logits, probs_from_logits, token_logprobs
from hyperdraft.sample.rng import DOMAIN_ACCEPT
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.speculative.proposal import TreeProposal
from hyperdraft.speculative.verify.compaction import accept_plan, compact_accepted
from hyperdraft.speculative.verify.coupled import keyed_targets
from hyperdraft.speculative.verify.round import RoundContext, RoundOutcome, logprob_rows, reserved_room
from hyperdraft.speculative.verify.simulated import simulate_tree
from hyperdraft.speculative.verify.tree_buffers import DraftTree, build_tree
from hyperdraft.speculative.verify.tree_rejection import verify_greedy_tree, verify_tree


class TreePieces(NamedTuple):
    """What the host reads of a tree round."""

    num_accepted: torch.Tensor  # [B] int64
    tokens: torch.Tensor  # [B, D+1] int64: the accepted path's tokens, then the recovered or bonus token; -1 after
    logprobs: torch.Tensor | None  # [B, D+1] float32, of those tokens; None when no request asked for them
    draft_kv_valid: torch.Tensor  # [B] int64: accepted nodes past the root whose draft K/V was kept (compacted)


class TreeRound:
    def __init__(self, ctx: RoundContext, reqs: list[Request], sampling: SamplingBatch, tier: Tier,
                 proposal: TreeProposal):
        self.ctx, self.reqs, self.sampling, self.tier, self.proposal = ctx, reqs, sampling, tier, proposal
        self.n = tier.num_draft_tokens
        room = reserved_room(ctx.target, reqs)
        # fewer only when a lone request fills the pool, or where the drafter found fewer nodes
        drafted = proposal.num_nodes or [self.n] * len(reqs)
        self.num_nodes = [min(self.n, m + 1, d) for m, d in zip(room, drafted)]
        # The beam writes offsets up to (steps-1)*topk whatever the room; past the room they land in the padding
        # page, so such nodes have no draft K/V to keep.
        self.room, self.num_nodes_t, self.base, self.rows = to_device_many(
            [room, self.num_nodes, [r.num_computed for r in reqs], [r.row for r in reqs]], torch.int64,
            ctx.target.device)
        self.num_rows = len(reqs) * self.n

    @cached_property
    def tree(self) -> DraftTree:
        """Depths and ancestor mask: built only when asked for. A round whose verify round-ahead queued, greedy, reads
        only its tokens and parents (the queued verify built the rest: verify_ahead.next_round_batch); the plan's
        launch and buffers were ~100 us of its host time on the H200's host."""
        return build_tree(self.proposal.tokens, self.proposal.parents, q=self.proposal.q, num_nodes=self.num_nodes_t)

    def _tokens_and_parents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, N] int64 each, padding nodes parentless: the proposal's own when every node is real."""
        if min(self.num_nodes) == self.n:
            return self.proposal.tokens.to(torch.int64), self.proposal.parents.to(torch.int64)
        return self.tree.tokens, self.tree.parents

    # ---- the verify forward's rows -------------------------------------------------------------------------------
    def inputs(self) -> list[ForwardInput]:
        return [ForwardInput(r.row, r.num_computed, [0] * self.n, self.n) for r in self.reqs]

    def tail_mask(self, extend_lens: list[int]) -> torch.Tensor:
        """The ancestor masks of every tree, with causal rows for the prefill chunks riding along."""
        return leading_tail_mask(self.tree.mask, extend_lens, self.ctx.target.device)

    def packed_ids(self) -> torch.Tensor:
        return self.tree.tokens.flatten()

    def state_parents(self) -> torch.Tensor:
        """[B*N]: each node's parent (-1 for the root: the committed state), for hybrid targets."""
        return self.tree.parents.flatten()

    def positions(self) -> torch.Tensor:
        return (self.base[:, None] + self.tree.depth).flatten()

    # ---- acceptance and compaction, on the device -----------------------------------------------------------------
    def accept(self, verify_logits: torch.Tensor, target_hidden: torch.Tensor | None) -> None:
        """verify_logits [B*N, V]; target_hidden [>= B*N, H] when the drafter reads hidden states."""
        bsz, n, sb = len(self.reqs), self.n, self.sampling
        sampled = self.proposal.q is not None  # children drawn from q without replacement (drafting/sampled_tree.py)
        greedy = sb.all_greedy and not sampled  # p one-hot at each node's argmax: verify from the argmax tokens
        sbt = None
        if not greedy or sb.penalties is not None:
            sbt = sb.for_tree(self.tree.tokens, self.tree.mask, self.tree.depth)
        logits = penalised_logits(verify_logits, sbt) if sbt is not None else verify_logits
        target = argmax_rows(logits).view(bsz, n) if greedy else None
        p = None if greedy else probs_from_logits(logits, sbt).view(bsz, n, -1)
        if self.ctx.coupled and not greedy and self.ctx.simulate_accept_rate is None:
            target = keyed_targets(p.flatten(0, 1), sbt.seeds, sbt.positions).view(bsz, n)  # plays the argmax's part
        if target is not None and use_fused_kernels(target):
            plan = self._accept_fused(target)
        else:
            plan = accept_plan(*self._walk(target, p, sampled), self.proposal.fed, self.room, self.base, self.rows,
                               self.ctx.target.page_table, self.ctx.proposer.capabilities.compacts_draft_pool)
        self._commit(plan, target_hidden)
        self.logits = logits

    def _accept_fused(self, target: torch.Tensor) -> TreeAccept:
        """The walk and the commit's index lists in one launch (kernels/tree_round.py): greedy, coupled, or simulated
        over a greedy target."""
        alpha, sb, table = self.ctx.simulate_accept_rate, self.sampling, self.ctx.target.page_table
        simulate = None if alpha is None else (alpha, self.ctx.simulate_sibling_rate, self.tier.topk, sb.seeds,
                                               sb.positions, DOMAIN_ACCEPT)
        return accept_tree(target, *self._tokens_and_parents(), self.proposal.fed, self.room, self.base,
                           self.rows, table.table, table.page_size, self.tier.steps, simulate)

    def _walk(self, target: torch.Tensor | None, p: torch.Tensor | None, sampled: bool):
        """-> (num_accepted [B], path [B, D+1], tokens [B, D+1]) from the torch walks."""
        sb, tier, alpha = self.sampling, self.tier, self.ctx.simulate_accept_rate
        if alpha is not None:  # benchmark-only, lossy (see verify/simulated.py)
            return simulate_tree(p, self.tree, alpha, sb.seeds, sb.positions, max_depth=tier.steps,
                                 greedy_target=target, sibling_rate=self.ctx.simulate_sibling_rate,
                                 max_children=tier.topk)
        if target is not None:  # greedy, or coupled: each node's keyed sample plays the argmax's part (coupled.py)
            return verify_greedy_tree(target, self.tree, max_depth=tier.steps)
        return verify_tree(p, self.tree, sb.seeds, sb.positions, sampled, max_depth=tier.steps,
                           max_children=tier.topk)

    def _commit(self, plan: TreeAccept, target_hidden: torch.Tensor | None) -> None:
        """Move the accepted path's K/V to n, n+1, ... in the target's pool, and in the drafter's where it keeps the
        nodes it fed (capabilities.compacts_draft_pool); commit the recurrent states of the last accepted node (and
        the drafter's last kept node); store the path's hidden states for the drafter."""
        target, proposer = self.ctx.target, self.ctx.proposer
        compact_accepted(target.pool, plan.target_moves)
        if proposer.capabilities.compacts_draft_pool:
            compact_accepted(proposer.pool, plan.draft_moves)
        if proposer.capabilities.recurrent_state:  # the root's offset 0 is scratch entry -1: the committed state
            proposer.accept_draft_state(self.rows, plan.last_fed)
        if target.state_pool is not None:
            target.state_pool.commit(self.rows, plan.last_node)
        if target_hidden is not None:  # the accepted path's hidden states, compacted like its K/V
            proposer.store_accepted_hidden(self.rows, target_hidden[plan.hidden_rows])
        self.draft_kv_valid = plan.draft_kv_valid
        self.num_accepted, self.tokens = plan.num_accepted, plan.tokens  # the next round's catch-up (draft-ahead)
        self.path_rows = plan.hidden_rows

    def pieces(self) -> TreePieces:
        if not self.sampling.want_logprobs:
            return TreePieces(self.num_accepted, self.tokens, None, self.draft_kv_valid)
        logprobs = token_logprobs(self.logits, self.tokens.clamp_min(0).flatten(), self.path_rows.flatten())
        return TreePieces(self.num_accepted, self.tokens, logprobs.view_as(self.tokens), self.draft_kv_valid)

    # ---- on the host ---------------------------------------------------------------------------------------------
    def decode(self, host: TreePieces) -> RoundOutcome:
        return decode_tree(host, self.num_nodes, self.tier.steps)


def decode_tree(host: TreePieces, num_nodes: list[int], depth: int) -> RoundOutcome:
    """host: TreePieces as lists; num_nodes: each request's tree size (root included); depth: the tier's steps."""
    drafted = [k - 1 for k in num_nodes]
    logprobs = logprob_rows(host.logprobs, len(host.tokens))
    results = [RequestResult(a + 1, tokens[: a + 1], lp[: a + 1], d, a)
               for a, tokens, lp, d in zip(host.num_accepted, host.tokens, logprobs, drafted)]
    return RoundOutcome(results, list(host.num_accepted), drafted, [depth] * len(num_nodes), list(host.draft_kv_valid))
