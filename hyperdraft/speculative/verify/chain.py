"""ChainRound: a round whose drafts form a chain. Verify rows are [last, d_0 .. d_{len-1}] per request (lengths may
differ); acceptance is the longest accepted prefix (rejection.py), then one recovered or bonus token."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hyperdraft.core.forward_batch import ForwardInput
from hyperdraft.core.host_copy import to_device_many
from hyperdraft.core.schedule import RequestResult
from hyperdraft.kernels.argmax import argmax_rows
from hyperdraft.request import Request
from hyperdraft.sample.logits_ops import SamplingBatch, penalised_logits, probs_from_logits, token_logprobs
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.speculative.graph_plan import verify_graph_runs
from hyperdraft.speculative.proposal import Proposal
from hyperdraft.speculative.verify.coupled import keyed_targets
from hyperdraft.speculative.verify.rejection import verify_chain, verify_greedy_chain
from hyperdraft.speculative.verify.round import RoundContext, RoundOutcome, last_token, logprob_rows, reserved_room
from hyperdraft.speculative.verify.simulated import simulate_chain


class ChainPieces(NamedTuple):
    """What the host reads of a chain round."""

    num_accepted: torch.Tensor  # [B] int64
    tokens: torch.Tensor  # [B, K+1] int64: the accepted drafts, then the recovered or bonus token, then unused
    logprobs: torch.Tensor | None  # [B, K+1] float32, of those tokens; None when no request asked for them
    drafted: torch.Tensor | None = None  # [B] int64 real drafts per request, where the proposal's lens were the width


class ChainRound:
    def __init__(self, ctx: RoundContext, reqs: list[Request], sampling: SamplingBatch, tier: Tier, proposal: Proposal):
        self.ctx, self.reqs, self.sampling, self.tier, self.proposal = ctx, reqs, sampling, tier, proposal
        device = ctx.target.device
        proposal.lens = [min(k, m) for k, m in zip(proposal.lens, reserved_room(ctx.target, reqs))]
        # Rows fed per request: each request's own drafts, or, where a captured verify graph can run the batch,
        # every request the tier's full width (the rows past a request's drafts are verified and ignored; past
        # its reserved room they write to the padding page).
        uniform = verify_graph_runs(ctx.target.graphs, tier, len(reqs))
        if uniform and proposal.max_len < tier.steps:
            proposal.tokens = F.pad(proposal.tokens, (0, tier.steps - proposal.max_len))
        k1 = proposal.max_len + 1
        self.rows_fed = [k1 - 1] * len(reqs) if uniform else proposal.lens
        self.num_rows = sum(self.rows_fed) + len(reqs)
        # Dense: every request feeds all K+1 rows, so the packed verify rows already are the [B, K+1] grid and need
        # no gather or scatter (on a GPU the scatter alone moves 2 x B*(K+1)*V floats).
        self.dense = self.num_rows == len(reqs) * k1
        starts = list(itertools.accumulate((1 + k for k in self.rows_fed), initial=0))[:-1]  # packed row of row 0
        flat = [] if self.dense else [b * k1 + j for b, k in enumerate(self.rows_fed) for j in range(k + 1)]
        self.last, self.lens, self.starts, self.flat_index, self.rows = to_device_many(
            [[last_token(r) for r in reqs], proposal.lens, starts, flat, [r.row for r in reqs]], torch.int64, device)
        if proposal.device_lens is not None:  # a lookup queued ahead: its counts, within the room the host allowed
            self.lens = torch.minimum(self.lens, proposal.device_lens)

    # ---- the verify forward's rows -------------------------------------------------------------------------------
    def inputs(self) -> list[ForwardInput]:
        return [ForwardInput(r.row, r.num_computed, [0] * (1 + k), 1 + k) for r, k in zip(self.reqs, self.rows_fed)]

    def packed_ids(self) -> torch.Tensor:
        grid = torch.cat([self.last[:, None], self.proposal.tokens], 1)  # [B, K+1]
        return grid.flatten() if self.dense else grid.flatten()[self.flat_index]

    def positions(self) -> torch.Tensor | None:
        return None  # each row's sequence index

    def tail_mask(self, extend_lens: list[int]) -> torch.Tensor | None:
        return None  # chains are causal

    def state_parents(self) -> torch.Tensor:
        """[num_rows]: each verify row's parent row within its request (-1: the committed state), for hybrid targets."""
        k1 = self.proposal.max_len + 1
        grid = (torch.arange(k1, device=self.rows.device) - 1).repeat(len(self.reqs))
        return grid if self.dense else grid[self.flat_index]

    # ---- acceptance, on the device --------------------------------------------------------------------------------
    def accept(self, verify_logits: torch.Tensor, target_hidden: torch.Tensor | None) -> None:
        """verify_logits [num_rows, V]; target_hidden [>= num_rows, H] when the drafter reads hidden states."""
        bsz, k = len(self.reqs), self.proposal.max_len
        grid = verify_logits  # [B*(K+1), V]
        if not self.dense:  # rows past a request's drafts stay unused
            grid = verify_logits.new_zeros(bsz * (k + 1), verify_logits.shape[1])
            grid[self.flat_index] = verify_logits
        sb = self.sampling
        # Every request greedy, drafts one-hot: p is the one-hot of each row's argmax, so verification needs only
        # the argmax tokens (p is never built, nor the verify rows' parameters unless penalties change the logits).
        greedy = sb.all_greedy and self.proposal.q is None
        sbv = sb.for_verify(self.proposal.tokens) if not greedy or sb.penalties is not None else None
        logits = penalised_logits(grid, sbv) if sbv is not None else grid
        target = argmax_rows(logits).view(bsz, k + 1) if greedy else None
        p = None if greedy else probs_from_logits(logits, sbv).view(bsz, k + 1, -1)
        draft, lens, alpha = self.proposal.tokens, self.lens, self.ctx.simulate_accept_rate
        if alpha is not None:  # benchmark-only, lossy (see verify/simulated.py)
            num_accepted, tokens = simulate_chain(p, draft, lens, alpha, sb.seeds, sb.positions, greedy_target=target)
        elif greedy:
            num_accepted, tokens = verify_greedy_chain(target, draft, lens)
        elif self.ctx.coupled:  # the keyed sample of each row plays the argmax's part (coupled.py)
            target = keyed_targets(p.flatten(0, 1), sbv.seeds, sbv.positions).view(bsz, k + 1)
            num_accepted, tokens = verify_greedy_chain(target, draft, lens)
        else:
            num_accepted, tokens = verify_chain(p, draft, lens, self.proposal.q, sb.seeds, sb.positions)
        if self.ctx.target.state_pool is not None:  # the state after the last accepted token becomes the committed one
            self.ctx.target.state_pool.commit(self.rows, num_accepted)
        if self.ctx.proposer.capabilities.recurrent_state:  # it fed the root and drafts 0 .. K-2: the last accepted
            self.ctx.proposer.accept_draft_state(self.rows, num_accepted.clamp_max(k - 1) - 1)
        if target_hidden is not None:
            self.ctx.proposer.store_accepted_hidden(self.rows, self._verify_rows(target_hidden, bsz, k))
        self.num_accepted, self.tokens = num_accepted, tokens  # what the next round's catch-up feeds (draft-ahead)
        self.logits = logits

    def _verify_rows(self, target_hidden: torch.Tensor, bsz: int, k: int) -> torch.Tensor:
        """[B, K+1, H]: verify row j of request b, which sits at packed row start_b + j (clamped past its drafts)."""
        if self.dense:
            return target_hidden[: self.num_rows].view(bsz, k + 1, -1)
        rows = (self.starts[:, None] + torch.arange(k + 1, device=self.starts.device)).clamp_max(self.num_rows - 1)
        return target_hidden[rows]

    def pieces(self) -> ChainPieces:
        drafted = self.lens if self.proposal.device_lens is not None else None
        if not self.sampling.want_logprobs:
            return ChainPieces(self.num_accepted, self.tokens, None, drafted)
        logprobs = token_logprobs(self.logits, self.tokens.flatten()).view_as(self.tokens)
        return ChainPieces(self.num_accepted, self.tokens, logprobs, drafted)

    # ---- on the host ---------------------------------------------------------------------------------------------
    def decode(self, host: ChainPieces) -> RoundOutcome:
        drafted = host.drafted if host.drafted is not None else self.proposal.lens
        return decode_chain(host, drafted, self.proposal.max_len)


def decode_chain(host: ChainPieces, draft_lens: list[int], width: int) -> RoundOutcome:
    """host: ChainPieces as lists; draft_lens: real drafts per request; width: K, the drafts' padded width. A draft
    model fed the root and drafts 0 .. K-2 of its own chain, so min(K - 1, accepted) of the accepted ones are in
    its K/V."""
    logprobs = logprob_rows(host.logprobs, len(host.tokens))
    # A round of width 0 (step 0) wrote no K/V past its one row, so it keeps its room as a plain step does: nothing to
    # roll back, and a verify queued ahead (verify_ahead.py) wrote the next index there.
    results = [RequestResult(a + 1, tokens[: a + 1], lp[: a + 1], k, a, keeps_room=width == 0)
               for a, tokens, lp, k in zip(host.num_accepted, host.tokens, logprobs, draft_lens)]
    return RoundOutcome(results, list(host.num_accepted), list(draft_lens), list(draft_lens),
                        [min(width - 1, a) for a in host.num_accepted])
