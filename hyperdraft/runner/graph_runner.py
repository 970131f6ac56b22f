"""GraphRunner: captured forwards of one ModelRunner, replayed for batches that fit a captured shape.

A graph is captured per GraphShape (tokens per request q, tail-mask width W, which logits rows) and padded batch
size. It runs the ModelRunner's whole forward (attention plan, every layer, logits) on static input buffers. A batch
fits when every request feeds exactly q tokens, its tail mask has width W (0 = causal), it wants the logits of
every token (or, for a one_logit shape, exactly one row per request, at an index the batch gives: a draft extend
padded to q tokens wants its last real one), and its batch size is at most the largest captured size; it is padded
up to the next captured size. Anything else runs eagerly.

Where outputs live (the bug class of SGLang's graph/eager disagreements): ModelRunner.forward returns ONE
ForwardOutput, taken from whichever path ran, and every consumer reads only that. Graph outputs are views of
static buffers: they stay valid until this runner's next forward, and callers that keep them longer copy them.
Every batch size of a shape shares one set of output buffers, the largest graph's: a smaller graph ends by copying
its outputs into their leading rows. Kept apart, each size's outputs stayed alive in the pool: a SmolLM2 EAGLE-3
chain-5 engine's 27 verify graphs held 3.1 GB of logits, now 0.3 GB (benchmarks/probes/graph_memory.py). The copy
costs a smaller graph one read and write of its logits (3 MB for a chain-5 verify at batch 1 and a 128k vocabulary).

Padding rows (batch entries past the real ones) read page-table row 0 (reads are harmless) and write their K/V to
slot 0, the padding page; their inputs are reset on every replay, so a larger previous batch never leaves real
slots in them.

Segments: a graph's host launch cost grows with its kernel count (about 0.45 ms for an 8B decoder's ~450 kernels on
an H100) and its first kernel starts only when the launch call returns, so at batch 1 that cost is GPU idle time.
A decoder's forward is therefore captured as a few graphs cut at layer boundaries (after layers L/16 and L/4):
the GPU starts on the short first segment while the host is still launching the rest. The segments share one
memory pool and are replayed in capture order. GraphSettings.segments off (RuntimeOptions.graph_segments) captures
one graph per forward. So does a capture that asks for it (segmented=False): a speculative engine's verify graphs
when round-ahead queues them (speculative/verify_ahead.py). Launched while the GPU still runs the round before, a
verify's segments only cost host time: a launch costs ~40 us of host plus ~0.8 us a kernel on an H100, and with the
SmolLM2 shape a batch-1 chain-5 step ran 4-25% faster as one graph per forward in three paired runs
(benchmarks/results/round_host_h100.md).

GraphSettings.emulate (CPU tests, RuntimeOptions.emulate_cuda_graphs) keeps the static buffers, padding and output
slicing but runs the forward eagerly on the static buffers: the graph bookkeeping is tested where no GPU exists.

What to capture is the caller's business: a plain worker captures one-token decodes, the speculative worker plans
its verify and draft shapes (speculative/graph_plan.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hyperdraft.core.forward_batch import ForwardBatch
from hyperdraft.runner.capture import capture_segments, into_shared, reset_graphs, shared_buffers
from hyperdraft.runner.static_inputs import GraphShape, StaticInputs

logger = logging.getLogger("hyperdraft")


@dataclass(frozen=True)
class GraphSettings:
    """How a runner captures: the batch sizes (padded up to), emulation on CPU, segmented forwards."""

    batch_sizes: tuple[int, ...]
    emulate: bool = False
    segments: bool = True


def segment_cuts(num_layers: int) -> tuple[int, ...]:
    """Layer counts after which a captured decoder forward starts a new graph segment."""
    return tuple(sorted({c for c in (max(1, num_layers // 16), max(1, num_layers // 4)) if 0 < c < num_layers}))


MAX_GRAPH_BS = 256  # SGLang's default bound on an 80 GB GPU
EMULATED_GRAPH_MAX_BS = 64
GRAPH_MEMORY_SHARE = 0.5  # of the memory left after weights and pools, what the largest graph's activations may use


def default_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to 128 and of 16 beyond, up to max_bs (and max_bs itself)."""
    sizes = [s for s in (1, 2, 4) if s <= max_bs] + list(range(8, min(max_bs, 128) + 1, 8))
    sizes += list(range(144, max_bs + 1, 16))
    return sorted(set(sizes + [max_bs]))


def graph_max_bs(free_bytes: int, row_bytes: int, rows_per_request: int) -> int:
    """The largest batch to capture when the user set none: MAX_GRAPH_BS, or fewer when the largest graph's
    activations (row_bytes per token row, rows_per_request rows a request) would take more than GRAPH_MEMORY_SHARE of
    the free memory. Batches past it run eagerly."""
    fits = int(free_bytes * GRAPH_MEMORY_SHARE) // max(1, row_bytes * rows_per_request)
    return max(1, min(MAX_GRAPH_BS, fits))


def default_graph_max_bs(device: torch.device, cfg, dtype: torch.dtype, rows_per_request: int, emulate: bool) -> int:
    """Without --cuda-graph-max-bs: on a GPU, up to MAX_GRAPH_BS as the memory left after weights and pools allows;
    the CPU's emulated graphs (tests) keep EMULATED_GRAPH_MAX_BS."""
    if emulate:
        return EMULATED_GRAPH_MAX_BS
    row = activation_row_bytes(cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, dtype.itemsize)
    return graph_max_bs(torch.cuda.mem_get_info(device)[0], row, rows_per_request)


def activation_row_bytes(hidden: int, intermediate: int, vocab: int, dtype_bytes: int) -> int:
    """A generous bound on the activation bytes one token row holds at once in a forward: a few hidden-size
    buffers, the MLP's gate/up and activation, and the logits in the model's dtype and in fp32."""
    return dtype_bytes * (8 * hidden + 3 * intermediate + vocab) + 4 * vocab


class GraphRunner:
    def __init__(self, runner, settings: GraphSettings):
        self.runner = runner
        self.settings = settings
        self.batch_sizes = sorted(settings.batch_sizes)
        self.emulate = settings.emulate
        self.max_seq_len = runner.page_table.max_pages_per_row * runner.page_table.page_size
        self.inputs: dict[GraphShape, StaticInputs] = {}
        self.sizes: dict[GraphShape, list[int]] = {}
        self.graphs: dict[tuple[GraphShape, int], object] = {}
        self.outputs: dict[tuple[GraphShape, int], object] = {}
        self.shared: dict[GraphShape, object] = {}  # per shape, the buffers every batch size's outputs view
        self.capture_layers: tuple[int, ...] = ()
        self.sinks: dict[GraphShape, object] = {}  # shape -> the DecodeSink its graphs run inside them
        self.projections: dict[GraphShape, Callable] = {}  # shape -> the head_inputs projection its graphs run
        self.whole: set[GraphShape] = set()  # shapes captured as one graph per forward whatever settings.segments says
        self.pool = None  # the graphs' shared memory pool, made at the first capture (memory_pool)
        self.num_replays = 0  # tests and logs: how many forwards a graph served
        self.replays: Counter[tuple[GraphShape, int]] = Counter()  # the same, per (shape, padded batch size)
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    # ---- capture ------------------------------------------------------------------------------------------------
    def capture(self, shapes: dict[GraphShape, list[int]], mode, capture_layers: tuple[int, ...] = (),
                sink=None, project: Callable | None = None, segmented: bool = True) -> None:
        """Capture every (shape, batch size); sizes per shape (adaptive tiers route only some sizes to a tier).
        sink: a DecodeSink (runner/model_runner.py) whose keep() the graphs run after the forward, on the static
        buffers: on an H100 its four eager launches after every step-0 decode cost ~0.2 ms of a 1.9 ms step at 64
        requests (benchmarks/results/step_zero_h100.md). A padded row's keep writes the padding page's slot.
        project: ForwardOutput -> the drafter's inputs [T, Hd], run inside the graphs (emulated ones too) into the
        outputs' head_inputs: an EAGLE-3 verify's concatenation and fc cost ~0.2 ms of host a round as eager launches
        on an H100 (benchmarks/results/round_host_h100.md). segmented False: one graph per forward (a forward whose
        launch is mostly queued while the GPU still works gains nothing from segments and pays ~40 us of host a
        launch, module doc)."""
        self.capture_layers = capture_layers
        device = self.runner.device
        start = time.perf_counter()
        reserved_before = torch.cuda.memory_reserved(device) if not self.emulate else 0
        for shape, sizes in sorted(shapes.items()):
            sizes = sorted(s for s in sizes if s <= self.batch_sizes[-1])
            if not sizes:
                continue
            self.sizes[shape] = sizes
            if sink is not None:
                self.sinks[shape] = sink
            if project is not None:
                self.projections[shape] = project
            if not segmented:
                self.whole.add(shape)
            hidden = self.runner.input_hidden_size
            self.inputs[shape] = StaticInputs(shape, sizes[-1], device, hidden, self.runner.dtype, self.recurrent)
            for bs in reversed(sizes):  # largest first, so smaller graphs reuse its pool memory
                self._capture_one(shape, bs, mode)
        if not self.emulate:
            torch.cuda.synchronize(device)
            self.capture_bytes += torch.cuda.memory_reserved(device) - reserved_before  # graph pool + static buffers
        self.capture_seconds += time.perf_counter() - start
        logger.info("%s graphs of %s (%s): %d captured in %.1f s, %.1f MiB so far", "emulated" if self.emulate else "CUDA",
                    type(self.runner.model).__name__, mode.value, len(self.outputs), self.capture_seconds,
                    self.capture_bytes / 2**20)

    def _capture_one(self, shape: GraphShape, bs: int, mode) -> None:
        static = self.inputs[shape]
        fb = static.batch(mode, bs, shape.tokens_per_req, self.max_seq_len, [0] * bs, self._speculative(shape))
        key = (shape, bs)
        if self.emulate:
            self.outputs[key] = None
            return
        self.graphs[key], self.outputs[key] = self._capture_segments(fb, self.shared.get(shape), self.sinks.get(shape),
                                                                     self.projections.get(shape), shape not in self.whole)
        self.shared.setdefault(shape, self.outputs[key])  # sizes are captured largest first

    @property
    def recurrent(self) -> bool:
        return self.runner.state_pool is not None

    def _speculative(self, shape: GraphShape) -> bool:
        """A hybrid model's captured batches read and write states where static buffers say (attention/linear_backend.py
        plans the walk on the device, inside the graph): more than one token per row is a verify, every row's states
        going to scratch; one token per row is a decode, each row's source and destination refilled per replay
        (in place for a plain decode; slot and scratch entry 0 in turn for decodes queued ahead)."""
        return self.recurrent

    def memory_pool(self):
        """The memory pool every graph of this runner shares (and a drafter's whole-round graphs with them)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def _capture_segments(self, fb: ForwardBatch, shared, sink=None, project=None,
                          segmented: bool = True) -> tuple[list, object]:
        """Capture one forward as consecutive graphs cut after the layers the runner's segment_cuts names (one graph
        when it names none or segments are off), then the projection and sink.keep when given; its outputs copied into
        `shared` when given."""
        cuts = self.runner.segment_cuts() if self.settings.segments and segmented else ()

        def run(cut):
            after_layer = (lambda layers_done: cut() if layers_done in cuts else None) if cuts else None
            out = self._projected(self.runner.forward_eager(fb, self.capture_layers, after_layer), project)
            if sink is not None:
                with torch.inference_mode():
                    sink.keep(fb, out)
            return out if shared is None else into_shared(out, shared)

        return capture_segments(self.memory_pool(), self.runner.device, run)

    # ---- replay -------------------------------------------------------------------------------------------------
    def release(self) -> None:
        """Destroy every graph; later forwards run eagerly. A graph that captured NCCL collectives must go before its
        process group: on an H100 pair, destroying the group while such graphs lived hung for good."""
        reset_graphs(self.graphs)
        self.outputs.clear()
        self.shared.clear()
        self.sinks.clear()
        self.projections.clear()
        self.whole.clear()
        self.sizes.clear()
        self.inputs.clear()

    def match(self, fb: ForwardBatch, capture_layers: tuple[int, ...]) -> tuple[GraphShape, int] | None:
        """The (shape, padded batch size) that can run fb, or None (run it eagerly)."""
        if not self.sizes or capture_layers != self.capture_layers or fb.batch_size == 0:
            return None
        if (fb.input_hidden is None) != (self.runner.input_hidden_size is None):
            return None
        q = fb.max_extend_len
        if fb.num_tokens != fb.batch_size * q:
            return None  # ragged (prefill chunks, variable drafts)
        num_logits = fb.logits_indices.shape[0]
        if num_logits != fb.num_tokens and num_logits != fb.batch_size:
            return None  # logits for only some tokens (prefill chunks)
        width = 0 if fb.tail_mask is None else fb.tail_mask.shape[2]
        if fb.tail_mask is not None and fb.tail_mask.shape[1] != q:
            return None
        shape = GraphShape(q, width, num_logits != fb.num_tokens)
        if not self.fits(shape, fb.batch_size):
            return None
        if self.recurrent and not self._fits_state_walk(fb, q):
            return None  # speculative and committed rows mixed, or draft steps: not what the graph was captured for
        sizes = self.sizes[shape]
        return shape, sizes[bisect.bisect_left(sizes, fb.batch_size)]

    @staticmethod
    def _fits_state_walk(fb: ForwardBatch, q: int) -> bool:
        """Whether a hybrid model's batch walks its states as a captured graph of q tokens per row does: a verify
        (every row speculative, scratch by position), or a decode with every row's source and destination given, or
        none (its slot, in place)."""
        if q > 1:
            return fb.num_spec_requests == fb.batch_size and fb.state_targets is None
        if fb.state_parents is None:
            return fb.num_spec_requests == 0
        return fb.num_spec_requests == fb.batch_size and fb.state_targets is not None

    def fits(self, shape: GraphShape, batch_size: int) -> bool:
        """A graph of this shape exists for batch_size (after padding up to a captured size)."""
        sizes = self.sizes.get(shape)
        return sizes is not None and batch_size <= sizes[-1]

    def extend_width(self, batch_size: int, max_count: int) -> int | None:
        """Tokens per request to pad a one-logit-per-request extend to (every request feeds 1..max_count real
        tokens), so a captured graph runs it: the captured width that fits with the fewest padded tokens, or None
        (run the ragged batch eagerly). Width 1 is the one-token decode graph."""
        best = None
        for shape, sizes in self.sizes.items():
            q = shape.tokens_per_req
            usable = shape.one_logit or q == 1
            if not usable or shape.mask_width or q < max_count or batch_size > sizes[-1]:
                continue
            cost = q * sizes[bisect.bisect_left(sizes, batch_size)]
            if best is None or cost < best[0]:
                best = (cost, q)
        return None if best is None else best[1]

    def keeps(self, key: tuple[GraphShape, int], sink) -> bool:
        """Whether replaying key runs sink.keep inside the graph (never for emulated graphs, which run eagerly)."""
        return not self.emulate and self.sinks.get(key[0]) is sink

    def replay(self, fb: ForwardBatch, key: tuple[GraphShape, int]):
        shape, bs = key
        q, real = shape.tokens_per_req, fb.batch_size
        static = self.inputs[shape]
        static.fill(fb, bs, q)
        self.num_replays += 1
        self.replays[key] += 1
        if self.emulate:  # the same buffers and padding, run eagerly; the torch backend reads the host lists
            padded = static.batch(fb.mode, bs, q, self.max_seq_len, fb.prefix_lens + [0] * (bs - real),
                                  self._speculative(shape))
            fresh = self._projected(self.runner.forward_eager(padded, self.capture_layers), self.projections.get(shape))
            if shape not in self.shared:  # buffers for the shape's largest size, which every replay overwrites in
                # place, as the graphs' shared outputs: a consumer keeping a view past the next forward is caught
                self.shared[shape] = shared_buffers(fresh, bs, self.sizes[shape][-1])
            out = into_shared(fresh, self.shared[shape])
        else:
            for segment in self.graphs[key]:
                segment.replay()
            out = self.outputs[key]
        n = real * q
        rows = real if shape.one_logit else n
        return dataclasses.replace(out, logits=out.logits[:rows], hidden=out.hidden[:n],
                                   captured=[c[:n] for c in out.captured],
                                   logits_hidden=None if out.logits_hidden is None else out.logits_hidden[:rows],
                                   head_inputs=None if out.head_inputs is None else out.head_inputs[:n])

    @staticmethod
    def _projected(out, project: Callable | None):
        if project is None:
            return out
        with torch.inference_mode():
            return dataclasses.replace(out, head_inputs=project(out))
