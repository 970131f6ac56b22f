"""ModelWorker: one plain (non-speculative) step: forward the batch, sample one token per sampling request.

Decode-ahead: with CUDA graphs, a step whose batch is all decodes queues the NEXT step's decode (its input tokens are
this step's sampled tokens, still on the device; positions one further) before waiting for this step's results copy.
The GPU then decodes while the host commits and schedules. The next step takes the queued tokens when its batch is
the same requests (nothing finished, joined, was aborted or retracted) and throws them away otherwise: harmless, as
the queued forward wrote only the K/V of each request's next token (what the real step would write, or into a
finished request's released slots before their next owner writes them: one stream), and its row's slot for that
token was reserved when it was queued. Penalised batches (their counts are updated from host outputs) decode when
scheduled. RuntimeOptions.decode_ahead (HYPERDRAFT_DECODE_AHEAD=0) turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hyperdraft.core.forward_batch import ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.core.host_copy import HostCopy
from hyperdraft.core.schedule import RequestResult, ScheduledBatch
from hyperdraft.request import Request, same_requests
from hyperdraft.runner.graph_runner import GraphShape
from hyperdraft.runner.model_runner import ModelRunner
from hyperdraft.sample.batch_cache import SamplingBatchCache
from hyperdraft.sample.logits_ops import SamplingBatch
from hyperdraft.sample.sampler import SampledTokens, Sampler


@dataclass
class AheadDecode:
    """A decode step queued before its requests were known for sure."""

    reqs: list[Request]
    sampling: SamplingBatch  # its rows' parameters, positions one past the step that queued it
    sampled: SampledTokens  # [B] each


class ModelWorker:
    decode_reserve = 1  # K/V room a decode needs past its tokens

    def __init__(self, runner: ModelRunner, decode_ahead: bool = True):
        self.runner = runner
        self.decode_ahead = decode_ahead  # RuntimeOptions.decode_ahead
        self.sampler = Sampler()
        self.sampling = SamplingBatchCache(runner.config.vocab_size, runner.device)
        self.ahead: AheadDecode | None = None
        self.ahead_used = 0  # steps served by a queued decode, and queued decodes thrown away (tests, benchmarks)
        self.ahead_discarded = 0

    def run(self, batch: ScheduledBatch) -> list[RequestResult]:
        items = batch.items
        reqs = [it.req for it in items]
        decoding = all(it.is_decode for it in items)
        ahead, self.ahead = self.ahead, None
        if ahead is not None and decoding and same_requests(reqs, ahead.reqs):
            self.ahead_used += 1
            sb, sampled = ahead.sampling, ahead.sampled
        else:
            self.ahead_discarded += ahead is not None
            mode = ForwardMode.DECODE if decoding else ForwardMode.EXTEND
            fb = build_forward_batch(mode, [it.forward_input() for it in items], self.runner.page_table,
                                     self.runner.device)
            out = self.runner.forward(fb)
            sampling = [it.req for it in items if it.samples]
            if not sampling:
                return [RequestResult(num_committed=it.num_tokens) for it in items]
            sb = self.sampling.get(sampling)
            sampled = self.sampler.sample(out.logits, sb)
        copy = HostCopy(sampled)  # the step's one device-to-host copy, queued
        if decoding:  # the next step's decode runs while the host commits this one
            self._decode_ahead(reqs, sb, sampled.tokens)
        host = copy.wait()
        by_item = zip(host.tokens, host.logprobs)
        return [RequestResult(it.num_tokens, *_one(next(by_item))) if it.samples else RequestResult(it.num_tokens)
                for it in items]

    def capture_graphs(self, sizes: list[int]) -> None:
        """One-token decodes at every captured batch size."""
        self.runner.graphs.capture({GraphShape(1, 0): sizes}, ForwardMode.DECODE)

    def _decode_ahead(self, reqs: list[Request], sb: SamplingBatch, tokens: torch.Tensor) -> None:
        """Queue the decode of every request's next token (tokens [B], just sampled) when a graph runs it. Called
        before the scheduler commits this step: req.num_computed is still n, so the next step feeds index n + 1."""
        graphs, page_table = self.runner.graphs, self.runner.page_table
        if (not self.decode_ahead or graphs is None or not graphs.fits(GraphShape(1, 0), len(reqs))
                or sb.penalties is not None):
            return
        if not page_table.reserve_ahead([r.row for r in reqs], [r.num_computed + 2 for r in reqs]):
            return  # the pool is dry: the next schedule decides who keeps running
        inputs = [ForwardInput(r.row, r.num_computed + 1, [0], 1) for r in reqs]
        out = self.runner.forward(build_forward_batch(ForwardMode.DECODE, inputs, page_table, self.runner.device,
                                                      input_ids=tokens))
        next_sb = replace(sb, positions=sb.positions + 1)
        self.ahead = AheadDecode(list(reqs), next_sb, self.sampler.sample(out.logits, next_sb))


def _one(token_logprob: tuple[float, float]) -> tuple[list[int], list[float]]:
    return [int(token_logprob[0])], [token_logprob[1]]
