"""ModelWorker: one plain (non-speculative) step: forward the batch, sample one token per sampling request.

Decode-ahead: with CUDA graphs, a step whose batch is all decodes queues the NEXT step's decode (its input tokens are
this step's sampled tokens, still on the device; positions one further, penalty counts with those tokens added on
the device) before waiting for this step's results copy.
The GPU then decodes while the host commits and schedules. The next step takes the queued tokens when its batch is
the same requests (nothing finished, joined, was aborted or retracted) and throws them away otherwise: harmless, as
the queued forward wrote only the K/V of each request's next token (what the real step would write, or into a
finished request's released slots before their next owner writes them: one stream), and its row's slot for that
token was reserved when it was queued. RuntimeOptions.decode_ahead (HYPERDRAFT_DECODE_AHEAD=0) turns it off.

A hybrid model's recurrent state advances in place, so a thrown-away decode would not be harmless there: a queued
decode instead writes its requests' new states to the other of two locations (the slot, or scratch entry 0), and
reads the one that holds them now. state_at (host bookkeeping, no sync) says where each row's state is: a queued
decode that is used moves it there; one that is thrown away leaves it, the location it wrote being the spare one. A
decode scheduled normally reads state_at and writes the slot, so every other step finds states in their slots.

A speculative engine runs its step-0 batches through this worker too (speculative/worker.py). A drafter that must
see every token (an EAGLE head) gives it a DecodeSink: every decode, queued ahead or not, captures the layers the
sink names and hands it the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperdraft.core.forward_batch import ForwardBatch, ForwardMode, build_forward_batch
from hyperdraft.core.host_copy import HostCopy, to_device
from hyperdraft.core.schedule import RequestResult, ScheduledBatch
from hyperdraft.request import Request, same_requests
from hyperdraft.runner.graph_runner import GraphShape
from hyperdraft.runner.model_runner import DecodeSink, ForwardOutput, ModelRunner
from hyperdraft.runner.next_token import moved_next_token_batch, moves_on, next_token_batch
from hyperdraft.runner.prompt_tails import padded_tails, tail_shapes
from hyperdraft.sample.batch_cache import SamplingBatchCache
from hyperdraft.sample.logits_ops import SamplingBatch
from hyperdraft.sample.sampler import SampledTokens, Sampler, sampled_rows


@dataclass
class AheadDecode:
    """A decode step queued before its requests were known for sure."""

    reqs: list[Request]
    sampling: SamplingBatch  # its rows' parameters, positions one past the step that queued it
    sampled: SampledTokens  # [B] each
    state_targets: list[int]  # hybrid models: where each request's state went (-1 the slot, 0 scratch entry 0)
    batch: ForwardBatch  # what it fed: the decode queued after it moves this on (runner/next_token.py)


class ModelWorker:
    decode_reserve = 1  # K/V room a decode needs past its tokens

    def __init__(self, runner: ModelRunner, decode_ahead: bool = True, sink: DecodeSink | None = None,
                 as_rounds: bool = False):
        """as_rounds: its steps stand in for a speculative worker's rounds of no drafts (step 0), and each result says
        so (a verify of 0 drafts, its room kept), built that way rather than rewritten per request after."""
        self.runner = runner
        self.decode_ahead = decode_ahead  # RuntimeOptions.decode_ahead
        self.sink = sink
        self.result_fields = {"num_drafted": 0, "keeps_room": True} if as_rounds else {}
        self.capture_layers = sink.capture_layers if sink is not None else ()
        self.sampler = Sampler()
        self.sampling = SamplingBatchCache(runner.config.vocab_size, runner.device)
        self.ahead: AheadDecode | None = None
        self.ahead_used = 0  # steps served by a queued decode, and queued decodes thrown away (tests, benchmarks)
        self.ahead_discarded = 0
        self.ahead_moved = 0  # queued decodes whose batch was moved on from the step's own on the device
        self.recurrent = runner.state_pool is not None
        self.state_at: dict[int, int] = {}  # hybrid models: row -> scratch entry holding its state (absent: the slot)

    def release_graphs(self) -> None:
        self.ahead = None
        self.runner.release_graphs()

    def discard_ahead(self) -> None:
        """Forget a queued decode: another worker is about to move its requests on (a speculative round after a step
        this worker ran for the speculative one), so it must not serve a later step that finds the same requests."""
        self.ahead_discarded += self.ahead is not None
        self.ahead = None

    def run(self, batch: ScheduledBatch) -> list[RequestResult]:
        items = batch.items
        reqs = [it.req for it in items]
        decoding = not batch.prefills
        assert decoding or self.sink is None, "a sink sees decodes only: the speculative worker runs the rest"
        ahead, self.ahead = self.ahead, None
        if ahead is not None and decoding and same_requests(reqs, ahead.reqs):
            self.ahead_used += 1
            sb, sampled, fed = ahead.sampling, ahead.sampled, ahead.batch
            self._moved_states(reqs, ahead.state_targets)
        else:
            self.ahead_discarded += ahead is not None
            logits, fed = self._forward(batch)
            self._moved_states(reqs, [-1] * len(reqs))
            sampling = [it.req for it in items if it.samples]
            if not sampling:
                return [RequestResult(it.num_tokens, **self.result_fields) for it in items]
            sb = self.sampling.get(sampling)
            sampled = self.sampler.sample(logits, sb)
        copy = HostCopy(sampled)  # the step's one device-to-host copy, queued
        if decoding:  # the next step's decode runs while the host commits this one
            self._decode_ahead(reqs, sb, sampled.tokens, fed)
        host = copy.wait()
        rows = iter(sampled_rows(host))
        fields = self.result_fields
        return [RequestResult(it.num_tokens, *next(rows), **fields) if it.samples
                else RequestResult(it.num_tokens, **fields) for it in items]

    def _forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, ForwardBatch | None]:
        """The step's forward -> (the logits of its sampling items, in item order; the batch it fed when the step is
        all decodes, else None). Decodes with prompt tails beside them that fit captured graphs run as two replays, the
        decodes' and the tails' (runner/prompt_tails.py), not as one eager forward of the whole batch: every prompt
        admitted while others decode would otherwise cost one."""
        items, num_decodes = batch.items, len(batch.decodes)
        inputs = [it.forward_input() for it in items]
        table, device = self.runner.page_table, self.runner.device
        if not batch.prefills:
            fb = build_forward_batch(ForwardMode.DECODE, inputs, table, device, **self._state_walk(batch))
            return self._decode(fb).logits, fb
        tails = None
        graphs = self.runner.graphs
        if num_decodes and graphs is not None and graphs.fits(GraphShape(1, 0), num_decodes):
            tails = padded_tails(graphs, inputs[num_decodes:])
        if tails is None:  # one forward; prompt tails alone padded to a captured width where they fit one
            fb = build_forward_batch(ForwardMode.EXTEND, padded_tails(graphs, inputs) or inputs, table, device,
                                     **self._state_walk(batch))
            return self.runner.forward(fb).logits, None
        decoded = self.runner.forward(build_forward_batch(ForwardMode.DECODE, inputs[:num_decodes], table, device))
        extended = self.runner.forward(build_forward_batch(ForwardMode.EXTEND, tails, table, device))
        return torch.cat([decoded.logits, extended.logits]), None  # each shape's graph writes its own outputs

    def capture_graphs(self, sizes: list[int]) -> None:
        """One-token decodes at every captured batch size; for a dense model also prompt tails (runner/prompt_tails.py:
        a chat turn after a cached history, a short prompt)."""
        graphs = self.runner.graphs
        graphs.capture({GraphShape(1, 0): sizes}, ForwardMode.DECODE)
        if not self.recurrent:
            graphs.capture(tail_shapes(sizes), ForwardMode.EXTEND)

    def _decode_ahead(self, reqs: list[Request], sb: SamplingBatch, tokens: torch.Tensor, fed: ForwardBatch) -> None:
        """Queue the decode of every request's next token (tokens [B], just sampled) when a graph runs it. Called
        before the scheduler commits this step: req.num_computed is still n, so the next step feeds index n + 1. fed:
        this step's decode of the same requests at n, which a dense target's queued decode moves on by one token."""
        graphs, page_table = self.runner.graphs, self.runner.page_table
        if not self.decode_ahead or graphs is None or not graphs.fits(GraphShape(1, 0), len(reqs)):
            return
        parents = [self.state_at.get(r.row, -1) for r in reqs]
        targets = [0 if p < 0 else -1 for p in parents]  # the location the state is not in
        if moves_on(None if self.recurrent else fed, reqs):  # a hybrid target's decode walks its states: packed
            fb = moved_next_token_batch(fed, reqs, tokens, page_table)
            self.ahead_moved += fb is not None
        else:
            walk = self._walk_tensors(parents, targets) if self.recurrent else {}
            fb = next_token_batch(ForwardMode.DECODE, reqs, tokens, page_table, self.runner.device, **walk)
        if fb is None:
            return
        out = self._decode(fb)
        next_sb = sb.at_offset(tokens[:, None])  # one position on; penalties count the token just sampled
        self.ahead = AheadDecode(list(reqs), next_sb, self.sampler.sample(out.logits, next_sb), targets, fb)

    def _decode(self, fb: ForwardBatch) -> ForwardOutput:
        return self.runner.forward(fb, self.capture_layers, self.sink)

    def _state_walk(self, batch: ScheduledBatch) -> dict:
        """build_forward_batch's state arguments for a scheduled step: its leading decodes read their states where
        state_at says and write their slots; nothing when every state is in its slot already."""
        if not self.recurrent or not self.state_at:
            return {}
        decodes = [it.req.row for it in batch.decodes]
        if not any(row in self.state_at for row in decodes):
            return {}
        return self._walk_tensors([self.state_at.get(row, -1) for row in decodes], [-1] * len(decodes))

    def _walk_tensors(self, parents: list[int], targets: list[int]) -> dict:
        walk = to_device(parents + targets, torch.int64, self.runner.device)
        return dict(state_parents=walk[: len(parents)], state_targets=walk[len(parents):],
                    num_spec_requests=len(parents))

    def _moved_states(self, reqs: list[Request], targets: list[int]) -> None:
        if not self.recurrent:
            return
        for req, target in zip(reqs, targets):
            if target < 0:
                self.state_at.pop(req.row, None)
            else:
                self.state_at[req.row] = target

