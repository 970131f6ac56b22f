"""Whole draft rounds as CUDA graphs: the catch-up and every draft step of a round in one captured run.

A round's draft (chain_loop.draft_chain, tree_loop.draft_tree) builds its step batches on the device, so the whole
loop is capturable. DraftLoopGraphs captures it per RoundKey (tier, batch size, catch-up width, sampling key): a
round then launches one draft graph instead of one per step, and the host work between steps (a batch build, a
graph launch, the beam's bookkeeping and sampling ops) is gone. The graph and the eager path run the same functions;
only `forward` differs (the runner's eager forward under capture, its graph-or-eager dispatch outside). The round is
captured as three segments, launched back to back: the batch plan (a few kernels), the catch-up forward, then every
draft step. A launch call's host time grows with the graph's kernel count and its first kernel starts only when the
call returns, so a short first segment gets the GPU going while the host launches the rest, and the catch-up runs
while the host launches the steps (measured on an H100: ~0.5 ms of GPU idle per round with one graph; a segment per
draft step instead costs ~5 us of GPU idle at each boundary).

Greedy, unpenalised rounds (argmax chains, top-k beams) read no sampling row and are captured up front. Rounds whose
drafts are drawn from q, or penalised, read the batch's sampling rows, and which ops they run is chosen by host
values alone (choice.SamplingKey: drawn, penalised, and a draw's sampling flags): a graph per key, so each is
captured on the first round that needs it, after that round's inputs are loaded (the capture's two eager warm-up runs
then write exactly the draft K/V its replay writes), bounded in number and in output memory (a drawn round's graph
holds its q, [B, steps or nodes, V] float32). The rows (parameters, seeds, positions, penalty tables) are copied into
RoundSampling's static tensors before each replay, so the graph draws what the step-by-step round draws: the
uniforms are counter-based, keyed by seed and position, so no generator state is captured.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import NamedTuple

import torch

from hyperdraft.core.forward_batch import ForwardBatch
from hyperdraft.runner.capture import capture_segments, reset_graphs
from hyperdraft.sample.logits_ops import SamplingBatch
from hyperdraft.speculative.drafting.chain import choose_argmax, draft_chain
from hyperdraft.speculative.drafting.anchor import PACKED_FIELDS, CatchUpRows, unpack_round
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.speculative.drafting.choice import SamplingKey, chain_chooser, tree_distribution
from hyperdraft.speculative.drafting.round_sampling import RoundSampling
from hyperdraft.speculative.drafting.tree import draft_tree

logger = logging.getLogger("hyperdraft")

# Graphs of rounds that read sampling rows, captured on first use: at most this many, holding at most this much output
# (a drawn round's q). Fixed budgets, not the device's free memory: under tensor parallelism every rank must decide the
# same (a capture runs collectives), and free memory differs between ranks. They come out of the memory the K/V
# budget leaves free (mem_fraction_static).
MAX_SAMPLING_GRAPHS = 32
MAX_SAMPLING_OUTPUT_BYTES = 512 << 20


class RoundKey(NamedTuple):
    """One whole-round graph: the tier, the padded batch size, the catch-up width, and for drafts drawn from q or
    penalised the SamplingKey that picks their sampling ops (None: greedy, unpenalised)."""

    tier: Tier
    batch_size: int
    width: int
    sampling: SamplingKey | None = None


class DraftLoopGraphs:
    """Draft rounds, one captured graph per RoundKey. The widths captured for a batch size are 1 (the common round
    after a rejection: the same shapes as the eager path) and the widest catch-up its tiers can leave. The input is
    one packed int64 buffer per width (CatchUpRows.packed), filled by ONE host-to-device copy: the graph builds the
    catch-up batch from it (unpack_round) and gathers the head's hidden inputs itself (catch_up_hidden); a round
    with a SamplingKey also reads RoundSampling. The outputs are static buffers valid until the next replay: a
    chain's draft tokens [bs, steps] (and, drawn for rejection sampling, their q [bs, steps, V]); a tree's (tokens,
    parents, fed), each [bs, N] (and, drawn, q_nodes [bs, N, V])."""

    def __init__(self, runner, feeds_hidden: bool, catch_up_hidden, sampling_rounds: bool):
        """runner: the drafter's runner, with graphs (whose memory pool these graphs share); sampling_rounds: capture
        graphs of rounds drawn from q or penalised too (RuntimeOptions.sampling_round_graphs)."""
        self.runner, self.page_table, self.feeds_hidden = runner, runner.page_table, feeds_hidden
        self.sampling_rounds = sampling_rounds
        self.emulate = runner.graphs.emulate
        self.catch_up_hidden = catch_up_hidden  # (rows [bs], width) -> [bs * width, H] hidden inputs, or None
        self.max_seq_len = self.page_table.max_pages_per_row * self.page_table.page_size
        self.widths: dict[Tier, dict[int, list[int]]] = {}  # tier -> {batch size: catch-up widths, ascending}
        self.packed: dict[int, torch.Tensor] = {}  # width -> [largest batch size, PACKED_FIELDS + width] int64
        self.graphs: dict[RoundKey, list] = {}  # graph segments
        self.outputs: dict[RoundKey, tuple[torch.Tensor, ...] | None] = {}  # None: emulated, not run yet
        self.replays: Counter[RoundKey] = Counter()
        self.sampling: RoundSampling | None = None  # sampling rounds' rows, sized at capture()
        self.sampling_output_bytes = 0
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    @property
    def num_replays(self) -> int:
        return sum(self.replays.values())

    def release(self) -> None:
        """Destroy every round graph (GraphRunner.release says why); later rounds run step by step."""
        reset_graphs(self.graphs)
        self.outputs.clear()
        self.widths.clear()
        self.sampling_output_bytes = 0

    def capture(self, plan: dict[Tier, dict[int, int]]) -> None:
        """plan: tier -> {batch size: widest catch-up}."""
        start = time.perf_counter()
        device = self.runner.device
        reserved_before = torch.cuda.memory_reserved(device) if not self.emulate else 0
        for tier, widths in sorted(plan.items()):
            self.widths[tier] = {bs: sorted({1, widest}) for bs, widest in sorted(widths.items())}
            for bs, ws in self.widths[tier].items():
                for w in ws:
                    if w not in self.packed or bs > self.packed[w].shape[0]:
                        self.packed[w] = torch.tensor(CatchUpRows([], [], []).packed(bs, w), dtype=torch.int64,
                                                      device=device).view(bs, PACKED_FIELDS + w)
        largest = max((bs for by_size in self.widths.values() for bs in by_size), default=0)
        if self.sampling is None or self.sampling.size < largest:
            self.sampling = RoundSampling(largest, device)
        for tier, by_size in sorted(self.widths.items()):
            for bs in sorted(by_size, reverse=True):  # largest first: smaller ones reuse its memory
                for width in by_size[bs]:
                    self._capture_one(RoundKey(tier, bs, width))
        if not self.emulate:
            torch.cuda.synchronize(device)
            self.capture_bytes += torch.cuda.memory_reserved(device) - reserved_before
        self.capture_seconds += time.perf_counter() - start
        logger.info("%s draft loops of %s: %d captured in %.1f s, %.1f MiB", "emulated" if self.emulate else "CUDA",
                    type(self.runner.model).__name__, len(self.outputs), self.capture_seconds, self.capture_bytes / 2**20)

    def _loop(self, key: RoundKey, starts: list[int] | None, base_host: list[int] | None,
              cut=None) -> tuple[torch.Tensor, ...]:
        """The round on the packed buffer, eagerly; cut() (under capture) starts a new graph segment before the
        catch-up forward and before the first draft step. starts / base_host: host copies for backends that read
        host lists (None under capture)."""
        first_step = True

        def step_forward(step_fb: ForwardBatch):
            nonlocal first_step
            if cut is not None and first_step:
                cut()
            first_step = False
            return self.runner.forward_eager(step_fb)

        tier, bs, width, sampling_key = key
        fb, anchor = unpack_round(self.packed[width][:bs], self.page_table, self.max_seq_len, starts or [0] * bs,
                                  base_host, max(tier.steps - 1, 0), tier.topk)
        fb.input_hidden = self.catch_up_hidden(fb.req_rows, width)
        if cut is not None:  # a few-kernel first segment: the GPU starts while the host launches the catch-up
            cut()
        first = self.runner.forward_eager(fb)
        if sampling_key is None:  # greedy, unpenalised: argmax chains, top-k beams straight from the logits
            distribution, streams, choose = None, None, choose_argmax
        else:
            rows, drawn = self.sampling.batch(bs, sampling_key), sampling_key.drawn
            distribution = tree_distribution(rows, drawn, tier.topk)
            streams = (rows.seeds, rows.positions) if drawn else None
            choose = chain_chooser(rows, drawn, sampling_key.coupled)
        if tier.is_tree:
            return tuple(draft_tree(step_forward, fb, first, anchor, tier.steps, tier.topk, tier.num_draft_tokens,
                                    distribution, self.page_table, self.feeds_hidden, streams))
        tokens, qs = draft_chain(step_forward, fb, first, anchor, tier.steps, choose, self.page_table,
                                 self.feeds_hidden)
        return (tokens, torch.stack(qs, 1)) if qs else (tokens,)

    def _capture_one(self, key: RoundKey) -> None:
        if self.emulate:
            self.outputs[key] = None
            return
        segmented = self.runner.graphs.settings.segments  # RuntimeOptions.graph_segments off: one graph a round
        self.graphs[key], self.outputs[key] = capture_segments(
            self.runner.graphs.memory_pool(), self.runner.device,
            lambda cut: self._loop(key, None, None, cut if segmented else None))

    def padded(self, tier: Tier, batch_size: int, max_count: int,
               sampling: SamplingKey | None = None) -> tuple[int, int] | None:
        """(padded batch size, catch-up width) of the graph that can run this round, or None. A graph with a sampling
        key may not exist yet: then there must be room to capture it (MAX_SAMPLING_GRAPHS,
        MAX_SAMPLING_OUTPUT_BYTES)."""
        by_size = self.widths.get(tier)
        if not by_size:
            return None
        bs = next((b for b in by_size if b >= batch_size), None)
        width = None if bs is None else next((w for w in by_size[bs] if w >= max_count), None)
        if width is None:
            return None
        if sampling is not None and not self.sampling_rounds:
            return None
        if sampling is not None and RoundKey(tier, bs, width, sampling) not in self.outputs:
            captured = sum(k.sampling is not None for k in self.outputs)
            if captured >= MAX_SAMPLING_GRAPHS or self.sampling_output_bytes >= MAX_SAMPLING_OUTPUT_BYTES:
                return None
        return bs, width

    def run(self, catch_up: CatchUpRows, key: RoundKey, sampling: SamplingBatch) -> tuple[torch.Tensor, ...]:
        """-> the round's outputs (see the class doc), first dimension B = the real requests (counts <= width).
        key: a greedy graph, or one with a sampling key (captured now if it is new: padded() said there is room)."""
        bs, width = key.batch_size, key.width
        packed = torch.tensor(catch_up.packed(bs, width), dtype=torch.int64, pin_memory=not self.emulate)
        self.packed[width][:bs].view(-1).copy_(packed, non_blocking=True)  # the round's one host-to-device copy
        if key.sampling is not None:
            self.sampling.load(sampling)
            if key not in self.outputs:
                self._capture_sampling(key)
        return self._replay(key, len(catch_up.rows))

    def _capture_sampling(self, key: RoundKey) -> None:
        """Capture a sampling round's graph with this round's inputs already loaded (the module doc says why)."""
        start = time.perf_counter()
        self.page_table.flush()  # the warm-up runs read the device page table, as the replay will
        self._capture_one(key)
        outputs = self.outputs[key] or ()
        self.sampling_output_bytes += sum(t.numel() * t.element_size() for t in outputs)
        self.capture_seconds += time.perf_counter() - start
        logger.info("draft round graph for sampling rows captured: %s, %.0f ms", key,
                    1e3 * (time.perf_counter() - start))

    def has(self, key: RoundKey) -> bool:
        """Whether this round's graph exists (one with a sampling key is captured on first use)."""
        return key in self.outputs

    def packed_rows(self, bs: int, width: int) -> torch.Tensor:
        """The [bs, PACKED_FIELDS + width] input block a caller may fill on the device before run_packed."""
        return self.packed[width][:bs]

    def run_packed(self, key: RoundKey, real: int) -> tuple[torch.Tensor, ...]:
        """run() for a catch-up already packed on the device into packed_rows(bs, width), padding rows included
        (draft-ahead builds it from a verify's results; no host copy at all); real = the live requests."""
        return self._replay(key, real)

    def _replay(self, key: RoundKey, real: int) -> tuple[torch.Tensor, ...]:
        width = key.width
        self.page_table.flush()  # the graph reads the device page table
        self.replays[key] += 1
        if self.emulate:  # the same buffer and padding, run eagerly; the torch backend reads host lists (CPU: no sync)
            rows = self.packed[width][:key.batch_size]
            starts, counts = rows[:, 1].tolist(), rows[:, 2].tolist()
            fresh = self._loop(key, starts, [s + c for s, c in zip(starts, counts)])
            if self.outputs[key] is None:
                self.outputs[key] = fresh
            else:  # overwritten in place, as a graph does: a consumer keeping a view is caught
                for dst, src in zip(self.outputs[key], fresh):
                    dst.copy_(src)
        else:
            for segment in self.graphs[key]:
                segment.replay()
        return tuple(out[:real] for out in self.outputs[key])
