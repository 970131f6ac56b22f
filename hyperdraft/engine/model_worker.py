"""ModelWorker: one plain (non-speculative) step: forward the batch, sample one token per sampling request."""

from __future__ import annotations

import torch

from hyperdraft.engine.forward_batch import ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.engine.model_runner import ModelRunner
from hyperdraft.engine.scheduler import RequestResult, ScheduledBatch, ScheduledRequest
from hyperdraft.sample.logits_ops import SamplingBatch
from hyperdraft.sample.sampler import Sampler


def forward_input(item: ScheduledRequest) -> ForwardInput:
    req = item.req
    tokens = req.token_ids(req.num_computed, req.num_computed + item.num_tokens)
    return ForwardInput(req.row, req.num_computed, tokens, num_logits=1 if item.samples else 0)


def sampling_batch(items: list[ScheduledRequest], vocab_size: int, device) -> SamplingBatch:
    """One sampling row per item; each samples the token at sequence index seq_len."""
    reqs = [it.req for it in items]
    return SamplingBatch.build(
        [r.params for r in reqs], [r.seed for r in reqs], [r.seq_len for r in reqs], vocab_size, device,
        prompts=[r.prompt_ids for r in reqs], outputs=[r.output_ids for r in reqs],
    )


class ModelWorker:
    decode_reserve = 1

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.sampler = Sampler()

    def run(self, batch: ScheduledBatch) -> list[RequestResult]:
        mode = ForwardMode.DECODE if all(it.is_decode for it in batch.items) else ForwardMode.EXTEND
        fb = build_forward_batch(mode, [forward_input(it) for it in batch.items], self.runner.page_table, self.runner.device)
        out = self.runner.forward(fb)
        sampling = [it for it in batch.items if it.samples]
        results = [RequestResult(num_committed=it.num_tokens) for it in batch.items]
        if not sampling:
            return results
        sb = sampling_batch(sampling, self.runner.config.vocab_size, self.runner.device)
        tokens, logprobs = self.runner_sample(out.logits, sb)
        by_item = iter(zip(tokens, logprobs))
        for it, res in zip(batch.items, results):
            if it.samples:
                tok, lp = next(by_item)
                res.new_tokens, res.logprobs = [tok], [lp]
        return results

    def runner_sample(self, logits, sb) -> tuple[list[int], list[float]]:
        tokens, logprobs = self.sampler.sample(logits, sb)
        host = torch.cat([tokens.double(), logprobs.double()]).tolist()  # the step's one device-to-host copy
        n = tokens.shape[0]
        return [int(t) for t in host[:n]], host[n:]
