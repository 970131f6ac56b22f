"""The chain draft of a round: the catch-up, then steps 1 .. K-1, each feeding the token the step before chose.

draft_chain runs it for both drafters (an EAGLE head, a STANDALONE draft model). Its step batches are built on the
device from the catch-up batch (ChainAnchor), so a step costs no host-to-device copy and no host decision; that
makes the whole loop capturable. ChainLoopGraphs captures it, for greedy drafts (argmax, no penalties), as one graph
per (chain length, batch size, catch-up width): a round then launches one draft graph instead of one per step, and
the host work between steps (a batch build and a graph launch each) is gone. The graph and the eager path run the same
draft_chain; only `forward` differs (the runner's eager forward under capture, its graph-or-eager dispatch outside).
The round is captured as one segment per forward, launched back to back: a launch call's host time grows with the
graph's kernel count and its first kernel starts only when the call returns, so a short first segment gets the GPU
going while the host launches the rest (measured on an H100: ~0.5 ms of GPU idle per round with one graph).

Drafts drawn from q, or penalised, run draft_chain step by step (each forward may still replay a per-step graph):
their sampling transform has host-chosen branches (top-k, top-p, ...) that would multiply the graphs.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from hyperdraft.engine.forward_batch import ForwardBatch, ForwardMode
from hyperdraft.engine.graph_runner import capture_segments
from hyperdraft.kernels.argmax import argmax_rows
from hyperdraft.request import Request
from hyperdraft.sample.logits_ops import SamplingBatch
from hyperdraft.spec.draft_choice import choose_draft, draws_from_q
from hyperdraft.spec.proposal import Proposal

logger = logging.getLogger("hyperdraft")
CHAIN_LOOP_GRAPH_ENV = "HYPERDRAFT_CHAIN_LOOP_GRAPH"  # "0": per-step draft graphs only (A/B benchmarks)

# (step j, logits [B, V], draft tokens chosen so far [B, j]) -> (draft token [B], q [B, V] or None when one-hot)
Chooser = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class ChainAnchor:
    """Where the draft steps of each request write, read on the device off the catch-up batch."""

    rows: torch.Tensor  # [B] int64 page-table rows
    base: torch.Tensor  # [B] int64 sequence index (= RoPE position) step 1 writes; step j writes base + j - 1
    live: torch.Tensor  # [B] bool; False for a graph's padding rows, whose K/V then goes to the padding page
    base_host: list[int] | None  # host copy, for backends that read host lists (torch); None inside a graph
    max_seq_len: int  # static bound inside a graph; 0 = from base_host

    @classmethod
    def after(cls, catch_up: ForwardBatch, base_host: list[int] | None, max_seq_len: int = 0) -> "ChainAnchor":
        # The catch-up's logits row of each request is its last real token; step 1 comes right after it. A real
        # token always has a real slot (page 0 is never handed out), a padding row's slots are all 0.
        last = catch_up.logits_indices
        return cls(catch_up.req_rows, catch_up.positions[last] + 1, catch_up.out_slots[last] != 0, base_host,
                   max_seq_len)

    def step_batch(self, j: int, input_ids: torch.Tensor, page_table, input_hidden: torch.Tensor | None) -> ForwardBatch:
        """Step j's one-token-per-request batch (j >= 1), from device tensors only."""
        bsz = self.rows.shape[0]
        index = self.base + (j - 1)
        slots = torch.where(self.live, page_table.token_slots(self.rows, index), 0)
        arange = torch.arange(bsz, dtype=torch.int64, device=index.device)
        prefix = [b + j - 1 for b in self.base_host] if self.base_host is not None else [0] * bsz
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=input_ids, positions=index, out_slots=slots, req_rows=self.rows,
            prefix_lens=prefix, extend_lens=[1] * bsz, logits_indices=arange,
            seq_lens_t=(index + 1).to(torch.int32), extend_starts_t=arange.to(torch.int32),
            extend_lens_t=torch.ones(bsz, dtype=torch.int32, device=index.device), max_extend_len=1,
            max_seq_len=self.max_seq_len or max(prefix, default=0) + 1, input_hidden=input_hidden,
        )


def draft_chain(forward, catch_up: ForwardBatch, first, anchor: ChainAnchor, steps: int, choose: Chooser, page_table,
                feeds_hidden: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """-> (draft tokens [B, steps], the q of each step when drafts are drawn from q).

    first: the catch-up's ForwardOutput, whose logits rows give d_0. forward(fb) -> ForwardOutput runs step j,
    which feeds d_{j-1} (and, for an EAGLE head, feeds_hidden: the head's own output at the step before) and gives
    d_j."""
    logits, hidden = first.logits, first.hidden[catch_up.logits_indices]
    out = first
    tokens = torch.zeros(logits.shape[0], steps, dtype=torch.int64, device=logits.device)
    qs = []
    for j in range(steps):
        if j > 0:
            out = forward(anchor.step_batch(j, tokens[:, j - 1], page_table, hidden if feeds_hidden else None))
            logits, hidden = out.logits, out.hidden
        tokens[:, j], q = choose(j, logits, tokens[:, :j])
        if q is not None:
            qs.append(q)
    return tokens, qs


def choose_argmax(j: int, logits: torch.Tensor, prefix: torch.Tensor) -> tuple[torch.Tensor, None]:
    return argmax_rows(logits), None


@dataclass
class CatchUpRows:
    """A round's catch-up, host side: per request its page-table row, the index of its first fed token, and the
    tokens it feeds (sequence indices start .. start + len - 1; draft step 1 writes the index right after)."""

    rows: list[int]
    starts: list[int]
    tokens: list[list[int]]

    @property
    def step_bases(self) -> list[int]:
        """Host copy of ChainAnchor.base: the index right after each request's last fed token."""
        return [start + len(toks) for start, toks in zip(self.starts, self.tokens)]

    def packed(self, bs: int, width: int) -> list[int]:
        """[bs, PACKED_FIELDS + width] row-major: (row, start, count, live, tokens padded to width); the rows past
        the real ones are padding (row 0, start 0, count width, not live)."""
        out = []
        for row, start, toks in zip(self.rows, self.starts, self.tokens):
            out += [row, start, len(toks), 1, *toks, *[0] * (width - len(toks))]
        return out + [0, 0, width, 0, *[0] * width] * (bs - len(self.rows))


PACKED_FIELDS = 4


def unpack_catch_up(packed: torch.Tensor, page_table, max_seq_len: int, prefix_lens: list[int]) -> ForwardBatch:
    """packed: [bs, PACKED_FIELDS + width] (CatchUpRows.packed) -> the catch-up ForwardBatch, built on the device.
    Every request feeds `width` tokens from its start; logits at its last real one. Padding tokens past a live
    request's real ones write K/V past its last real index (the draft steps overwrite them first; see the
    proposers' catch_up_batch); a padding row writes only to the padding page."""
    bs, width = packed.shape[0], packed.shape[1] - PACKED_FIELDS
    # contiguous: kernels index these [B] tensors with stride 1 (a column view of packed would hand them stride 4+W)
    rows, starts, counts, live = (packed[:, i].contiguous() for i in range(PACKED_FIELDS))
    live = live != 0
    arange = torch.arange(bs, dtype=torch.int64, device=packed.device)
    index = (starts[:, None] + torch.arange(width, device=packed.device)).flatten()
    token_rows = rows.repeat_interleave(width)
    slots = torch.where(live.repeat_interleave(width), page_table.token_slots(token_rows, index), 0)
    return ForwardBatch(
        mode=ForwardMode.DRAFT_EXTEND, input_ids=packed[:, PACKED_FIELDS:].flatten(), positions=index, out_slots=slots,
        req_rows=rows, prefix_lens=prefix_lens, extend_lens=[width] * bs, logits_indices=arange * width + counts - 1,
        seq_lens_t=(starts + width).to(torch.int32), extend_starts_t=(arange * width).to(torch.int32),
        extend_lens_t=torch.full((bs,), width, dtype=torch.int32, device=packed.device), max_extend_len=width,
        max_seq_len=max_seq_len,
    )


class ChainLoopGraphs:
    """Greedy chain drafts, one captured graph per (steps, padded batch size, catch-up width). The widths captured for
    a batch size are 1 (the common round after a rejection: the same shapes as the eager path) and the widest
    catch-up its tiers can leave. The only input is one packed int64 buffer per width (CatchUpRows.packed), filled
    by ONE host-to-device copy: the graph builds the catch-up batch from it (unpack_catch_up) and gathers the
    head's hidden inputs itself (catch_up_hidden). The output is the [bs, steps] draft tokens, a static buffer
    valid until the next replay."""

    def __init__(self, runner, page_table, feeds_hidden: bool, catch_up_hidden, emulate: bool, pool=None):
        self.runner, self.page_table, self.feeds_hidden, self.emulate = runner, page_table, feeds_hidden, emulate
        self.catch_up_hidden = catch_up_hidden  # (rows [bs], width) -> [bs * width, H] hidden inputs, or None
        self.max_seq_len = page_table.max_pages_per_row * page_table.page_size
        self.widths: dict[int, dict[int, list[int]]] = {}  # steps -> {batch size: catch-up widths, ascending}
        self.packed: dict[int, torch.Tensor] = {}  # width -> [largest batch size, PACKED_FIELDS + width] int64
        self.graphs: dict[tuple[int, int, int], object] = {}  # (steps, batch size, width)
        self.outputs: dict[tuple[int, int, int], torch.Tensor | None] = {}
        self.pool = pool
        self.replays: Counter[tuple[int, int, int]] = Counter()
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    @property
    def num_replays(self) -> int:
        return sum(self.replays.values())

    def capture(self, plan: dict[int, dict[int, int]]) -> None:
        """plan: steps -> {batch size: widest catch-up}."""
        start = time.perf_counter()
        device = self.runner.device
        reserved_before = torch.cuda.memory_reserved(device) if not self.emulate else 0
        for steps, widths in sorted(plan.items()):
            self.widths[steps] = {bs: sorted({1, widest}) for bs, widest in sorted(widths.items())}
            for bs, ws in self.widths[steps].items():
                for w in ws:
                    rows = max(bs, self.packed[w].shape[0] if w in self.packed else 0)
                    if w not in self.packed or rows > self.packed[w].shape[0]:
                        self.packed[w] = torch.tensor(CatchUpRows([], [], []).packed(rows, w), dtype=torch.int64,
                                                      device=device).view(rows, PACKED_FIELDS + w)
        for steps, by_size in sorted(self.widths.items()):
            for bs in sorted(by_size, reverse=True):  # largest first: smaller ones reuse its memory
                for width in by_size[bs]:
                    self._capture_one(steps, bs, width)
        if not self.emulate:
            torch.cuda.synchronize(device)
            self.capture_bytes += torch.cuda.memory_reserved(device) - reserved_before
        self.capture_seconds += time.perf_counter() - start
        logger.info("%s chain draft loops of %s: %d captured in %.1f s, %.1f MiB", "emulated" if self.emulate else "CUDA",
                    type(self.runner.model).__name__, len(self.outputs), self.capture_seconds, self.capture_bytes / 2**20)

    def _loop(self, bs: int, width: int, steps: int, starts: list[int] | None, base_host: list[int] | None,
              cut=None) -> torch.Tensor:
        """The round on the packed buffer, eagerly; cut() (under capture) starts a new graph segment before every
        draft step. starts / base_host: host copies for backends that read host lists (None under capture)."""
        def step_forward(step_fb: ForwardBatch):
            if cut is not None:
                cut()
            return self.runner.forward_eager(step_fb)

        fb = unpack_catch_up(self.packed[width][:bs], self.page_table, self.max_seq_len, starts or [0] * bs)
        fb.input_hidden = self.catch_up_hidden(fb.req_rows, width)
        anchor = ChainAnchor.after(fb, base_host, 0 if base_host is not None else self.max_seq_len)
        if cut is not None:  # a few-kernel first segment: the GPU starts while the host launches the catch-up
            cut()
        tokens, _ = draft_chain(step_forward, fb, self.runner.forward_eager(fb), anchor, steps, choose_argmax,
                                self.page_table, self.feeds_hidden)
        return tokens

    def _capture_one(self, steps: int, bs: int, width: int) -> None:
        key = (steps, bs, width)
        if self.emulate:
            self.outputs[key] = None
            return
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self.graphs[key], self.outputs[key] = capture_segments(
            self.pool, self.runner.device, lambda cut: self._loop(bs, width, steps, None, None, cut))

    def padded(self, steps: int, batch_size: int, max_count: int) -> tuple[int, int] | None:
        """(padded batch size, catch-up width) of the graph that can run this round, or None."""
        by_size = self.widths.get(steps)
        if not by_size:
            return None
        bs = next((b for b in by_size if b >= batch_size), None)
        width = None if bs is None else next((w for w in by_size[bs] if w >= max_count), None)
        return None if width is None else (bs, width)

    def run(self, catch_up: CatchUpRows, steps: int, bs: int, width: int) -> torch.Tensor:
        """-> draft tokens [B, steps] of the round whose catch-up is `catch_up` (B requests, counts <= width)."""
        real, key = len(catch_up.rows), (steps, bs, width)
        packed = torch.tensor(catch_up.packed(bs, width), dtype=torch.int64, pin_memory=not self.emulate)
        self.packed[width][:bs].view(-1).copy_(packed, non_blocking=True)  # the round's one host-to-device copy
        self.page_table.flush()  # the graph reads the device page table
        self.replays[key] += 1
        if self.emulate:  # the same buffer and padding, run eagerly (padding rows: positions 0 .. -> base 1 + ...)
            starts = catch_up.starts + [0] * (bs - real)
            fresh = self._loop(bs, width, steps, starts, catch_up.step_bases + [width] * (bs - real))
            if self.outputs[key] is None:
                self.outputs[key] = fresh
            else:  # overwritten in place, as a graph does: a consumer keeping a view is caught
                self.outputs[key].copy_(fresh)
        else:
            for segment in self.graphs[key]:
                segment.replay()
        return self.outputs[key][:real]


class ChainDrafting:
    """propose() for a drafter whose chains run through draft_chain: one graph for the round when a greedy round
    fits one (chain_loop), else the catch-up and each step through the runner's own dispatch.

    A drafter gives: runner, sample_drafts, feeds_hidden, and
      catch_up_tokens(req)        the tokens its catch-up feeds, from index req.draft_num_computed on (>= 1);
                                  draft step 1 writes the index right after the last of them
      catch_up_batch(reqs, tokens, width)   the catch-up ForwardBatch, ragged (width None) or padded to width
      catch_up_hidden(rows, width)          the padded catch-up's hidden inputs [B * width, H], or None
      caught_up(reqs)             record what the catch-up fed"""

    chain_loop: ChainLoopGraphs | None = None
    timer = None  # a PhaseTimer, set by the SpecWorker

    def propose(self, reqs: list[Request], steps: int, sampling: SamplingBatch) -> Proposal:
        sampled = draws_from_q(self.sample_drafts, sampling)
        rows = CatchUpRows([r.row for r in reqs], [r.draft_num_computed for r in reqs],
                           [self.catch_up_tokens(r) for r in reqs])
        fit = None
        if self.chain_loop is not None and not sampled and sampling.penalties is None:
            fit = self.chain_loop.padded(steps, len(reqs), max(map(len, rows.tokens)))
        qs: list[torch.Tensor] = []
        if fit is not None:
            tokens = self.chain_loop.run(rows, steps, *fit)
        else:
            fb, first = self.catch_up(reqs, rows.tokens)

            def choose(j: int, logits: torch.Tensor, prefix: torch.Tensor):
                return choose_draft(logits, sampling.at_offset(prefix), sampled)

            tokens, qs = draft_chain(self.runner.forward, fb, first, ChainAnchor.after(fb, rows.step_bases), steps,
                                     choose, self.runner.page_table, self.feeds_hidden)
        self.caught_up(reqs)
        return Proposal(tokens, [steps] * len(reqs), torch.stack(qs, 1) if qs else None)

    def catch_up(self, reqs: list[Request], tokens_in: list[list[int]] | None = None):
        """Run the catch-up alone -> (its ForwardBatch, its ForwardOutput): padded to a captured width when a
        per-step graph can run it, else ragged and eager."""
        tokens_in = tokens_in or [self.catch_up_tokens(r) for r in reqs]
        graphs = self.runner.graphs
        width = graphs.extend_width(len(reqs), max(map(len, tokens_in))) if graphs is not None else None
        fb = self.catch_up_batch(reqs, tokens_in, width)
        with self.timer.phase("draft_extend") if self.timer is not None else contextlib.nullcontext():
            return fb, self.runner.forward(fb)
