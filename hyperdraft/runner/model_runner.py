"""ModelRunner: one model on one device with its own KV pool and attention backend.

Target and draft each get a ModelRunner. They share the PageTable (so one
slot index addresses both pools) but nothing else: each pool and buffer is
sized from its own model's config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from hyperdraft.attention.registry import make_attention_backend
from hyperdraft.core.forward_batch import ForwardBatch
from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels.argmax import argmax_rows
from hyperdraft.kernels.topk import top_logprobs_kernel, top_logprobs_reference
from hyperdraft.kernels.vocab_map import VocabMap
from hyperdraft.kvcache.kv_pool import KVPool
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.attention.linear_backend import TorchLinearBackend, TritonLinearBackend
from hyperdraft.kvcache.state_pool import StatePool
from hyperdraft.models.decoder import DecoderLM
from hyperdraft.models.hybrid import HybridLM
from hyperdraft.runner.graph_runner import GraphRunner, GraphSettings, segment_cuts


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [N, V] float32, rows at fb.logits_indices ([N, Vd] draft-vocabulary logits under vocab)
    hidden: torch.Tensor  # [T, H] final normed hidden states of every token
    captured: list[torch.Tensor]  # per requested layer, [T, H] input hidden states
    vocab: VocabMap | None = None  # set when the logits cover a draft vocabulary (an EAGLE-3 head's)
    # [N, H] the hidden rows the logits came from, when the model keeps them (an EAGLE head: its next draft step
    # feeds them, and a second gather of the same rows would cost a launch per round)
    logits_hidden: torch.Tensor | None = None
    # [T, Hd] what a drafter reads of this forward (an EAGLE-3 head: fc over the captured states), when the replayed
    # graph was captured with that projection (GraphRunner.capture's `project`); None: the drafter computes it
    head_inputs: torch.Tensor | None = None

    def hidden_at_logits(self, logits_indices: torch.Tensor) -> torch.Tensor:
        """[N, H]: hidden[logits_indices], the rows the logits were computed from."""
        return self.logits_hidden if self.logits_hidden is not None else self.hidden[logits_indices]

    def target_logits(self) -> torch.Tensor:
        """[N, V] over the target vocabulary (-inf outside a draft vocabulary)."""
        return self.logits if self.vocab is None else self.vocab.spread(self.logits)

    def top_logprobs(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities [N, k], target ids [N, k] int64): each row's k most likely ids, largest first; on CUDA
        two launches over the logits as they are (a draft vocabulary's never spread: kernels/topk.py)."""
        if use_fused_kernels(self.logits) and self.logits.stride(-1) == 1:
            return top_logprobs_kernel(self.logits, k, None if self.vocab is None else self.vocab.draft_to_target)
        return top_logprobs_reference(self.target_logits(), k)

    def greedy_tokens(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """argmax of target_logits() [N] int64, without building them under a draft vocabulary; into out if given."""
        if self.vocab is not None:
            return self.vocab.argmax(self.logits, out)
        return argmax_rows(self.logits, out)


class DecodeSink(Protocol):
    """What a plain decode hands beside its logits to a drafter that skips step-0 rounds but must see every token (an
    EAGLE head: speculative/proposers/slot_hidden.py)."""

    capture_layers: tuple[int, ...]  # target layers whose input states the decode must capture for it

    def keep(self, fb: ForwardBatch, out: ForwardOutput) -> None:
        """Take what it needs of a decode's outputs (queued on the device; no sync)."""


class GraphedRunner:
    """Forward dispatch shared by every runner: a captured graph when one fits the batch, else eager. A runner built
    with GraphSettings owns a GraphRunner (runner/graph_runner.py), which captures what its owner plans."""

    # a hybrid model's recurrent states (ModelRunner builds them); a graph runner asks it whether verifies write scratch
    state_pool: StatePool | None = None

    def __init__(self, page_table: PageTable, graphs: GraphSettings | None, input_hidden_size: int | None = None):
        self.page_table = page_table
        self.input_hidden_size = input_hidden_size  # per-token hidden inputs (fb.input_hidden) the model consumes
        self.graphs = GraphRunner(self, graphs) if graphs is not None else None

    def forward(self, fb: ForwardBatch, capture_layers: tuple[int, ...] = (),
                sink: DecodeSink | None = None) -> ForwardOutput:
        """Either way the caller gets the outputs of the path that ran, and nothing else. sink: handed the outputs
        (inside the graph when the replayed one was captured with it)."""
        if self.graphs is not None:
            key = self.graphs.match(fb, capture_layers)
            if key is not None:
                self.page_table.flush()  # a replay reads the device page table without asking for it
                with torch.inference_mode():
                    out = self.graphs.replay(fb, key)
                if sink is not None and not self.graphs.keeps(key, sink):
                    sink.keep(fb, out)
                return out
        out = self.forward_eager(fb, capture_layers)
        if sink is not None:
            sink.keep(fb, out)
        return out

    def forward_eager(self, fb: ForwardBatch, capture_layers: tuple[int, ...] = (),
                      after_layer: Callable[[int], None] | None = None) -> ForwardOutput:
        """The forward, eagerly; after_layer(layers done) marks where graph capture may cut (segment_cuts)."""
        raise NotImplementedError

    def segment_cuts(self) -> tuple[int, ...]:
        """Layer counts after which a captured forward starts a new graph segment (none: one graph)."""
        return ()

    def release_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.release()


class ModelRunner(GraphedRunner):
    def __init__(self, model: DecoderLM | HybridLM, page_table: PageTable, attention_backend: str,
                 graphs: GraphSettings | None = None, verify_width: int = 0):
        """verify_width: the most tokens a request verifies in one forward (a hybrid model's state scratch)."""
        super().__init__(page_table, graphs)
        self.model = model
        self.config = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = self.config
        num_slots = page_table.num_pages * page_table.page_size
        self.pool = KVPool(cfg.num_kv_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self.backend = make_attention_backend(attention_backend, self.pool, page_table)
        # a hybrid model's recurrent state, one slot per page-table row, and the backend its linear layers call
        self.state_pool = StatePool(cfg.linear_attention, cfg.num_linear_layers, page_table.max_rows, self.dtype,
                                    self.device, verify_width) if cfg.is_hybrid else None
        self.linear_backend = None
        if cfg.is_hybrid:
            backend = TritonLinearBackend if use_fused_kernels(self.state_pool.conv) else TorchLinearBackend
            self.linear_backend = backend(self.state_pool)

    def segment_cuts(self) -> tuple[int, ...]:
        return segment_cuts(self.config.num_layers)

    @torch.inference_mode()
    def forward_eager(self, fb: ForwardBatch, capture_layers: tuple[int, ...] = (),
                      after_layer: Callable[[int], None] | None = None) -> ForwardOutput:
        meta = self.backend.plan(fb)

        def attn(layer_id, q, k, v, rope=None):
            return self.backend.forward(layer_id, q, k, v, fb, meta, rope)

        if self.linear_backend is None:
            hidden, captured = self.model(fb.input_ids, fb.positions, attn, capture_layers, after_layer)
        else:
            plan = self.linear_backend.plan(fb)

            def linear(layer_id, mixed, gates, conv_weight):
                return self.linear_backend.forward(layer_id, mixed, gates, conv_weight, plan)

            hidden, captured = self.model(fb.input_ids, fb.positions, attn, capture_layers, after_layer, linear)
        logits = self.model.compute_logits(fb.logits_rows(hidden))
        return ForwardOutput(logits, hidden, captured)
