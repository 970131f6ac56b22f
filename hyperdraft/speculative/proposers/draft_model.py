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

from hyperdraft.config import EngineArgs
from hyperdraft.core.forward_batch import ForwardBatch, ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.core.host_copy import to_device
from hyperdraft.core.schedule import ScheduledRequest
from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel
from hyperdraft.kernels.draft_plan import PACKED_FIELDS, pack_catch_up
from hyperdraft.models.decoder import DecoderLM
from hyperdraft.models.hybrid import HybridLM
from hyperdraft.models.config import load_model_config
from hyperdraft.models.loader import load_model
from hyperdraft.models.tensor_parallel import split_problem
from hyperdraft.request import Request
from hyperdraft.runner.model_runner import ModelRunner
from hyperdraft.sample.logits_ops import SamplingBatch
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.speculative.config import SpecConfig, check_topk_fits
from hyperdraft.speculative.proposal import Proposal, TreeProposal
from hyperdraft.speculative.proposer import ProposerCapabilities, ProposerContext
from hyperdraft.speculative.proposers.model_proposer import ModelProposer


class DraftModelProposer(ModelProposer):
    @classmethod
    def load_draft(cls, spec: SpecConfig, target: DecoderLM, args: EngineArgs, device: torch.device,
                   tp: TensorParallel = SINGLE) -> DecoderLM:
        """The draft split over tp's ranks like the target (tp_bench --draft-rows on two H100s, Llama-1B shape for
        an 8B target, chain 5: 9.09 against 9.79 ms a step at batch 1 whole on each rank, 11.41 against 12.23 at
        batch 8: its weights are read in half the time too), or whole on each rank when its heads or MLP do not
        divide over them."""
        try:
            config = load_model_config(spec.draft_model_path)
        except ValueError as e:  # it named a model path, not the flag that gave it
            raise ValueError(f"speculative_draft_model_path: {e}") from None
        if split_problem(config, tp) is not None:
            tp = SINGLE
        draft = load_model(spec.draft_model_path, args.dtype, device, args.load_format, tp)
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"speculative_draft_model_path: the draft vocabulary has {draft.config.vocab_size} tokens, the target's "
                f"{target.config.vocab_size}; a STANDALONE draft must share the target's vocabulary")
        check_topk_fits(spec, draft.config.vocab_size, "the draft model's vocabulary", args.speculative_eagle_topk)
        return draft

    def __init__(self, ctx: ProposerContext, draft: DecoderLM | HybridLM):
        # A hybrid draft runs eagerly (its state backend is not capturable yet); its draft steps' states go to
        # scratch as wide as a round's farthest node, and commit like the target's.
        recurrent = draft.config.is_hybrid
        runner = ModelRunner(draft, ctx.target.page_table, ctx.attention_backend, None if recurrent else ctx.graphs,
                             verify_width=ctx.spec.max_verify_tokens)
        # after a tree verify its own K/V of the accepted nodes moves like the target's; greedy chains draft ahead
        # At step 0 it drafts nothing, and the next round catches up over the skipped tokens: idle, unless recurrent.
        super().__init__(ctx, runner, ProposerCapabilities(compacts_draft_pool=True, recurrent_state=recurrent,
                                                           drafts_ahead=not recurrent, idle_at_step_zero=not recurrent))
        self.pool = runner.pool

    def accept_draft_state(self, rows: torch.Tensor, last_fed: torch.Tensor) -> None:
        self.runner.state_pool.commit(rows, last_fed)

    def extend(self, items: list[ScheduledRequest], target_hidden: torch.Tensor | None = None) -> None:
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

    def propose(self, reqs: list[Request], tier: Tier, sampling: SamplingBatch) -> Proposal | TreeProposal:
        if tier.steps == 0:  # adaptive, a tier without speculation: nothing to draft, the next catch-up fills in
            return Proposal(torch.zeros(len(reqs), 0, dtype=torch.int64, device=self.runner.device), [0] * len(reqs))
        return super().propose(reqs, tier, sampling)

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

    def queued_room(self, tier: Tier) -> int:
        """Reach past n. After a round at n accepting a (n' = n + a + 1 committed, a <= steps), the queued catch-up
        feeds up to index n' and its steps write past n': a chain's n'+1 .. n'+K-1 <= n + 2K, a tree's nodes at
        offsets 1 .. (steps-1)*topk past n'. That K/V the next round keeps for the drafts it accepts (a tree's moves to
        n'+1, ... by compaction); the commit in between keeps it, as it keeps the decode reserve past n' (at least
        Tier.reserve_tokens, which covers those 1 + (steps-1)*topk tokens)."""
        written = max(tier.steps - 1, 0) * tier.topk + 1  # n' itself, then the steps' offsets
        return tier.steps + 1 + written

    def ahead_catch_up(self, reqs: list[Request], num_accepted: torch.Tensor, tokens: torch.Tensor,
                       out: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        """The next round's packed catch-up, on the device: after a round at n accepting a, the draft's K/V is right
        up to index n + f (commit): f = min(a, K - 1) after a chain of K drafts, f = kept (the accepted nodes whose
        draft K/V was compacted to n+1 ..) after a tree. So it feeds indices n+1+f .. n+a+1 with tokens[:, f .. a]:
        the bonus token, after the accepted drafts the draft never fed."""
        steps = tokens.shape[1] - 1
        first = num_accepted.clamp(max=steps - 1) if kept is None else kept
        rows_starts = to_device([[r.row, r.num_computed + 1] for r in reqs], torch.int64, self.runner.device)
        rows_starts[:, 1] += first
        columns = (first[:, None] + torch.arange(out.shape[1] - PACKED_FIELDS, device=tokens.device)).clamp(max=steps)
        pack_catch_up(rows_starts, num_accepted - first, tokens.gather(1, columns), out)

    def commit(self, reqs: list[Request], draft_kv_valid: list[int]) -> None:
        """The draft pool is right for the root plus the leading accepted nodes the draft itself had fed: a chain of
        K steps fed the root and drafts 0 .. K-2 (so min(K - 1, accepted) of them); a tree's accepted path was
        compacted to n+1, n+2, ... Called before the scheduler's commit, so req.num_computed is still n."""
        for req, valid in zip(reqs, draft_kv_valid):
            req.draft_num_computed = req.num_computed + 1 + valid

