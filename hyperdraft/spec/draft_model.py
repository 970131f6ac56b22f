"""DraftModelProposer (STANDALONE): a separate small LM proposes a chain of tokens.

The draft owns its ModelRunner: its own weights, KV pool, hidden size, layer and head counts. It shares the
target's PageTable, so slot s holds the same token in both pools and the scheduler's rollback-by-length
releases both at once.

Invariant: req.draft_num_computed tokens of the request have correct K/V in the draft pool, and it never
exceeds req.num_computed. A round starting at n = req.num_computed (the last token at index n still lacks K/V):
  step 0      feeds tokens[draft_num_computed .. n] (one token, or two right after a fully accepted round)
  step j > 0  feeds d_{j-1} at index n + j
so it writes indices up to n + K - 1. After verify accepts a drafts, the target has n + a + 1 tokens and the
draft's K/V is right for min(n + K, n + a + 1) of them.
"""

from __future__ import annotations

import torch

from hyperdraft.engine.host_copy import to_device
from hyperdraft.engine.forward_batch import ForwardBatch, ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.engine.model_runner import ModelRunner
from hyperdraft.engine.scheduler import ScheduledRequest
from hyperdraft.request import Request
from hyperdraft.sample.logits_ops import SamplingBatch, penalised_logits
from hyperdraft.spec.chain_loop import ChainDrafting
from hyperdraft.spec.draft_choice import draws_from_q
from hyperdraft.spec.proposal import Proposal, TreeProposal
from hyperdraft.spec.tree_draft import grow_tree
from hyperdraft.spec.tree_sampled import draft_q, grow_sampled_tree


class DraftModelProposer(ChainDrafting):
    compacts_draft_pool = True  # after a tree verify its own K/V of the accepted nodes moves like the target's
    feeds_hidden = False

    def __init__(self, runner: ModelRunner, sample_drafts: bool):
        self.runner = runner
        self.sample_drafts = sample_drafts  # draw d_j ~ q_j and keep q; otherwise greedy drafts (one-hot q)

    @property
    def pool(self):
        """The draft's own KV pool (compacted along with the target's after a tree verify)."""
        return self.runner.pool

    def prefill(self, items: list[ScheduledRequest], target_hidden=None) -> None:
        """Run the draft over the same prefill chunks the target runs, keeping both pools in lockstep."""
        if not items:
            return
        inputs = []
        for it in items:
            req = it.req
            assert req.draft_num_computed == req.num_computed, "draft fell out of step during prefill"
            inputs.append(ForwardInput(req.row, req.num_computed, req.token_ids(req.num_computed, req.num_computed + it.num_tokens), 0))
        self.runner.forward(build_forward_batch(ForwardMode.EXTEND, inputs, self.runner.page_table, self.runner.device))
        for it in items:
            it.req.draft_num_computed += it.num_tokens

    def propose(self, reqs: list[Request], steps: int, sampling: SamplingBatch) -> Proposal:
        if steps == 0:  # adaptive, a tier without speculation: nothing to draft, the next catch-up fills in
            return Proposal(torch.zeros(len(reqs), 0, dtype=torch.int64, device=self.runner.device), [0] * len(reqs))
        return super().propose(reqs, steps, sampling)

    def catch_up_tokens(self, req: Request) -> list[int]:
        return req.token_ids(req.draft_num_computed, req.seq_len)  # up to the last committed token, index n

    def caught_up(self, reqs: list[Request]) -> None:
        pass  # commit() records what the round left valid

    def catch_up_hidden(self, rows: torch.Tensor, width: int) -> None:
        return None  # a draft model reads only tokens

    def catch_up_batch(self, reqs: list[Request], tokens: list[list[int]], width: int | None) -> ForwardBatch:
        """Step 0's batch: tokens draft_num_computed .. n of every request, logits at n; ragged (width None) or
        padded to `width`. The padding tokens sit at indices n+1 .., which the scheduler has reserved
        (decode_reserve >= steps + 1 >= width) or which map to the padding page; the draft steps overwrite them
        before anything attends to them, and draft_num_computed never claims them otherwise (see commit)."""
        pad = [0 if width is None else width - len(t) for t in tokens]
        inputs = [ForwardInput(r.row, r.draft_num_computed, t + [0] * p, 1, padding=p) for r, t, p in zip(reqs, tokens, pad)]
        return build_forward_batch(ForwardMode.DRAFT_EXTEND, inputs, self.runner.page_table, self.runner.device)

    def catch_up_width(self, tier) -> int:
        """Tokens the catch-up after a round of `tier` can feed: a chain leaves at most 2 (the last draft and the
        bonus token, after a fully accepted round); a tree the root plus the accepted nodes the draft never fed."""
        return tier.steps + 1 if tier.is_tree else 2

    def propose_tree(self, reqs: list[Request], steps: int, topk: int, num_nodes: int, sampling: SamplingBatch) -> TreeProposal:
        """Grow the tree: a beam over top-k children (tree_draft.grow_tree), or children drawn from q
        (tree_sampled.grow_sampled_tree). The root is the last committed token at index n; frontier nodes of
        step i are written at offsets 1 + (i-1)*topk + f past it."""
        device = self.runner.device
        logits = self.catch_up(reqs)[1].logits
        bsz = len(reqs)

        def step_logits(depth, tokens, offsets, mask):
            k = tokens.shape[1]  # frontier size: topk, or fewer in a sampled tree with a small level budget
            inputs = [ForwardInput(r.row, r.seq_len + (depth - 1) * topk, [0] * k, k, positions=[r.seq_len - 1 + depth] * k)
                      for r in reqs]
            fb = build_forward_batch(ForwardMode.DECODE, inputs, self.runner.page_table, device,
                                     input_ids=tokens.flatten(), tail_mask=mask)
            return self.runner.forward(fb).logits  # [B*k, V]

        roots = _last_tokens(reqs, device)
        if draws_from_q(self.sample_drafts, sampling):  # children drawn from q, verified with the real q
            def q_step(depth, tokens, offsets, mask, parent_hidden):
                k = tokens.shape[1]
                return draft_q(step_logits(depth, tokens, offsets, mask), sampling.repeat_rows(k), topk).view(bsz, k, -1), None

            return TreeProposal(*grow_sampled_tree(draft_q(logits, sampling, topk), None, q_step, steps, topk, roots,
                                                   num_nodes, sampling.seeds, sampling.positions))

        def logq_step(depth, tokens, offsets, mask, parent_hidden):
            logq = torch.log_softmax(penalised_logits(step_logits(depth, tokens, offsets, mask), sampling.repeat_rows(topk)), -1)
            return logq.view(bsz, topk, -1), None

        root_logq = torch.log_softmax(penalised_logits(logits, sampling), -1)
        return TreeProposal(*grow_tree(root_logq, None, logq_step, steps, topk, roots, num_nodes))

    def commit_tree(self, reqs: list[Request], valid_draft_tokens: list[int]) -> None:
        """After a tree round and compaction the draft pool is right for the root plus the leading accepted
        nodes the draft itself had fed (moved to n+1, n+2, ...)."""
        for req, m in zip(reqs, valid_draft_tokens):
            req.draft_num_computed = req.num_computed + 1 + m

    def commit(self, reqs: list[Request], steps: int, num_accepted: list[int]) -> None:
        """Called before the scheduler's commit, so req.num_computed is still n. At steps 0 (adaptive, no
        speculation) the draft ran nothing: its state stays as it was and the next round's catch-up fills in."""
        if steps == 0:
            return
        for req, a in zip(reqs, num_accepted):
            req.draft_num_computed = min(req.num_computed + steps, req.num_computed + a + 1)


def _last_tokens(reqs: list[Request], device) -> torch.Tensor:
    return to_device([r.token_ids(r.seq_len - 1, r.seq_len)[0] for r in reqs], torch.int64, device)
