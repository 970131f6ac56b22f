"""EagleProposer (EAGLE, EAGLE3): a one-layer head drafts from the target's own hidden states.

Alignment (hyperdraft/models/eagle.py): head position i consumes (target hidden h_i, token t_{i+1}) and writes
its K/V at index i of the request, under the target's page table; its output g_i predicts t_{i+2}.

Invariant, per request: the head's K/V is right for positions < d = req.draft_num_computed, and
hidden_buf[row, : n - d] holds the target's h_d .. h_{n-1} (n = req.num_computed), which it has not consumed yet.
  catch-up   every round starts by feeding positions d .. n-1 (tokens t_{d+1} .. t_n); its last output
             g_{n-1} gives the root's children. This is the draft extend after verify, merged into the next round,
             so finished requests never need an idle extend. When a CUDA graph can run it, every request is
             padded to one captured width (positions past n-1, overwritten before they are read; catch_up_batch).
  steps      draft step k >= 1 runs at position n-1+k on (parent's head output, parent's token)
  verify     the K/V written by the steps is speculative: d stays n, and the target hidden states of the
             accepted path (root + accepted nodes, compacted) become hidden_buf[row, : a+1]
  prefill    a chunk [s, e) feeds positions up to e-2; position e-1 waits in hidden_buf for the next chunk or
             round (its next token may be the one about to be sampled).
  parked     adaptive step 0 as plain decodes (slot_hidden.py): h_d .. h_{n-1} wait in SlotHidden at their slots
             instead; the next round first extends the head over d .. n-2 from there, leaving n-1 pending, as a prefill
             chunk does.
Every buffer here is sized from the head's own dimensions, never the target's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hyperdraft.attention.registry import make_attention_backend
from hyperdraft.config import EngineArgs
from hyperdraft.core.forward_batch import ForwardBatch, ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.core.host_copy import to_device
from hyperdraft.core.schedule import ScheduledRequest
from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel
from hyperdraft.kernels.draft_plan import pack_catch_up
from hyperdraft.kvcache.kv_pool import KVPool
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.kvcache.prefix_cache import ParkedHeads
from hyperdraft.models.decoder import DecoderLM
from hyperdraft.models.eagle import Eagle3Head, EagleHead, target_capture_layers
from hyperdraft.models.eagle_loader import load_eagle_head
from hyperdraft.models.hot_vocab import load_token_map
from hyperdraft.models.hybrid import HybridLM
from hyperdraft.models.mtp import MtpHead, load_mtp_head, load_model_config_if_model
from hyperdraft.request import Request
from hyperdraft.runner.graph_runner import GraphSettings
from hyperdraft.runner.model_runner import DecodeSink, ForwardOutput, GraphedRunner
from hyperdraft.sample.logits_ops import SamplingBatch
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.speculative.config import SpecConfig, check_topk_fits
from hyperdraft.speculative.proposal import Proposal, TreeProposal
from hyperdraft.speculative.proposer import ProposerCapabilities, ProposerContext
from hyperdraft.speculative.proposers.model_proposer import ModelProposer
from hyperdraft.speculative.proposers.slot_hidden import SlotHidden


class HeadRunner(GraphedRunner):
    """The head's forward over a ForwardBatch (tokens + fb.input_hidden), with its own KV pool: what the graph
    runner captures and replays for draft steps. Every size here is the head's own."""

    def __init__(self, head, page_table: PageTable, attention_backend: str, graphs: GraphSettings | None = None):
        super().__init__(page_table, graphs, input_hidden_size=head.hidden_size)
        self.model = head
        param = next(head.parameters())
        self.device, self.dtype = param.device, param.dtype
        num_slots = page_table.num_pages * page_table.page_size
        self.pool = KVPool(head.num_layers, num_slots, head.num_kv_heads, head.head_dim, self.dtype, self.device)
        self.backend = make_attention_backend(attention_backend, self.pool, page_table)

    @torch.inference_mode()
    def forward_eager(self, fb: ForwardBatch, capture_layers: tuple[int, ...] = (),
                      after_layer: Callable[[int], None] | None = None) -> ForwardOutput:
        """One layer: no segments to cut (after_layer is never called)."""
        meta = self.backend.plan(fb)
        g = self.model(fb.input_ids, fb.positions, fb.input_hidden,
                       lambda i, q, k, v, rope=None: self.backend.forward(i, q, k, v, fb, meta, rope))
        rows = fb.logits_rows(g)
        return ForwardOutput(self.model.compute_draft_logits(rows), g, [], self.model.vocab_map, rows)


class EagleProposer(ModelProposer):
    @classmethod
    def load_draft(cls, spec: SpecConfig, target: DecoderLM | HybridLM, args: EngineArgs, device: torch.device,
                   tp: TensorParallel = SINGLE) -> EagleHead | Eagle3Head | MtpHead:
        """An EAGLE / EAGLE-3 head from speculative_draft_model_path, or the MTP module of a hybrid checkpoint: the
        target's own when no path is given (NEXTN, MTP), or the checkpoint the path names. Under tensor parallelism
        an EAGLE / EAGLE-3 head's layers split over tp (SINGLE: whole on every rank); an MTP module is whole."""
        head = cls._load_head(spec, target, args, tp)
        vocab_map = head.vocab_map  # an EAGLE-3 draft vocabulary or a token map's hot ids, else the target's whole
        vocab = target.config.vocab_size if vocab_map is None else vocab_map.draft_to_target.numel()
        check_topk_fits(spec, vocab, "the head's vocabulary" if vocab_map is None else "the head's draft vocabulary",
                        args.speculative_eagle_topk)
        return head

    @classmethod
    def _load_head(cls, spec: SpecConfig, target: DecoderLM | HybridLM, args: EngineArgs,
                   tp: TensorParallel) -> EagleHead | Eagle3Head | MtpHead:
        path = spec.draft_model_path or args.model_path
        hot_ids = None if spec.token_map is None else load_token_map(spec.token_map, target.config.vocab_size)
        if spec.algorithm == "EAGLE" and load_model_config_if_model(path) is not None:
            return load_mtp_head(path, target, load_format=args.load_format, hot_ids=hot_ids)
        if spec.draft_model_path is None:
            raise ValueError(f"speculative_draft_model_path is required for speculative_algorithm {spec.algorithm}: "
                             f"{args.model_path!r} has no MTP module of its own")
        head = load_eagle_head(spec.draft_model_path, target, load_format=args.load_format, hot_ids=hot_ids, tp=tp)
        if head.config.kind != spec.algorithm.lower():
            raise ValueError(f"speculative_draft_model_path holds an {head.config.kind.upper()} head "
                             f"({head.config.architecture}), but speculative_algorithm is {spec.algorithm}")
        return head

    @classmethod
    def parked_bytes_per_slot(cls, draft: EagleHead | Eagle3Head | MtpHead) -> int:
        return SlotHidden.bytes_per_slot(draft.hidden_size, next(draft.parameters()).dtype)

    def __init__(self, ctx: ProposerContext, head: EagleHead | Eagle3Head | MtpHead):
        self.head = head
        param = next(head.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.page_table = ctx.target.page_table
        runner = HeadRunner(head, self.page_table, ctx.attention_backend, ctx.graphs)
        # The head's K/V is never compacted: the next catch-up rewrites it from target hidden states.
        super().__init__(ctx, runner, ProposerCapabilities(target_capture_layers(head), feeds_hidden=True,
                                                           drafts_ahead=True))
        self.pool = runner.pool
        # Sized from the head's own hidden size, for the widest round any tier can run.
        self.hidden_buf = torch.zeros(ctx.max_rows, ctx.spec.max_verify_tokens + 1, head.hidden_size, dtype=self.dtype,
                                      device=self.device)
        self.slot_hidden = SlotHidden(self.page_table, head.hidden_size, self.dtype, self.device,
                                      self.capabilities.capture_layers, self.target_hidden) if ctx.parks_head else None

    def decode_sink(self) -> DecodeSink | None:
        return self.slot_hidden

    def parked_heads(self) -> ParkedHeads | None:
        return self.slot_hidden

    # ---- parked (slot_hidden.py) ----------------------------------------------------------------------------------
    def park(self, reqs: list[Request]) -> None:
        if self.slot_hidden is not None:
            self.slot_hidden.park(reqs, self.hidden_buf)

    def propose(self, reqs: list[Request], tier: Tier, sampling: SamplingBatch) -> Proposal | TreeProposal:
        if self.slot_hidden is not None:
            self._unpark(self.slot_hidden.unpark(reqs))
        return super().propose(reqs, tier, sampling)

    def _unpark(self, reqs: list[Request]) -> None:
        """Feed each parked request's positions d .. n-2 from SlotHidden (one eager extend for all of them) and leave
        position n-1 pending in hidden_buf: the round's catch-up starts there, as after a prefill chunk."""
        if not reqs:
            return
        fed = [r for r in reqs if r.num_computed - 1 > r.draft_num_computed]
        rows = [r.row for r in fed for _ in range(r.draft_num_computed, r.num_computed - 1)]
        index = [i for r in fed for i in range(r.draft_num_computed, r.num_computed - 1)]
        kept = self.slot_hidden.gather(rows + [r.row for r in reqs], index + [r.num_computed - 1 for r in reqs])
        if fed:
            inputs = [ForwardInput(r.row, r.draft_num_computed,
                                   r.token_ids(r.draft_num_computed + 1, r.num_computed), 0) for r in fed]
            self._forward(build_forward_batch(ForwardMode.DRAFT_EXTEND, inputs, self.page_table, self.device),
                          kept[: len(index)])
        self.hidden_buf[to_device([r.row for r in reqs], torch.int64, self.device), 0] = kept[len(index):]
        for r in reqs:
            r.draft_num_computed = r.num_computed - 1

    # ---- the head -----------------------------------------------------------------------------------------------
    def _forward(self, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (head outputs [T, H], logits over the target vocab at fb.logits_indices), from a graph or eagerly."""
        fb.input_hidden = hidden.to(self.dtype)
        out = self.runner.forward(fb)
        return out.hidden, out.target_logits()

    def target_hidden(self, out: ForwardOutput) -> torch.Tensor:
        """What the head consumes from a target forward: [T, H] (EAGLE-3 projects its 3 aux states through fc; a
        graph captured with this as its projection did that inside it)."""
        if out.head_inputs is not None:
            return out.head_inputs
        if self.capabilities.capture_layers:
            return self.head.project_target_hidden(torch.cat(out.captured, -1).to(self.dtype))
        return out.hidden.to(self.dtype)

    # ---- prefill ------------------------------------------------------------------------------------------------
    def extend(self, items: list[ScheduledRequest], target_hidden: torch.Tensor | None) -> None:
        """items: the prefill chunks of this step; target_hidden: [sum of chunk lengths, H], in item order.
        A chunk [s, e) feeds positions d .. e-2 (d <= s: a position left pending by the previous chunk is fed
        from hidden_buf) and leaves position e-1 pending, so a round always has a position to start from. A request
        that starts on a prefix cached by a parked head (d < s - 1, kvcache/prefix_cache.py) first extends over the
        target states kept in the hit's slots, as a parked request's next round does."""
        if self.slot_hidden is not None:
            self.slot_hidden.forget([it.req for it in items])
            self._unpark([it.req for it in items if it.req.draft_num_computed < it.req.num_computed - 1])
        inputs, pieces, start = [], [], 0
        for it in items:
            req, s, e = it.req, it.req.num_computed, it.req.num_computed + it.num_tokens
            d = req.draft_num_computed
            assert s - 1 <= d <= s, "head fell out of step during prefill"
            if e - 1 > d:
                inputs.append(ForwardInput(req.row, d, req.token_ids(d + 1, e), 0))
                pieces += [self.hidden_buf[req.row, : s - d], target_hidden[start : start + e - 1 - s]]
            start += e - s
        if inputs:
            hidden = torch.cat(pieces)  # gathered before hidden_buf is overwritten below
            self._forward(build_forward_batch(ForwardMode.DRAFT_EXTEND, inputs, self.page_table, self.device), hidden)
        start = 0
        for it in items:
            req, e = it.req, it.req.num_computed + it.num_tokens
            self.hidden_buf[req.row, 0] = target_hidden[start + it.num_tokens - 1]
            req.draft_num_computed = e - 1
            start += it.num_tokens

    # ---- a round ------------------------------------------------------------------------------------------------
    def catch_up_tokens(self, req: Request) -> list[int]:
        tokens = req.token_ids(req.draft_num_computed + 1, req.seq_len)  # t_{d+1} .. t_n
        assert tokens, "every decoding request has at least its last position to feed"
        return tokens

    def caught_up(self, reqs: list[Request]) -> None:
        for r in reqs:
            r.draft_num_computed = r.num_computed

    def catch_up_hidden(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[B * width, H]: each row's hidden_buf entries 0 .. width-1 (the target states it has not consumed)."""
        return self.hidden_buf[rows, :width].flatten(0, 1)

    def catch_up_batch(self, reqs: list[Request], tokens: list[list[int]], width: int | None) -> ForwardBatch:
        """Positions d .. n-1 of every request, logits at n-1; ragged (width None) or padded to `width`.

        Padding feeds every request `width` positions d .. d+width-1 (so a captured graph runs the batch) and takes
        the logits at its last real one. It is harmless: it writes head K/V at positions n .. at most n + width - 2,
        which the scheduler has reserved (decode_reserve >= steps + 1 >= width) or which map to the padding page,
        and which no one reads before the draft steps (or the next catch-up) overwrite them; it comes after the real
        positions, so causal attention hides it from them. Its hidden inputs are the row's stale hidden_buf entries
        (target states of earlier rounds, or zeros): finite, so its K/V never put a NaN beside a masked key (0 * NaN
        would reach the real rows). hidden_buf holds max_verify_tokens + 1 >= width entries."""
        if width is None:
            inputs = [ForwardInput(r.row, r.draft_num_computed, t, 1) for r, t in zip(reqs, tokens)]
            flat = to_device([(r.row, j) for r, t in zip(reqs, tokens) for j in range(len(t))], torch.int64, self.device)
            fb = build_forward_batch(ForwardMode.DRAFT_EXTEND, inputs, self.page_table, self.device)
            fb.input_hidden = self.hidden_buf[flat[:, 0], flat[:, 1]]
            return fb
        inputs = [ForwardInput(r.row, r.draft_num_computed, t + [0] * (width - len(t)), 1, padding=width - len(t))
                  for r, t in zip(reqs, tokens)]
        fb = build_forward_batch(ForwardMode.DRAFT_EXTEND, inputs, self.page_table, self.device)
        fb.input_hidden = self.catch_up_hidden(fb.req_rows, width)
        return fb

    def ahead_catch_up(self, reqs: list[Request], num_accepted: torch.Tensor, tokens: torch.Tensor,
                       out: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        """Write the next round's packed catch-up (CatchUpRows.packed layout) into out [bs >= B, PACKED_FIELDS + W]
        from this round's results, on the device: head positions n .. n+a (n = req.num_computed, not yet committed)
        fed with t_{n+1} .. t_{n+a+1} = the a accepted drafts and the bonus token (tokens[:, :a+1]); rows past B
        are padding. kept: unused (a head keeps no K/V of the round's drafts)."""
        rows_starts = to_device([[r.row, r.num_computed] for r in reqs], torch.int64, self.device)
        pack_catch_up(rows_starts, num_accepted, tokens, out)

    def catch_up_width(self, tier) -> int:
        """Positions the catch-up after a round of `tier` can feed: the root and every accepted draft."""
        return tier.steps + 1

    def queued_room(self, tier: Tier) -> int:
        """The queued round writes catch-up positions from n (padded to its width) and steps up to
        width + (steps-1)*topk - 1 past n. None of it need survive the commit: the catch-up's real positions end below
        the committed tokens, and the steps' K/V past them is speculative (the round after rewrites it)."""
        return self.catch_up_width(tier) + (tier.steps - 1) * tier.topk

    # ---- after verify -------------------------------------------------------------------------------------------
    def store_accepted_hidden(self, rows: torch.Tensor, accepted_hidden: torch.Tensor) -> None:
        """rows: [B] the requests' page-table rows, on the device; accepted_hidden: [B, D+1, H] target hidden states
        of the root and accepted nodes, in path order (rows past each request's accepted count are ignored by the
        next catch-up)."""
        self.hidden_buf[rows, : accepted_hidden.shape[1]] = accepted_hidden.to(self.dtype)

    def commit(self, reqs: list[Request], draft_kv_valid: list[int]) -> None:
        pass  # draft_num_computed already equals n: the steps' K/V was speculative
