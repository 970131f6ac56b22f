"""Whole draft rounds as CUDA graphs: the catch-up and every draft step of a greedy round in one captured run.

A round's draft (chain_loop.draft_chain, tree_loop.draft_tree) builds its step batches on the device, so the whole
loop is capturable. DraftLoopGraphs captures it for greedy drafts (argmax chains, unpenalised beams) per (tier, batch
size, catch-up width): a round then launches one draft graph instead of one per step, and the host work between
steps (a batch build, a graph launch, the beam's bookkeeping ops) is gone. The graph and the eager path run the
same functions; only `forward` differs (the runner's eager forward under capture, its graph-or-eager dispatch
outside). The round is captured as three segments, launched back to back: the batch plan (a few kernels), the
catch-up forward, then every draft step. A launch call's host time grows with the graph's kernel count and its first
kernel starts only when the call returns, so a short first segment gets the GPU going while the host launches the
rest, and the catch-up runs while the host launches the steps (measured on an H100: ~0.5 ms of GPU idle per round
with one graph; a segment per draft step instead costs ~5 us of GPU idle at each boundary).

Drafts drawn from q, or penalised, run step by step (each forward may still replay a per-step graph): their
sampling transform has host-chosen branches (top-k, top-p, ...) that would multiply the graphs.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from hyperdraft.core.forward_batch import ForwardBatch
from hyperdraft.runner.capture import capture_segments, reset_graphs
from hyperdraft.speculative.drafting.chain import choose_argmax, draft_chain
from hyperdraft.speculative.drafting.anchor import PACKED_FIELDS, CatchUpRows, unpack_round
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.speculative.drafting.tree import draft_tree

logger = logging.getLogger("hyperdraft")


class DraftLoopGraphs:
    """Greedy draft rounds, one captured graph per (tier, padded batch size, catch-up width). The widths captured for
    a batch size are 1 (the common round after a rejection: the same shapes as the eager path) and the widest
    catch-up its tiers can leave. The only input is one packed int64 buffer per width (CatchUpRows.packed), filled
    by ONE host-to-device copy: the graph builds the catch-up batch from it (unpack_round) and gathers the
    head's hidden inputs itself (catch_up_hidden). The outputs are static buffers valid until the next replay: a
    chain's draft tokens [bs, steps]; a tree's (tokens, parents, fed), each [bs, N]."""

    def __init__(self, runner, feeds_hidden: bool, catch_up_hidden):
        """runner: the drafter's runner, with graphs (whose memory pool these graphs share)."""
        self.runner, self.page_table, self.feeds_hidden = runner, runner.page_table, feeds_hidden
        self.emulate = runner.graphs.emulate
        self.catch_up_hidden = catch_up_hidden  # (rows [bs], width) -> [bs * width, H] hidden inputs, or None
        self.max_seq_len = self.page_table.max_pages_per_row * self.page_table.page_size
        self.widths: dict[Tier, dict[int, list[int]]] = {}  # tier -> {batch size: catch-up widths, ascending}
        self.packed: dict[int, torch.Tensor] = {}  # width -> [largest batch size, PACKED_FIELDS + width] int64
        self.graphs: dict[tuple[Tier, int, int], list] = {}  # (tier, batch size, width) -> graph segments
        self.outputs: dict[tuple[Tier, int, int], tuple[torch.Tensor, ...] | None] = {}
        self.replays: Counter[tuple[Tier, int, int]] = Counter()
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
        for tier, by_size in sorted(self.widths.items()):
            for bs in sorted(by_size, reverse=True):  # largest first: smaller ones reuse its memory
                for width in by_size[bs]:
                    self._capture_one(tier, bs, width)
        if not self.emulate:
            torch.cuda.synchronize(device)
            self.capture_bytes += torch.cuda.memory_reserved(device) - reserved_before
        self.capture_seconds += time.perf_counter() - start
        logger.info("%s draft loops of %s: %d captured in %.1f s, %.1f MiB", "emulated" if self.emulate else "CUDA",
                    type(self.runner.model).__name__, len(self.outputs), self.capture_seconds, self.capture_bytes / 2**20)

    def _loop(self, tier: Tier, bs: int, width: int, starts: list[int] | None, base_host: list[int] | None,
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

        fb, anchor = unpack_round(self.packed[width][:bs], self.page_table, self.max_seq_len, starts or [0] * bs,
                                  base_host, tier.steps - 1, tier.topk)
        fb.input_hidden = self.catch_up_hidden(fb.req_rows, width)
        if cut is not None:  # a few-kernel first segment: the GPU starts while the host launches the catch-up
            cut()
        first = self.runner.forward_eager(fb)
        if tier.is_tree:
            return tuple(draft_tree(step_forward, fb, first, anchor, tier.steps, tier.topk, tier.num_draft_tokens,
                                    None, self.page_table, self.feeds_hidden))
        tokens, _ = draft_chain(step_forward, fb, first, anchor, tier.steps, choose_argmax, self.page_table,
                                self.feeds_hidden)
        return (tokens,)

    def _capture_one(self, tier: Tier, bs: int, width: int) -> None:
        key = (tier, bs, width)
        if self.emulate:
            self.outputs[key] = None
            return
        self.graphs[key], self.outputs[key] = capture_segments(
            self.runner.graphs.memory_pool(), self.runner.device, lambda cut: self._loop(tier, bs, width, None, None, cut))

    def padded(self, tier: Tier, batch_size: int, max_count: int) -> tuple[int, int] | None:
        """(padded batch size, catch-up width) of the graph that can run this round, or None."""
        by_size = self.widths.get(tier)
        if not by_size:
            return None
        bs = next((b for b in by_size if b >= batch_size), None)
        width = None if bs is None else next((w for w in by_size[bs] if w >= max_count), None)
        return None if width is None else (bs, width)

    def run(self, catch_up: CatchUpRows, tier: Tier, bs: int, width: int) -> tuple[torch.Tensor, ...]:
        """-> the round's outputs (see the class doc), first dimension B = the real requests (counts <= width)."""
        packed = torch.tensor(catch_up.packed(bs, width), dtype=torch.int64, pin_memory=not self.emulate)
        self.packed[width][:bs].view(-1).copy_(packed, non_blocking=True)  # the round's one host-to-device copy
        return self._replay(tier, bs, width, len(catch_up.rows))

    def packed_rows(self, bs: int, width: int) -> torch.Tensor:
        """The [bs, PACKED_FIELDS + width] input block a caller may fill on the device before run_packed."""
        return self.packed[width][:bs]

    def run_packed(self, tier: Tier, bs: int, width: int, real: int) -> tuple[torch.Tensor, ...]:
        """run() for a catch-up already packed on the device into packed_rows(bs, width), padding rows included
        (draft-ahead builds it from a verify's results; no host copy at all); real = the live requests."""
        return self._replay(tier, bs, width, real)

    def _replay(self, tier: Tier, bs: int, width: int, real: int) -> tuple[torch.Tensor, ...]:
        key = (tier, bs, width)
        self.page_table.flush()  # the graph reads the device page table
        self.replays[key] += 1
        if self.emulate:  # the same buffer and padding, run eagerly; the torch backend reads host lists (CPU: no sync)
            starts, counts = self.packed[width][:bs, 1].tolist(), self.packed[width][:bs, 2].tolist()
            fresh = self._loop(tier, bs, width, starts, [s + c for s, c in zip(starts, counts)])
            if self.outputs[key] is None:
                self.outputs[key] = fresh
            else:  # overwritten in place, as a graph does: a consumer keeping a view is caught
                for dst, src in zip(self.outputs[key], fresh):
                    dst.copy_(src)
        else:
            for segment in self.graphs[key]:
                segment.replay()
        return tuple(out[:real] for out in self.outputs[key])
