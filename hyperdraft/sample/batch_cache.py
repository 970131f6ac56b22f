"""SamplingBatchCache: a running batch's SamplingBatch, built once per batch composition.

A request's sampling parameters, seed and penalty weights never change, and consecutive decode steps usually run
the same requests in the same order. So the per-request tensors are built (from Python lists, two copies) only when
the list of requests changes; a step over the same requests sends one copy: the positions and, for penalised
batches, the flat indices of the output tokens appended since the previous step, which are added to the penalty
counts in place. A changed list keeps each remaining penalised request's count rows (copied on the device), so
only the tokens of requests that joined are read on the host; rows without penalties have no counts at all
(SamplingBatch.build). A SamplingBatch from get() is therefore valid until the next get().
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hyperdraft.core.host_copy import to_device, to_device_many
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
        new = [r.output_ids[c:] if r.params.has_penalties else [] for r, c in zip(reqs, self._counted)]
        flat = to_device(positions + flat_token_index(new, self.vocab_size), torch.int64, self.device)
        pen.add_outputs(flat[len(reqs):])
        self._counted = [len(r.output_ids) for r in reqs]
        self._batch = replace(self._batch, positions=flat[: len(reqs)])
        return self._batch

    def _build(self, reqs: list[Request], positions: list[int]) -> SamplingBatch:
        """A new batch. A penalised request the previous batch held keeps its count rows (copied on the device, then
        its outputs since counted added): rebuilding them walked every prompt and output token of every request in
        Python, ~25 ms + ~38 ms for the list's copy at 256 requests x 2000 tokens, on every join, finish or abort
        (an audit's measurement on this repository's CPU). Only joining requests' tokens are read."""
        self.builds += 1
        penalised = any(r.params.has_penalties for r in reqs)
        carried = self._carried_rows(reqs) if penalised else {}  # new row -> the previous batch's row
        batch = SamplingBatch.build(
            [r.params for r in reqs], [r.seed for r in reqs], positions, self.vocab_size, self.device,
            prompts=[[] if i in carried else r.prompt_ids for i, r in enumerate(reqs)] if penalised else None,
            outputs=[[] if i in carried else r.output_ids for i, r in enumerate(reqs)] if penalised else None)
        if carried:
            new = [r.output_ids[self._counted[carried[i]]:] if i in carried else [] for i, r in enumerate(reqs)]
            rows, old_rows, flat = to_device_many([list(carried), list(carried.values()),
                                                   flat_token_index(new, self.vocab_size)], torch.int64, self.device)
            pen, old = batch.penalties, self._batch.penalties
            pen.output_counts[rows] = old.output_counts[old_rows]  # the carried rows were built empty
            pen.seen[rows] = old.seen[old_rows]
            pen.add_outputs(flat)
        self._reqs, self._batch = list(reqs), batch
        self._counted = [len(r.output_ids) for r in reqs]
        return batch

    def _carried_rows(self, reqs: list[Request]) -> dict[int, int]:
        """{row in reqs: its row in the previous batch} for the penalised requests whose counts that batch holds."""
        if self._batch is None or self._batch.penalties is None:
            return {}
        before = {id(r): i for i, r in enumerate(self._reqs)}
        return {i: before[id(r)] for i, r in enumerate(reqs) if r.params.has_penalties and id(r) in before}

