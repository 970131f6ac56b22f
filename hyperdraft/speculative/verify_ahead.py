"""VerifyAhead: the next round's verify, queued before the host waits for this round's results.

Without it the GPU idles while the host decodes a round's results, commits them, schedules the next step and builds
its verify; on a small model that host work is as long as the round's GPU work. Two kinds of round queue it:

- **Step 0** (adaptive tiers give it to large batches: 64 requests and up on SGLang's default ladder) drafts
  nothing, so its verify is one row per request, [last token], the shape of a plain decode. For a drafter that must
  see every token it cannot run as the plain worker's step (speculative/worker.py). Such a round's output token is on
  the device before the host reads it, so the next verify is that token at index n + 1 (this round's one-row verify
  moved on by one token on the device: runner/next_token.py). Measured on an H100 with the SmolLM2 shape
  (benchmarks/results/step_zero_h100.md): at 64 requests a step-0 round took 2847 us without it and 2136 with it
  (plain decoding: 1292).
- **A drafted round whose drafter queued the next draft** (draft-ahead: EAGLE heads and STANDALONE draft models
  with whole-round graphs, proposers/model_proposer.py). Request b's next rows, [bonus token, its next drafts] (a
  chain) or its next tree rooted at the bonus token, at indices n + a_b + 1 onwards, depend on its accept count a_b,
  which only the device knows yet: next_round_batch moves this round's verify batch on by a_b + 1 on the device
  (positions, slots, lengths; a tree's depths and ancestor mask from its parents), and its host lists to the
  longest case (the whole width accepted), the bound launch sizes read. A tree round's accepted path is compacted
  by its accept, queued before. (RuntimeOptions.round_ahead.)

The next step uses the queued outputs when it runs the round they were queued for: the same requests and tier, no
prefill chunks, and (drafted) the very proposal queued ahead, every draft of it verified; otherwise they are
dropped. Dropping is harmless: the queued forward wrote only target K/V of each request's next rows past its
committed tokens (what the next verify writes anyway, or rows no round reads before rewriting them), in room
reserved when it was queued and kept through the commit (a round keeps decode_reserve = the widest round of room
past its new length; a step-0 round keeps its room, as a plain step does), or in a finished request's released
slots before their next owner writes them (one stream).

Not for hybrid targets: their recurrent state would need the plain worker's two-location walk.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hyperdraft.core.forward_batch import ForwardBatch, ForwardMode
from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels.draft_plan import move_chain_batch, moved_rows_reference
from hyperdraft.kernels.tree_round import MovedTree, move_tree_batch
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.request import Request, same_requests
from hyperdraft.runner.model_runner import ForwardOutput, ModelRunner
from hyperdraft.runner.next_token import moved_next_token_batch, moves_on, next_token_batch
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.speculative.graph_plan import verify_graph_runs
from hyperdraft.speculative.proposal import Proposal, TreeProposal
from hyperdraft.speculative.verify.chain import ChainRound
from hyperdraft.speculative.verify.tree import TreeRound
from hyperdraft.speculative.verify.tree_buffers import build_tree


@dataclass(frozen=True)
class QueuedVerify:
    reqs: list[Request]
    tier: Tier
    proposal: Proposal | TreeProposal | None  # the drafts it verifies (queued ahead by the proposer); None: step 0
    batch: ForwardBatch  # what it fed (the next drafted round's queued verify moves it on)
    out: ForwardOutput  # views of the graph's output buffers: valid until the target's next forward of this shape


class VerifyAhead:
    def __init__(self, runner: ModelRunner, capture_layers: tuple[int, ...], step_zero: bool, drafted: bool):
        """step_zero: queue a step-0 round's next verify (RuntimeOptions.decode_ahead, and step-0 rounds exist: no
        plain worker runs those steps); drafted: a drafted round's (RuntimeOptions.round_ahead). Neither over
        a target with recurrent state (module doc)."""
        self.runner, self.capture_layers = runner, capture_layers
        dense = runner.state_pool is None
        self.step_zero, self.drafted = step_zero and dense, drafted and dense
        self.queued: QueuedVerify | None = None
        self.used = 0  # steps served by a queued verify, and queued verifies dropped (tests, benchmarks)
        self.dropped = 0

    def take(self, round_: ChainRound | TreeRound | None, with_prefills: bool) -> QueuedVerify | None:
        """The queued verify when this step runs the round it was queued for (module doc); None (and the queued one
        dropped) otherwise. Called on every step: a queued verify never outlives the step after it."""
        queued, self.queued = self.queued, None
        if queued is None:
            return None
        if round_ is not None and not with_prefills and _serves(queued, round_):
            self.used += 1
            return queued
        self.dropped += 1
        return None

    def discard(self) -> None:
        self.dropped += self.queued is not None
        self.queued = None

    def reserve(self, reqs: list[Request], tier: Tier, draft_room: int) -> None:
        """At the start of a drafted round whose drafter drafts ahead: the room queue() would reserve for the next
        round's verify (n + 2W a request) and the drafter's (n + draft_room), so that the commit's released pages, this
        round's reads and the next round's room reach the device page table in one write. Two or three writes a
        step, each a pinned copy and a launch, cost ~80 us of host apiece on an H100 (cProfile of a SmolLM2 chain-5
        round, benchmarks/results/round_host_h100.md). A refusal (the pool is short) leaves it to queue()."""
        if self.drafted and verify_graph_runs(self.runner.graphs, tier, len(reqs)):
            room = max(2 * tier.num_draft_tokens, draft_room)
            self.runner.page_table.reserve_ahead([r.row for r in reqs], [r.num_computed + room for r in reqs])

    def queue(self, round_: ChainRound | TreeRound, drafted: Proposal | TreeProposal | None,
              verified: ForwardBatch | None) -> None:
        """After a round of decodes only, before the scheduler commits it (req.num_computed is still n): the next
        round's verify, if a graph runs it. drafted: the next round's proposal, queued ahead by the proposer;
        verified: the batch this round's verify fed."""
        tier, table, device = round_.tier, self.runner.page_table, self.runner.device
        if not verify_graph_runs(self.runner.graphs, tier, len(round_.reqs)):
            return
        if tier.steps == 0 and self.step_zero:
            if moves_on(verified, round_.reqs):
                fb = moved_next_token_batch(verified, round_.reqs, round_.tokens[:, 0], table)
            else:
                fb = next_token_batch(ForwardMode.TARGET_VERIFY, round_.reqs, round_.tokens[:, 0], table, device)
        elif tier.steps > 0 and self.drafted and verified is not None and _drafted_for(tier, drafted):
            fb = next_round_batch(verified, round_.reqs, round_.num_accepted, round_.tokens, drafted, table)
        else:
            return
        if fb is None:
            return
        out = self.runner.forward(fb, capture_layers=self.capture_layers)
        self.queued = QueuedVerify(round_.reqs, tier, drafted if tier.steps > 0 else None, fb, out)


def _drafted_for(tier: Tier, drafted: Proposal | TreeProposal | None) -> bool:
    """Whether the draft queued ahead is the next round's whole draft at this tier's width."""
    if tier.is_tree:
        return isinstance(drafted, TreeProposal) and drafted.tokens.shape[1] == tier.num_draft_tokens
    return isinstance(drafted, Proposal) and drafted.max_len == tier.steps


def _serves(queued: QueuedVerify, round_: ChainRound | TreeRound) -> bool:
    if round_.tier != queued.tier or not same_requests(round_.reqs, queued.reqs):
        return False
    if queued.proposal is None:
        return True
    # The round verifies the very drafts queued, all of them (no request's room cut its draft short), in the grid
    # the queued verify fed: [B, K+1] for a chain, N nodes a request for a tree.
    if isinstance(round_, TreeRound):
        full = min(round_.num_nodes) == round_.n
    else:
        full = round_.dense and min(round_.proposal.lens) == round_.tier.steps
    return round_.proposal is queued.proposal and full


def next_round_batch(verified: ForwardBatch, reqs: list[Request], num_accepted: torch.Tensor, tokens: torch.Tensor,
                     drafted: Proposal | TreeProposal, page_table: PageTable) -> ForwardBatch | None:
    """verified: this round's verify batch, W rows per request from index n (req.num_computed is still n): [last,
    drafts] for a chain, the tree's nodes for a tree; num_accepted [B]; tokens [B, K+1] (a chain's accepted drafts,
    then its bonus token); drafted: the next round's proposal (a tree's root is the bonus token) -> the next round's
    verify, the same W rows per request moved on by a_b + 1 on the device: a chain feeds [bonus, drafts] at
    n + a_b + 1 .. n + a_b + W, a tree its nodes at those slots, each at RoPE position root + depth under the tree's
    ancestor mask. No host list is packed, nothing is copied in. The host lists (prefix_lens, max_seq_len) hold the
    longest case (a_b + 1 = W), an upper bound for launch sizes. Room up to index n + 2W - 1 reserved first; None
    (nothing reserved) when the pool is dry or the verify was not W rows a request."""
    tree = isinstance(drafted, TreeProposal)
    bsz, width = len(reqs), drafted.tokens.shape[1] + (0 if tree else 1)
    if verified.num_tokens != bsz * width or not page_table.reserve_ahead([r.row for r in reqs],
                                                                          [r.num_computed + 2 * width for r in reqs]):
        return None
    prefix = [r.num_computed + width for r in reqs]
    if not tree:  # one launch on CUDA: each eager op is ~10-25 us of host on an H100 (round_host_h100.md)
        moved = move_chain_batch(verified.seq_lens_t, num_accepted, tokens, drafted.tokens, verified.req_rows,
                                 page_table.table, page_table.page_size)
        return dataclasses.replace(verified, input_ids=moved.ids, positions=moved.positions, out_slots=moved.slots,
                                   tail_mask=None, prefix_lens=prefix, seq_lens_t=moved.seq_lens,
                                   max_seq_len=max(prefix) + width)
    move = move_tree_batch if use_fused_kernels(drafted.tokens) else moved_tree_reference
    moved = move(verified.seq_lens_t, num_accepted, drafted.tokens, drafted.parents, verified.req_rows,
                 page_table.table, page_table.page_size)
    return dataclasses.replace(verified, input_ids=moved.ids, positions=moved.positions, out_slots=moved.slots,
                               tail_mask=moved.mask, prefix_lens=prefix, seq_lens_t=moved.seq_lens,
                               max_seq_len=max(prefix) + width)


def moved_tree_reference(seq_lens: torch.Tensor, num_accepted: torch.Tensor, tokens: torch.Tensor,
                         parents: torch.Tensor, rows: torch.Tensor, table: torch.Tensor, page_size: int) -> MovedTree:
    """kernels/tree_round.move_tree_batch in torch (its arguments): node i of request b at index n + a + 1 + i,
    RoPE position n + a + 1 + depth."""
    n = tokens.shape[1]
    start, _, slots = moved_rows_reference(seq_lens, num_accepted, n, rows, table, page_size)
    tree = build_tree(tokens, parents, num_nodes=torch.full_like(num_accepted, n))
    return MovedTree(tree.tokens.flatten(), (start[:, None] + tree.depth).flatten(), slots.flatten(),
                     (start + n).to(torch.int32), tree.depth, tree.mask)
