"""Prompt tails in captured graphs: the last chunks of a few prompts, one logit each, padded to a captured extend
width, so a step that finishes prefills does not run the whole model eagerly.

An eager forward of a small model is almost all host time: SmolLM2-135M's is 335 Triton launches, 12-24 ms to
enqueue on an H100 machine for 1.2 ms of GPU kernels, whatever its token count (benchmarks/probes/eager_launch.py).
Under speculation every request finishes at its own step, so a newly admitted prompt rides along with almost every
verify round: at batch 16 such steps took 21-27 ms against 2.4 ms for a verify alone
(benchmarks/results/small_spec_batch_h200.md). The plain worker and the speculative worker both capture these shapes
and pad to them (a dense target only: a hybrid's prefill walks its recurrent states in place, which these graphs do
not).
"""

from __future__ import annotations

from dataclasses import replace

from hyperdraft.core.forward_batch import ForwardInput
from hyperdraft.runner.graph_runner import GraphRunner, GraphShape

EXTEND_GRAPH_WIDTHS = (16, 32, 64, 128, 256, 512)  # tokens per prompt, the real ones padded up to the next
EXTEND_GRAPH_MAX_BS = 4  # prompts in one captured tail batch


def tail_shapes(sizes: list[int]) -> dict[GraphShape, list[int]]:
    """The captured prompt-tail shapes for a worker capturing these batch sizes."""
    few = [s for s in sizes if s <= EXTEND_GRAPH_MAX_BS]
    return {GraphShape(q, 0, one_logit=True): few for q in EXTEND_GRAPH_WIDTHS} if few else {}


def padded_tails(graphs: GraphRunner | None, inputs: list[ForwardInput]) -> list[ForwardInput] | None:
    """Prompt tails that each want one logit, padded to the narrowest captured extend width that holds them, so a
    graph runs them; None when they do not fit one (also when the padding would pass the end of a row's page-table
    entries, graphs.max_seq_len tokens: it would read the next row's), and always for a hybrid target (no tails are
    captured for it). The padding tokens sit past each prompt, where nothing reads them before a decode overwrites
    them (or in the padding page, past the row's pages)."""
    if (graphs is None or graphs.recurrent or not inputs
            or any(inp.num_logits != 1 or inp.mask is not None for inp in inputs)):
        return None
    width = graphs.extend_width(len(inputs), max(len(inp.token_ids) for inp in inputs))
    if width is None or width == 1 or any(inp.prefix_len + width > graphs.max_seq_len for inp in inputs):
        return None
    return [replace(inp, token_ids=inp.token_ids + [0] * (width - len(inp.token_ids)),
                    padding=width - len(inp.token_ids)) for inp in inputs]
