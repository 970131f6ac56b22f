"""ModelWorker: one plain (non-speculative) step: forward the batch, sample one token per sampling request.

Decode-ahead: with CUDA graphs, a step whose batch is all decodes queues the NEXT step's decode (its input tokens are
this step's sampled tokens, still on the device; positions one further) before waiting for this step's results copy.
The GPU then decodes while the host commits and schedules. The next step takes the queued tokens when its batch is
the same requests (nothing finished, joined, was aborted or retracted) and throws them away otherwise: harmless, as
the queued forward wrote only the K/V of each request's next token (what the real step would write, or into a
finished request's released slots before their next owner writes them: one stream), and its row's slot for that
token was reserved when it was queued. Penalised batches (their counts are updated from host outputs) decode when
scheduled. HYPERDRAFT_DECODE_AHEAD=0 turns it off.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace

import torch

from hyperdraft.core.forward_batch import ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.runner.graph_runner import GraphShape
from hyperdraft.runner.model_runner import ModelRunner
from hyperdraft.engine.scheduler import RequestResult, ScheduledBatch, ScheduledRequest
from hyperdraft.request import Request, same_requests
from hyperdraft.sample.batch_cache import SamplingBatchCache
from hyperdraft.sample.logits_ops import SamplingBatch
from hyperdraft.sample.sampler import Sampler

DECODE_AHEAD_ENV = "HYPERDRAFT_DECODE_AHEAD"  # "0": no decode-ahead (A/B benchmarks, tests)


def forward_input(item: ScheduledRequest) -> ForwardInput:
    req = item.req
    tokens = req.token_ids(req.num_computed, req.num_computed + item.num_tokens)
    return ForwardInput(req.row, req.num_computed, tokens, num_logits=1 if item.samples else 0)


@contextlib.contextmanager
def results_stream(stream: torch.cuda.Stream | None):
    """Queue the enclosed GPU work on `stream` (None: where it is), after everything queued so far on the current
    stream. A step's results tail (logprobs, packing, the copy to the host) needs nothing the next GPU work needs,
    so on its own stream it runs beside the next draft instead of delaying it. The caller keeps every input it
    hands over alive until the results are waited for: the allocator would otherwise reuse their memory for the
    current stream's next work while this stream still reads it."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        yield


class ResultsCopy:
    """The step's one device-to-host copy, in two halves: the pieces (flattened into one float64 list, exact for token
    ids) are queued now, into pinned memory with an event after them, and waited for in wait(). The host can queue
    more GPU work in between (the next decode or draft) without that work delaying the results: it wakes when the
    copy lands, not when the stream drains."""

    def __init__(self, pieces: list[torch.Tensor]):
        self.event = None
        self.host = torch.cat([x.double().flatten() for x in pieces]) if pieces else None
        if self.host is not None and self.host.is_cuda:
            device_values = self.host
            self.host = torch.empty(device_values.shape, dtype=torch.float64, pin_memory=True)
            self.host.copy_(device_values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist() if self.host is not None else []


@dataclass
class AheadDecode:
    """A decode step queued before its requests were known for sure."""

    reqs: list[Request]
    sampling: SamplingBatch  # its rows' parameters, positions one past the step that queued it
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32


class ModelWorker:
    decode_reserve = 1

    def __init__(self, runner: ModelRunner):
        self.runner = runner
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
            sb, tokens, logprobs = ahead.sampling, ahead.tokens, ahead.logprobs
        else:
            self.ahead_discarded += ahead is not None
            mode = ForwardMode.DECODE if decoding else ForwardMode.EXTEND
            fb = build_forward_batch(mode, [forward_input(it) for it in items], self.runner.page_table, self.runner.device)
            out = self.runner.forward(fb)
            sampling = [it.req for it in items if it.samples]
            if not sampling:
                return [RequestResult(num_committed=it.num_tokens) for it in items]
            sb = self.sampling.get(sampling)
            tokens, logprobs = self.sampler.sample(out.logits, sb)
        results_copy = ResultsCopy([tokens, logprobs])  # the step's one device-to-host copy, queued
        if decoding:  # the next step's decode runs while the host commits this one
            self._decode_ahead(reqs, sb, tokens)
        host = results_copy.wait()
        n = len(reqs) if decoding else sum(it.samples for it in items)
        by_item = zip(host[:n], host[n:])
        return [RequestResult(it.num_tokens, *_one(next(by_item))) if it.samples else RequestResult(it.num_tokens)
                for it in items]

    def _decode_ahead(self, reqs: list[Request], sb: SamplingBatch, tokens: torch.Tensor) -> None:
        """Queue the decode of every request's next token (tokens [B], just sampled) when a graph runs it. Called
        before the scheduler commits this step: req.num_computed is still n, so the next step feeds index n + 1."""
        graphs, page_table = self.runner.graphs, self.runner.page_table
        if (graphs is None or not graphs.fits(GraphShape(1, 0), len(reqs)) or sb.penalties is not None
                or os.environ.get(DECODE_AHEAD_ENV, "1") == "0"):
            return
        if not page_table.reserve_ahead([r.row for r in reqs], [r.num_computed + 2 for r in reqs]):
            return  # the pool is dry: the next schedule decides who keeps running
        inputs = [ForwardInput(r.row, r.num_computed + 1, [0], 1) for r in reqs]
        out = self.runner.forward(build_forward_batch(ForwardMode.DECODE, inputs, page_table, self.runner.device,
                                                      input_ids=tokens))
        next_sb = replace(sb, positions=sb.positions + 1)
        self.ahead = AheadDecode(list(reqs), next_sb, *self.sampler.sample(out.logits, next_sb))


def _one(token_logprob: tuple[float, float]) -> tuple[list[int], list[float]]:
    return [int(token_logprob[0])], [token_logprob[1]]
