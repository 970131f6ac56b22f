"""SpecWorker: one speculative step for the whole batch.

  draft    the tier source picks this step's Tier; the proposer drafts a chain of up to K tokens, or a tree of N
           nodes, for every decoding request
  verify   one target forward: decoding requests feed their last token plus drafts (TARGET_VERIFY rows, a tail
           mask for trees); prefill chunks of other requests ride along, and the proposer extends over them. Prompt
           tails that fit a captured extend graph (runner/prompt_tails.py) run as a forward of their own instead
           (beside the verify, or alone), so the step runs nothing eagerly
  accept   the round (verify/chain.py, verify/tree.py) picks the accepted drafts plus one recovered or bonus token per
           request on the device; trees move the accepted path's K/V to contiguous indices
  results  ONE device-to-host copy (core/host_copy.HostCopy) carries every request's tokens, accept counts and
           logprobs; a drafter that drafts ahead queues the next round's draft, and the round then that draft's
           verify (verify_ahead.py), before the host waits for it
  commit   the round decodes the copy (a pure function) into a RoundOutcome; the worker commits the proposer and
           feeds the metrics and the tier source from it; the scheduler then keeps K/V by length

A step of decodes only whose tier is step 0 (adaptive tiers), or whose NGRAM round found no draft for any request (any
tier, adaptive or static), runs as the plain worker's decode step instead of a round of one-row verifies: the plain
worker queues the next decode before the host waits (engine/model_worker.py), which a round cannot. On an H100 NGRAM's
step-0 rounds ran 17-35% below plain decoding at 64-256 requests (benchmarks/results/batch_curve_h100.md). Any other
step first discards that queued decode. NGRAM and STANDALONE are idle there; an EAGLE head, which must see every
token, parks (proposers/slot_hidden.py): the decodes keep its input states by slot, and its next round consumes them.
With park_head off (or a hybrid target, for which the plain worker never runs speculative steps), an EAGLE head's
step-0 steps stay rounds, each queuing the next round's verify (verify_ahead.py). NGRAM's lookups queued ahead
(proposers/ngram.py) are not seen by the host before their round: a round whose drafts turned out empty for every
request keeps the lookup and verify queued behind it, a K+1-row verify costing about a decode where the host's
lookup and an idle GPU would cost more (RuntimeOptions.ahead_after_empty; off, it drops them, and the step after
looks up on the host and can become such a plain decode: NGRAM chain 4 on chat at batch 1 then ran at 0.79-0.98x
plain against 1.00-1.19x on an H200, benchmarks/results/ngram_ahead_h200.md).
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple, Protocol

import torch

from hyperdraft.core.forward_batch import ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.core.host_copy import HostCopy, results_stream
from hyperdraft.core.schedule import RequestResult, ScheduledBatch, ScheduledRequest
from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel
from hyperdraft.request import Request
from hyperdraft.runner.model_runner import ForwardOutput, ModelRunner
from hyperdraft.runner.prompt_tails import padded_tails, tail_shapes
from hyperdraft.sample.batch_cache import SamplingBatchCache
from hyperdraft.sample.logits_ops import SamplingBatch
from hyperdraft.sample.sampler import SampledTokens, Sampler, sampled_rows
from hyperdraft.speculative.adaptive.controller import TierSource
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.speculative.config import SpecConfig
from hyperdraft.speculative.graph_plan import CapturePlan, verify_shapes
from hyperdraft.speculative.metrics import PhaseTimer, SpecMetrics
from hyperdraft.speculative.proposal import Proposal, TreeProposal
from hyperdraft.speculative.proposer import Proposer
from hyperdraft.speculative.verify.batch import verify_batch
from hyperdraft.speculative.verify.chain import ChainPieces, ChainRound
from hyperdraft.speculative.verify.round import RoundContext, RoundOutcome
from hyperdraft.speculative.verify.tree import TreePieces, TreeRound
from hyperdraft.speculative.verify_ahead import VerifyAhead


class StepPieces(NamedTuple):
    """Everything one step copies to the host."""

    round: ChainPieces | TreePieces | None  # the decoding requests' verify round
    prefill: SampledTokens | None  # the prefill chunks that reached the end of their prompt


class PlainDecoder(Protocol):
    """The plain worker (engine/model_worker.ModelWorker), as the speculative worker uses it for step-0 batches."""

    def run(self, batch: ScheduledBatch) -> list[RequestResult]: ...

    def discard_ahead(self) -> None: ...


class SpecWorker:
    def __init__(self, target: ModelRunner, proposer: Proposer, spec: SpecConfig, tiers: TierSource,
                 timer: PhaseTimer, tp: TensorParallel = SINGLE, plain: PlainDecoder | None = None,
                 verify_ahead: bool = True, round_ahead: bool = True, ahead_after_empty: bool = True):
        """tp: the engine's tensor-parallel group. Under adaptive speculation every rank's tier source learns rank 0's
        step times, so the ranks pick the same tier (goodput decides from step times; each GPU's clock differs).
        plain: the worker that runs step-0 batches of decodes (module doc), over the same target runner; None: rounds
        run them. verify_ahead: queue a step-0 round's next verify (verify_ahead.py; RuntimeOptions.decode_ahead);
        round_ahead: a drafted round's, after its drafter queued the next draft (RuntimeOptions.round_ahead);
        ahead_after_empty: a round whose queued lookups drafted nothing anywhere keeps what is queued behind it
        (RuntimeOptions.ahead_after_empty; module doc)."""
        self.runner, self.proposer, self.spec, self.tiers, self.timer = target, proposer, spec, tiers, timer
        self.plain = plain
        self.ahead_after_empty = ahead_after_empty
        self.tp = tp if spec.adaptive is not None else SINGLE
        self.capabilities = proposer.capabilities
        self.verify_ahead = VerifyAhead(target, proposer.capabilities.capture_layers, verify_ahead and plain is None,
                                        round_ahead)
        self.round_context = RoundContext(target, proposer, spec.simulate_accept_rate, spec.sampling == "coupled",
                                          spec.simulate_sibling_rate)
        self.decode_reserve = spec.max_verify_tokens  # the scheduler reserves the widest round, never less
        self.metrics = SpecMetrics(spec.max_steps)
        self.last_tier = tiers.tier_for(1)
        self.after_prefill = False  # the last step ran prefill chunks: nothing was queued ahead for this one
        self.sampler = Sampler()
        self.decode_sampling = SamplingBatchCache(target.config.vocab_size, target.device)  # running decodes: stable
        self.prefill_sampling = SamplingBatchCache(target.config.vocab_size, target.device)
        self.results_stream = torch.cuda.Stream(target.device) if target.device.type == "cuda" else None

    def run(self, batch: ScheduledBatch) -> list[RequestResult]:
        decodes, prefills = batch.decodes, batch.prefills
        # A step's wall time is its tier's cost, unless prefill chunks ran in it or in the step before: that one queued
        # no draft or verify ahead, so this one runs them cold, one after the other.
        start = None if prefills or self.after_prefill else time.perf_counter()
        self.after_prefill = bool(prefills)
        tier = self.last_tier = self.tiers.tier_for(len(decodes)) if decodes else self.last_tier
        reqs = [it.req for it in decodes]
        if decodes:
            self.metrics.observe_tier(tier)
        if self.plain is not None and decodes and not prefills and tier.steps == 0:
            return self._decode_plainly(batch, reqs, tier, start)
        if decodes and not prefills and tier.steps > 0 and self.capabilities.drafts_ahead:
            # the next round's room, draft and verify, before this step's first page-table read
            self.verify_ahead.reserve(reqs, tier, self.proposer.ahead_room(tier, len(reqs)) or 0)
        sampling, proposal = self._propose(reqs, tier) if decodes else (None, None)
        if self.plain is not None:
            if self.capabilities.may_draft_nothing and proposal is not None and not prefills \
                    and _drafts_nothing(proposal):
                return self._decode_plainly(batch, reqs, tier, start)
            self.plain.discard_ahead()
        round_ = (TreeRound if tier.is_tree else ChainRound)(self.round_context, reqs, sampling, tier, proposal) \
            if decodes else None
        queued = self.verify_ahead.take(round_, with_prefills=bool(prefills))  # by the step before, or None
        fb, out = (queued.batch, queued.out) if queued is not None else (None, None)
        prefill_inputs = [it.forward_input() for it in prefills]
        tails = padded_tails(self.runner.graphs, prefill_inputs)  # run as a forward of their own where they fit
        if out is None and (round_ is not None or not tails):
            fb = verify_batch(round_, [] if tails else prefill_inputs, self.runner.page_table, self.runner.device,
                              stateful=self.runner.state_pool is not None)
            with self.timer.phase("verify"):
                out = self.runner.forward(fb, capture_layers=self.capabilities.capture_layers)
        target_hidden = self.proposer.target_hidden(out) if out is not None and self.capabilities.feeds_hidden else None
        num_rows = round_.num_rows if round_ is not None else 0
        if tails:
            prefill_logits, prefill_hidden = self._forward_tails(tails)
        else:
            prefill_logits = out.logits[num_rows:]
            prefill_hidden = None if target_hidden is None else target_hidden[num_rows:]
        self.proposer.extend(prefills, prefill_hidden)
        with self.timer.phase("accept_commit"):
            if round_ is not None:  # what the next round needs: accept counts, tokens, the drafter's hidden states
                round_.accept(out.logits[:num_rows], target_hidden)
        with results_stream(self.results_stream):  # round_ and out keep the tail's inputs alive until wait()
            copy = HostCopy(StepPieces(round_.pieces() if round_ is not None else None,
                                       self._sample_prefills(prefills, prefill_logits)))
        if round_ is not None and not prefills:  # the next round's draft, then its verify, before the host waits
            self.verify_ahead.queue(round_, self._draft_ahead(round_), fb)
        host = copy.wait()
        results = [] if round_ is None else self._commit(round_, round_.decode(host.round), start)
        return results + _prefill_results(prefills, host.prefill)

    def _draft_ahead(self, round_: ChainRound | TreeRound) -> Proposal | TreeProposal | None:
        if not self.capabilities.drafts_ahead:
            return None
        kept = round_.draft_kv_valid if isinstance(round_, TreeRound) else None
        return self.proposer.draft_ahead(round_.reqs, round_.tier, round_.sampling, round_.num_accepted,
                                         round_.tokens, kept)

    def _forward_tails(self, tails: list[ForwardInput]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The padded prompt tails' own forward (a graph replay) -> (their logits [P, V], the drafter's hidden inputs
        of their real tokens [sum of real lengths, H], or None). The verify's outputs live in its own shape's buffers,
        so this replay leaves them intact."""
        fb = build_forward_batch(ForwardMode.EXTEND, tails, self.runner.page_table, self.runner.device)
        out: ForwardOutput = self.runner.forward(fb, capture_layers=self.capabilities.capture_layers)
        if not self.capabilities.feeds_hidden:
            return out.logits, None
        width = len(tails[0].token_ids)
        hidden = self.proposer.target_hidden(out)[: len(tails) * width].view(len(tails), width, -1)
        return out.logits, torch.cat([hidden[i, : width - t.padding] for i, t in enumerate(tails)])  # <= 4 tails

    def _decode_plainly(self, batch: ScheduledBatch, reqs: list[Request], tier: Tier,
                        start: float | None) -> list[RequestResult]:
        """A batch of decodes that drafts nothing (step 0, or an NGRAM round that found no match for any request) as
        the plain worker's step. For the metrics, the tier source and each request it is a round that drafted nothing
        (the plain worker's results say so); its room stays, as a plain step's does. Nothing here is per request
        beyond what the plain step does: at 256 requests a per-result rewrite cost more than the step's own commit."""
        self.proposer.discard_ahead()  # as a round's draft_ahead at step 0 would have
        self.verify_ahead.discard()  # a queued verify never outlives the step after it
        self.proposer.park(reqs)
        results = self.plain.run(batch)
        self.metrics.observe_idle(len(results))
        seconds = None if start is None else self.tp.first_rank_value(time.perf_counter() - start)
        self.tiers.observe(len(results), [0] * len(results), step_seconds=seconds)
        return results

    def _propose(self, reqs: list[Request], tier: Tier) -> tuple[SamplingBatch, Proposal | TreeProposal]:
        sampling = self.decode_sampling.get(reqs)
        with self.timer.phase("draft"):
            return sampling, self.proposer.propose(reqs, tier, sampling)

    def _commit(self, round_: ChainRound | TreeRound, outcome: RoundOutcome, start: float | None) -> list[RequestResult]:
        """The proposer, the metrics and the tier source learn what the round accepted. The step's wall time, which
        includes its one sync, is the tier's real cost; a step with prefill chunks or after them (start None) is not."""
        if round_.tier.steps > 0:
            self.proposer.commit(round_.reqs, outcome.draft_kv_valid)
        self.metrics.observe(outcome.depth, outcome.num_accepted, proposed=outcome.num_drafted)
        seconds = None if start is None else self.tp.first_rank_value(time.perf_counter() - start)
        self.tiers.observe(len(round_.reqs), outcome.num_accepted, step_seconds=seconds)
        if self.capabilities.may_draft_nothing and round_.tier.steps > 0 and not any(outcome.num_drafted) \
                and not self.ahead_after_empty:
            # This round's drafts (a lookup queued ahead: the host learns its counts only now) were empty everywhere:
            # with ahead_after_empty off, drop the next lookup and the verify queued behind it, so that the next step
            # looks up on the host and, finding nothing again, runs as a plain decode (module doc).
            self.proposer.discard_ahead()
            self.verify_ahead.discard()
        return outcome.results

    def _sample_prefills(self, prefills: list[ScheduledRequest], logits: torch.Tensor) -> SampledTokens | None:
        sampling = [it.req for it in prefills if it.samples]
        return self.sampler.sample(logits, self.prefill_sampling.get(sampling)) if sampling else None

    def capture_graphs(self, sizes: list[int]) -> None:
        """CUDA graphs for the target's verify (or decode) shapes and the drafter's, for every tier that can run, at
        the captured batch sizes routed to it."""
        plan = CapturePlan(tuple(sizes), self.tiers.tier_sizes(sizes), self.spec.use_rejection_sampling is not False)
        sink = self.proposer.decode_sink()  # what a parked head keeps of each step-0 decode, inside its graph
        draftless = self.plain is not None and self.capabilities.may_draft_nothing
        # An EAGLE-3 head's fc over the captured states runs inside the verify and tail graphs (GraphRunner.capture);
        # verifies that round-ahead queues while the GPU works are one graph each (no segments: runner/graph_runner.py).
        project = self.proposer.target_hidden if self.capabilities.capture_layers else None
        queued_ahead = self.verify_ahead.drafted and self.capabilities.drafts_ahead
        for mode, shapes in verify_shapes(plan, decodes_everywhere=draftless).items():
            decode = mode is ForwardMode.DECODE
            self.runner.graphs.capture(shapes, mode, self.capabilities.capture_layers, sink if decode else None,
                                       None if decode else project, segmented=decode or not queued_ahead)
        if self.runner.state_pool is None:  # prompt tails riding along with a round run as their own forward
            self.runner.graphs.capture(tail_shapes(sizes), ForwardMode.EXTEND, self.capabilities.capture_layers,
                                       project=project)
        self.proposer.capture_graphs(plan)

    def release_graphs(self) -> None:
        self.verify_ahead.discard()  # its outputs live in the graphs' memory
        if self.plain is not None:
            self.plain.discard_ahead()
        self.proposer.release_graphs()
        self.runner.release_graphs()

    def state(self) -> dict:
        """The engine's internal_state, speculative part: the tier used most recently (it moves under adaptive
        tiers), the acceptance metrics, and each phase's seconds where the timer records."""
        tier, spec = self.last_tier, self.spec
        state = {"speculative_algorithm": spec.algorithm, "speculative_num_steps": tier.steps,
                 "speculative_eagle_topk": tier.topk, "speculative_num_draft_tokens": tier.num_draft_tokens,
                 **self.metrics.summary()}
        if spec.adaptive is not None:
            state["speculative_adaptive_strategy"] = spec.adaptive.strategy
        if spec.simulate_accept_rate is not None:  # outputs are NOT lossless
            state["speculative_simulate_accept_rate"] = spec.simulate_accept_rate
            state["speculative_simulate_sibling_rate"] = spec.simulate_sibling_rate
        if self.timer.enabled:
            state["spec_phase_seconds"] = dict(self.timer.seconds)
        return state

    def set_simulated_accept_rate(self, alpha: float) -> None:
        """Benchmarks only: sweep the simulated acceptance of an engine that started in that (lossy) mode, without
        rebuilding it."""
        if self.spec.simulate_accept_rate is None:
            raise ValueError("the engine verifies for real; start it with speculative_simulate_accept_rate to simulate")
        self.round_context = dataclasses.replace(self.round_context, simulate_accept_rate=alpha)


def _drafts_nothing(proposal: Proposal | TreeProposal) -> bool:
    """A proposal without a single draft token (NGRAM finding no match anywhere): verifying it is a decode."""
    if isinstance(proposal, TreeProposal):
        return proposal.num_nodes is not None and max(proposal.num_nodes) <= 1
    return not any(proposal.lens)


def _prefill_results(prefills: list[ScheduledRequest], sampled: SampledTokens | None) -> list[RequestResult]:
    """sampled: SampledTokens as lists, one row per prefill that samples, in order."""
    rows = iter([] if sampled is None else sampled_rows(sampled))
    results = []
    for it in prefills:
        res = RequestResult(it.num_tokens)
        if it.samples:
            res.new_tokens, res.logprobs = next(rows)
        results.append(res)
    return results
