"""SamplingBatchCache: a running batch's SamplingBatch, built once per batch composition.

A request's sampling parameters, seed and penalty weights never change, and consecutive decode steps usually run
the same requests in the same order. So the per-request tensors are built (from Python lists, two copies) only when
the list of requests changes; a step over the same requests sends one copy: the positions and, for penalised
batches, the flat indices of the output tokens appended since the previous step, which are added to the penalty
counts in place. A SamplingBatch from get() is therefore valid until the next get().
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hyperdraft.core.host_copy import to_device
from hyperdraft.request import Request, same_requests
from hyperdraft.sample.logits_ops import SamplingBatch, flat_token_index


class SamplingBatchCache:
    def __init__(self, vocab_size: int, device):
        self.vocab_size, self.device = vocab_size, device
        self._reqs: list[Request] = []
        self._batch: SamplingBatch | None = None
        self._counted: list[int] = []  # output tokens already in the penalty counts, per request
        self.builds = 0  # full builds so far (tests, benchmarks)

    def get(self, reqs: list[Request]) -> SamplingBatch:
        """One sampling row per request; each samples the token at sequence index seq_len."""
        positions = [r.seq_len for r in reqs]
        if self._batch is None or not same_requests(self._reqs, reqs):
            return self._build(reqs, positions)
        pen = self._batch.penalties
        if pen is None:
            self._batch = replace(self._batch, positions=to_device(positions, torch.int64, self.device))
            return self._batch
        new = [r.output_ids[c:] for r, c in zip(reqs, self._counted)]
        flat = to_device(positions + flat_token_index(new, self.vocab_size), torch.int64, self.device)
        pen.add_outputs(flat[len(reqs):])
        self._counted = [len(r.output_ids) for r in reqs]
        self._batch = replace(self._batch, positions=flat[: len(reqs)])
        return self._batch

    def _build(self, reqs: list[Request], positions: list[int]) -> SamplingBatch:
        self.builds += 1
        self._reqs = list(reqs)
        self._counted = [len(r.output_ids) for r in reqs]
        penalised = any(r.params.has_penalties for r in reqs)
        self._batch = SamplingBatch.build(
            [r.params for r in reqs], [r.seed for r in reqs], positions, self.vocab_size, self.device,
            prompts=[r.prompt_ids for r in reqs] if penalised else None,
            outputs=[r.output_ids for r in reqs] if penalised else None)
        return self._batch

