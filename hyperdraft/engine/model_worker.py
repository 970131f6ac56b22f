"""ModelWorker: one plain (non-speculative) step: forward the batch, sample one token per sampling request."""

from __future__ import annotations

import torch

from hyperdraft.engine.forward_batch import ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.engine.model_runner import ModelRunner
from hyperdraft.engine.scheduler import RequestResult, ScheduledBatch, ScheduledRequest
from hyperdraft.sample.batch_cache import SamplingBatchCache
from hyperdraft.sample.sampler import Sampler


def forward_input(item: ScheduledRequest) -> ForwardInput:
    req = item.req
    tokens = req.token_ids(req.num_computed, req.num_computed + item.num_tokens)
    return ForwardInput(req.row, req.num_computed, tokens, num_logits=1 if item.samples else 0)


def results_to_host(pieces: list[torch.Tensor]) -> list[float]:
    """The step's one device-to-host copy: every piece flattened into one float64 list (exact for token ids)."""
    return ResultsCopy(pieces).wait()


class ResultsCopy:
    """results_to_host in two halves: the copy is queued now (into pinned memory, with an event after it) and waited
    for in wait(), so the host can queue more GPU work first (the next round's draft) without that work delaying
    the results: the host wakes when the copy lands, not when the stream drains."""

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


class ModelWorker:
    decode_reserve = 1

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.sampler = Sampler()
        self.sampling = SamplingBatchCache(runner.config.vocab_size, runner.device)

    def run(self, batch: ScheduledBatch) -> list[RequestResult]:
        items = batch.items
        mode = ForwardMode.DECODE if all(it.is_decode for it in items) else ForwardMode.EXTEND
        fb = build_forward_batch(mode, [forward_input(it) for it in items], self.runner.page_table, self.runner.device)
        out = self.runner.forward(fb)
        sampling = [it.req for it in items if it.samples]
        if not sampling:
            return [RequestResult(num_committed=it.num_tokens) for it in items]
        tokens, logprobs = self.sampler.sample(out.logits, self.sampling.get(sampling))
        host = results_to_host([tokens, logprobs])
        n = len(sampling)
        by_item = zip(host[:n], host[n:])
        return [RequestResult(it.num_tokens, *_one(next(by_item))) if it.samples else RequestResult(it.num_tokens)
                for it in items]


def _one(token_logprob: tuple[float, float]) -> tuple[list[int], list[float]]:
    return [int(token_logprob[0])], [token_logprob[1]]
