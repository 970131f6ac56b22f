"""SpecWorker: one speculative step for the whole batch.

  draft    the proposer drafts for every decoding request: a chain of up to K tokens, or a tree of N nodes
  verify   one target forward: decoding requests feed their last token plus drafts (TARGET_VERIFY rows,
           a tail mask for trees); prefill chunks of other requests ride along in the same forward
  accept   verify_chain / verify_tree pick the accepted drafts plus one recovered/bonus token per request
  commit   trees: the accepted path's K/V moves to contiguous indices (target and draft pools); then the
           scheduler keeps K/V by length and the drafter records how much of its own K/V is still valid
One device-to-host copy per step carries every request's tokens, accept counts and logprobs.
"""

from __future__ import annotations

import itertools
import time

import torch

from hyperdraft.core.forward_batch import ForwardInput, ForwardMode, build_forward_batch, leading_tail_mask
from hyperdraft.runner.graph_runner import GraphShape
from hyperdraft.core.host_copy import to_device, to_device_many
from hyperdraft.kernels.argmax import argmax_rows
from hyperdraft.runner.model_runner import ModelRunner
from hyperdraft.engine.model_worker import ResultsCopy, forward_input, results_stream
from hyperdraft.engine.scheduler import RequestResult, ScheduledBatch
from hyperdraft.sample.batch_cache import SamplingBatchCache
from hyperdraft.sample.logits_ops import penalised_logits, probs_from_logits, token_logprobs
from hyperdraft.sample.sampler import Sampler
from hyperdraft.speculative.verify.compaction import compact_accepted, leading_fed_count
from hyperdraft.speculative.metrics import PhaseTimer, SpecMetrics
from hyperdraft.speculative.proposal import Proposal, TreeProposal
from hyperdraft.speculative.verify.rejection import verify_chain, verify_greedy_chain
from hyperdraft.speculative.verify.simulated import simulate_chain, simulate_tree
from hyperdraft.speculative.config import SpecConfig
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.speculative.verify.tree_buffers import build_tree
from hyperdraft.speculative.verify.tree_rejection import verify_greedy_tree, verify_tree


class SpecWorker:
    def __init__(self, runner: ModelRunner, proposer, spec: SpecConfig, graph_sizes: list[int] | None = None):
        self.runner, self.proposer, self.spec = runner, proposer, spec
        self.sampler = Sampler()
        self.decode_reserve = spec.max_verify_tokens  # the scheduler reserves the widest round, never less
        self.tiers = make_tier_source(spec, graph_sizes)  # static, or the adaptive controller (routes by graph size)
        self.metrics = SpecMetrics(spec.max_steps)
        self.last_tier = self.tiers.tier_for(1)
        self.timer = PhaseTimer(runner.device)
        if hasattr(proposer, "timer"):
            proposer.timer = self.timer
        self.vocab_size = runner.config.vocab_size
        self.device = runner.device
        self.decode_sampling = SamplingBatchCache(self.vocab_size, self.device)  # the running decodes: stable
        self.prefill_sampling = SamplingBatchCache(self.vocab_size, self.device)
        # Benchmark-only (lossy) accept rate; a benchmark may sweep it on a live engine that started in that mode.
        self.simulate_accept_rate = spec.simulate_accept_rate
        self.results_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def uniform_chain_rows(self, batch_size: int, steps: int) -> bool:
        """Feed every chain request the tier's full width when a captured verify graph of that width can run the
        batch (otherwise variable widths verify fewer rows)."""
        graphs = self.runner.graphs
        return graphs is not None and graphs.fits(GraphShape(steps + 1, 0), batch_size)

    def run(self, batch: ScheduledBatch) -> list[RequestResult]:
        decodes, prefills = batch.decodes, batch.prefills
        assert all(a is b for a, b in zip(batch.items, decodes + prefills)), "the scheduler puts decodes first"
        reqs = [it.req for it in decodes]
        sb = self.decode_sampling.get(reqs) if decodes else None
        round_ = None
        start = time.perf_counter()
        if decodes:
            tier = self.last_tier = self.tiers.tier_for(len(decodes))
            self.metrics.observe_tier(tier)
            with self.timer.phase("draft"):
                round_ = TreeRound(self, reqs, sb, tier) if tier.is_tree else ChainRound(self, reqs, sb, tier)

        prefill_inputs = [forward_input(it) for it in prefills]
        inputs = (round_.inputs() if round_ else []) + prefill_inputs
        ids, positions = self._packed_ids_positions(round_, prefill_inputs)
        mode = ForwardMode.TARGET_VERIFY if not prefills else ForwardMode.EXTEND
        mask = round_.tail_mask([len(inp.token_ids) for inp in inputs]) if round_ is not None else None
        fb = build_forward_batch(mode, inputs, self.runner.page_table, self.device, input_ids=ids, positions=positions,
                                 tail_mask=mask)
        with self.timer.phase("verify"):
            out = self.runner.forward(fb, capture_layers=getattr(self.proposer, "capture_layers", ()))
        target_hidden = self.proposer.target_hidden(out) if hasattr(self.proposer, "target_hidden") else None
        num_verify_tokens = ids.shape[0] - sum(len(inp.token_ids) for inp in prefill_inputs)
        self.proposer.prefill(prefills, None if target_hidden is None else target_hidden[num_verify_tokens:])

        num_verify_rows = round_.num_rows if round_ else 0
        with self.timer.phase("accept_commit"):
            if round_ is not None:  # what the next round needs: accept counts, tokens, the drafter's hidden states
                round_.accept(out.logits[:num_verify_rows], target_hidden)
        sampling_prefills = [it.req for it in prefills if it.samples]
        prefill_pieces = []
        if sampling_prefills:
            sbp = self.prefill_sampling.get(sampling_prefills)
            prefill_pieces = list(self.sampler.sample(out.logits[num_verify_rows:], sbp))
        # round_ and out keep the tail's inputs alive until the results are waited for (results_stream)
        with results_stream(self.results_stream):
            results_copy = ResultsCopy((round_.result_pieces() if round_ else []) + prefill_pieces)
        if round_ is not None and not prefills and hasattr(self.proposer, "draft_ahead"):
            # the next round's draft runs while the host commits this one (speculative/proposers/model_proposer.py)
            self.proposer.draft_ahead(reqs, round_.tier, sb, round_.num_accepted, round_.tokens)
        host = results_copy.wait()
        results, pos = (round_.results(host) if round_ else ([], 0))
        if round_ is not None:  # the step's wall time includes its one sync, so it is the real cost of the tier;
            # a step that also ran prefill chunks is not the tier's cost, so it is not timed
            seconds = None if prefills else time.perf_counter() - start
            self.tiers.observe(len(decodes), [r.num_accepted for r in results], drafted=[r.num_drafted for r in results],
                               step_seconds=seconds)
        return results + self._prefill_results(prefills, host[pos:])

    def _packed_ids_positions(self, round_, prefill_inputs: list[ForwardInput]):
        """-> (input ids [T], RoPE positions [T] or None = the sequence indices) of the round's rows, then the
        prefill chunks'; the host values go in one copy."""
        prefill_ids = [t for inp in prefill_inputs for t in inp.token_ids]
        if round_ is None:
            return to_device(prefill_ids, torch.int64, self.device), None
        round_positions = round_.positions()
        if not prefill_inputs:
            return round_.packed_ids(), round_positions
        if round_positions is None:
            return torch.cat([round_.packed_ids(), to_device(prefill_ids, torch.int64, self.device)]), None
        pos = [p for inp in prefill_inputs for p in range(inp.prefix_len, inp.prefix_len + len(inp.token_ids))]
        d_ids, d_pos = to_device_many([prefill_ids, pos], torch.int64, self.device)
        return torch.cat([round_.packed_ids(), d_ids]), torch.cat([round_positions, d_pos])

    @staticmethod
    def _prefill_results(prefills, host: list[float]) -> list[RequestResult]:
        n_sampling = sum(it.samples for it in prefills)
        sampled, sampled_lp = host[:n_sampling], host[n_sampling:]
        results, i = [], 0
        for it in prefills:
            res = RequestResult(it.num_tokens)
            if it.samples:
                res.new_tokens, res.logprobs = [int(sampled[i])], [sampled_lp[i]]
                i += 1
            results.append(res)
        return results

    def room(self, reqs) -> list[int]:
        """Tokens past the last committed one that each row has reserved (narrower than a full round only when
        a lone request fills the pool): never draft or verify past it."""
        return [self.runner.page_table.num_slots(r.row) - r.num_computed - 1 for r in reqs]


def _last_token(req) -> int:
    return req.output_ids[-1] if req.output_ids else req.prompt_ids[-1]


class ChainRound:
    """Drafts form a chain; verify rows are [last, d_0 .. d_{len-1}] per request (lengths may differ)."""

    def __init__(self, worker: SpecWorker, reqs, sb, tier: Tier):
        self.w, self.reqs, self.sb, self.tier = worker, reqs, sb, tier
        self.proposal: Proposal = worker.proposer.propose(reqs, tier.steps, sb)
        self.proposal.lens = [min(k, m) for k, m in zip(self.proposal.lens, worker.room(reqs))]
        # Rows fed per request: each request's own drafts, or, where a captured verify graph can run the batch,
        # every request the tier's full width (the rows past a request's drafts are verified and ignored; past
        # its reserved room they write to the padding page).
        uniform = worker.uniform_chain_rows(len(reqs), tier.steps)
        if uniform and self.proposal.max_len < tier.steps:
            self.proposal.tokens = torch.nn.functional.pad(self.proposal.tokens, (0, tier.steps - self.proposal.max_len))
        k1 = self.proposal.max_len + 1
        self.rows_fed = [k1 - 1] * len(reqs) if uniform else self.proposal.lens
        self.num_rows = sum(self.rows_fed) + len(reqs)
        # Dense: every request feeds all K+1 rows, so the packed verify rows already are the [B, K+1] grid and need
        # no gather or scatter (on a GPU the scatter alone moves 2 x B*(K+1)*V floats).
        self.dense = self.num_rows == len(reqs) * k1
        starts = list(itertools.accumulate((1 + k for k in self.rows_fed), initial=0))[:-1]  # packed row of row 0
        flat = [] if self.dense else [b * k1 + j for b, k in enumerate(self.rows_fed) for j in range(k + 1)]
        self.last, self.lens, self.starts, self.flat_index, self.rows = to_device_many(
            [[_last_token(r) for r in reqs], self.proposal.lens, starts, flat, [r.row for r in reqs]], torch.int64,
            worker.device)

    def inputs(self) -> list[ForwardInput]:
        return [ForwardInput(r.row, r.num_computed, [0] * (1 + k), 1 + k) for r, k in zip(self.reqs, self.rows_fed)]

    def packed_ids(self) -> torch.Tensor:
        grid = torch.cat([self.last[:, None], self.proposal.tokens], 1)  # [B, K+1]
        return grid.flatten() if self.dense else grid.flatten()[self.flat_index]

    def positions(self):
        return None

    def tail_mask(self, extend_lens: list[int]):
        return None  # chains are causal

    def accept(self, verify_logits: torch.Tensor, target_hidden: torch.Tensor | None) -> None:
        bsz, k = len(self.reqs), self.proposal.max_len
        grid = verify_logits  # [B*(K+1), V]
        if not self.dense:  # rows past a request's drafts stay unused
            grid = verify_logits.new_zeros(bsz * (k + 1), verify_logits.shape[1])
            grid[self.flat_index] = verify_logits
        # Every request greedy, drafts one-hot: p is the one-hot of each row's argmax, so verification needs only
        # the argmax tokens (p is never built, nor the verify rows' parameters unless penalties change the logits).
        greedy = self.sb.all_greedy and self.proposal.q is None
        sbv = self.sb.for_verify(self.proposal.tokens) if not greedy or self.sb.penalties is not None else None
        logits = penalised_logits(grid, sbv) if sbv is not None else grid
        target = argmax_rows(logits).view(bsz, k + 1) if greedy else None
        p = None if greedy else probs_from_logits(logits, sbv).view(bsz, k + 1, -1)
        draft, lens, alpha = self.proposal.tokens, self.lens, self.w.simulate_accept_rate
        if alpha is not None:  # benchmark-only, lossy (see speculative/verify/simulated.py)
            num_accepted, tokens = simulate_chain(p, draft, lens, alpha, self.sb.seeds, self.sb.positions,
                                                  greedy_target=target)
        elif greedy:
            num_accepted, tokens = verify_greedy_chain(target, draft, lens)
        else:
            num_accepted, tokens = verify_chain(p, draft, lens, self.proposal.q, self.sb.seeds, self.sb.positions)
        if target_hidden is not None:  # verify row j of request b sits at packed row start_b + j
            if self.dense:
                accepted_hidden = target_hidden[: self.num_rows].view(bsz, k + 1, -1)
            else:
                rows = (self.starts[:, None] + torch.arange(k + 1, device=grid.device)).clamp_max(self.num_rows - 1)
                accepted_hidden = target_hidden[rows]
            self.w.proposer.store_accepted_hidden(self.rows, accepted_hidden)
        self.num_accepted, self.tokens = num_accepted, tokens  # what the next round's catch-up feeds (draft-ahead)
        self.logits = logits

    def result_pieces(self) -> list[torch.Tensor]:
        """What the host reads after accept(): [B] accept counts, [B, K+1] tokens, their [B, K+1] logprobs."""
        logprobs = token_logprobs(self.logits, self.tokens.flatten()).view_as(self.tokens)
        return [self.num_accepted, self.tokens, logprobs]

    def results(self, host: list[float]) -> tuple[list[RequestResult], int]:
        bsz, k1 = len(self.reqs), self.proposal.max_len + 1
        accepted = [int(a) for a in host[:bsz]]
        tokens, logprobs = host[bsz : bsz + bsz * k1], host[bsz + bsz * k1 : bsz + 2 * bsz * k1]
        results = []
        for b, a in enumerate(accepted):
            row = slice(b * k1, b * k1 + a + 1)
            results.append(RequestResult(a + 1, [int(t) for t in tokens[row]], logprobs[row], self.proposal.lens[b], a))
        self.w.proposer.commit(self.reqs, self.proposal.max_len, accepted)
        self.w.metrics.observe(self.proposal.lens, accepted)
        return results, bsz + 2 * bsz * k1


class TreeRound:
    """Drafts form a tree of N nodes per request (node 0 = the last committed token), verified in one forward
    with an ancestor mask; the accepted path is then compacted to contiguous indices."""

    def __init__(self, worker: SpecWorker, reqs, sb, tier: Tier):
        self.w, self.reqs, self.sb, self.tier, self.n = worker, reqs, sb, tier, tier.num_draft_tokens
        self.proposal: TreeProposal = worker.proposer.propose_tree(reqs, tier.steps, tier.topk, self.n, sb)
        room = worker.room(reqs)
        self.num_nodes = [min(self.n, m + 1) for m in room]  # fewer only when a lone request fills the pool
        # The beam writes offsets up to (steps-1)*topk whatever the room; past the room they land in the padding
        # page, so such nodes have no draft K/V to keep.
        self.room, num_nodes, self.base, self.rows = to_device_many(
            [room, self.num_nodes, [r.num_computed for r in reqs], [r.row for r in reqs]], torch.int64, worker.device)
        self.tree = build_tree(self.proposal.tokens, self.proposal.parents, q=self.proposal.q, num_nodes=num_nodes)
        self.num_rows = len(reqs) * self.n

    def inputs(self) -> list[ForwardInput]:
        return [ForwardInput(r.row, r.num_computed, [0] * self.n, self.n) for r in self.reqs]

    def tail_mask(self, extend_lens: list[int]) -> torch.Tensor:
        """The ancestor masks of every tree, with causal rows for the prefill chunks riding along."""
        return leading_tail_mask(self.tree.mask, extend_lens, self.w.device)

    def packed_ids(self) -> torch.Tensor:
        return self.tree.tokens.flatten()

    def positions(self) -> torch.Tensor:
        return (self.base[:, None] + self.tree.depth).flatten()

    def accept(self, verify_logits: torch.Tensor, target_hidden: torch.Tensor | None) -> None:
        bsz, n = len(self.reqs), self.n
        sampled = self.proposal.q is not None  # children drawn from q without replacement (tree_sampled.py)
        greedy = self.sb.all_greedy and not sampled  # p one-hot at each node's argmax: verify from the argmax tokens
        sbt = None
        if not greedy or self.sb.penalties is not None:
            sbt = self.sb.for_tree(self.tree.tokens, self.tree.mask, self.tree.depth)
        logits = penalised_logits(verify_logits, sbt) if sbt is not None else verify_logits
        target = argmax_rows(logits).view(bsz, n) if greedy else None
        p = None if greedy else probs_from_logits(logits, sbt).view(bsz, n, -1)
        alpha = self.w.simulate_accept_rate
        if alpha is not None:  # benchmark-only, lossy (see speculative/verify/simulated.py)
            num_accepted, path, tokens = simulate_tree(p, self.tree, alpha, self.sb.seeds, self.sb.positions,
                                                       max_depth=self.tier.steps, greedy_target=target)
        elif greedy:
            num_accepted, path, tokens = verify_greedy_tree(target, self.tree, max_depth=self.tier.steps)
        else:
            num_accepted, path, tokens = verify_tree(p, self.tree, self.sb.seeds, self.sb.positions, sampled,
                                                     max_depth=self.tier.steps, max_children=self.tier.topk)
        self._compact(num_accepted, path)
        rows = torch.arange(bsz, device=path.device)[:, None] * n + path.clamp_min(0)
        if target_hidden is not None:  # the accepted path's hidden states, compacted like its K/V
            self.w.proposer.store_accepted_hidden(self.rows, target_hidden[rows])
        self.depth = tokens.shape[1]
        self.num_accepted, self.tokens = num_accepted, tokens  # what the next round's catch-up feeds (draft-ahead)
        self.logits, self.path_rows = logits, rows

    def result_pieces(self) -> list[torch.Tensor]:
        """What the host reads after accept(): [B] accept counts, [B, D+1] path tokens (-1 past the path), their
        logprobs, [B] valid draft K/V counts."""
        logprobs = token_logprobs(self.logits, self.tokens.clamp_min(0).flatten(), self.path_rows.flatten())
        return [self.num_accepted, self.tokens, logprobs.view_as(self.tokens), self.valid_draft]

    def _compact(self, num_accepted: torch.Tensor, path: torch.Tensor) -> None:
        rows = self.rows
        count = num_accepted + 1
        compact_accepted(self.w.runner.pool, self.w.runner.page_table, rows, self.base, path.clamp_min(0), count)
        fed_on_path = self.proposal.fed.gather(1, path.clamp_min(0))
        fed_on_path = torch.where(fed_on_path <= self.room[:, None], fed_on_path, -1)
        self.valid_draft = leading_fed_count(fed_on_path, num_accepted)
        if getattr(self.w.proposer, "compacts_draft_pool", False):
            compact_accepted(self.w.proposer.pool, self.w.runner.page_table, rows, self.base, fed_on_path.clamp_min(0),
                             1 + self.valid_draft)

    def results(self, host: list[float]) -> tuple[list[RequestResult], int]:
        bsz, d1 = len(self.reqs), self.depth
        accepted = [int(a) for a in host[:bsz]]
        tokens, logprobs = host[bsz : bsz + bsz * d1], host[bsz + bsz * d1 : bsz + 2 * bsz * d1]
        valid_draft = [int(v) for v in host[bsz + 2 * bsz * d1 : 2 * bsz + 2 * bsz * d1]]
        nodes = self.num_nodes
        results = []
        for b, a in enumerate(accepted):
            row = slice(b * d1, b * d1 + a + 1)
            results.append(RequestResult(a + 1, [int(t) for t in tokens[row]], logprobs[row], nodes[b] - 1, a))
        self.w.proposer.commit_tree(self.reqs, valid_draft)
        self.w.metrics.observe([self.tier.steps] * bsz, accepted, proposed=[k - 1 for k in nodes])
        return results, 2 * bsz + 2 * bsz * d1


class StaticTiers:
    """The tier source without adaptive speculation: one fixed tier."""

    def __init__(self, tier: Tier):
        self.tier = tier

    def tier_for(self, batch_size: int) -> Tier:
        return self.tier

    def observe(self, batch_size: int, accepted_drafts: list[int], **kw) -> None:
        pass

    def state(self) -> dict:
        return {}


def make_tier_source(spec: SpecConfig, graph_sizes: list[int] | None = None):
    if spec.adaptive is None:
        return StaticTiers(Tier(spec.num_steps, spec.topk, spec.num_draft_tokens))
    from hyperdraft.speculative.adaptive.ema import AdaptiveController

    factory = None
    if spec.adaptive.strategy == "goodput":
        from hyperdraft.speculative.adaptive.goodput import GoodputSlot

        options = dict(spec.adaptive.goodput)  # GoodputSlot keyword arguments from the config's "goodput" object

        def factory(slot_key, slot_cfg, start_steps):
            return GoodputSlot(list(slot_cfg.tiers), start_steps, **options)

    return AdaptiveController(spec.adaptive, spec.num_steps, graph_sizes, slot_factory=factory)
