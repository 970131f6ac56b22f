"""Capture mechanics shared by every runner's graphs: forwards captured as segments in one memory pool, outputs kept in
one set of buffers per shape, and graphs destroyed. (GraphRunner and the drafters' whole-round graphs use these.)"""

from __future__ import annotations

import dataclasses
import torch

@torch.inference_mode()  # shared may be a captured forward's outputs: inference tensors
def into_shared(fresh, shared):
    """fresh's tensors copied into the leading rows of shared's -> views of those rows (both ForwardOutputs:
    runner/model_runner.py, which imports this module)."""
    def put(dst: torch.Tensor | None, src: torch.Tensor | None) -> torch.Tensor | None:
        return None if src is None else dst[: src.shape[0]].copy_(src)

    return dataclasses.replace(
        fresh, logits=put(shared.logits, fresh.logits), hidden=put(shared.hidden, fresh.hidden),
        captured=[put(dst, src) for dst, src in zip(shared.captured, fresh.captured)],
        logits_hidden=put(shared.logits_hidden, fresh.logits_hidden),
        head_inputs=put(shared.head_inputs, fresh.head_inputs))


def shared_buffers(fresh, batch_size: int, max_batch_size: int):
    """A ForwardOutput of empty buffers shaped like fresh's tensors (a forward of batch_size requests) for
    max_batch_size requests (an emulated shape's largest size)."""
    def grown(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.new_empty((t.shape[0] // batch_size * max_batch_size, *t.shape[1:]))

    return dataclasses.replace(fresh, logits=grown(fresh.logits), hidden=grown(fresh.hidden),
                               captured=[grown(c) for c in fresh.captured], logits_hidden=grown(fresh.logits_hidden),
                               head_inputs=grown(fresh.head_inputs))


def reset_graphs(graphs: dict) -> None:
    """Destroy the captured segments held in `graphs` (key -> list of CUDA graphs) and empty it."""
    for segments in graphs.values():
        for graph in segments:
            graph.reset()
    graphs.clear()


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device) -> torch.cuda.Stream:
    """One side stream per device for every capture and its warm-up runs. The caching allocator keeps a freed block
    for the stream that used it, so a new stream per capture left each warm-up's activations reserved for a stream
    nothing used again: 27 verify graphs of a SmolLM2 EAGLE-3 engine reserved 11.5 GB that way, each about its own
    peak (980 MB at batch 256), and ran an H100 out of memory at mem_fraction_static 0.85."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
    return _CAPTURE_STREAMS[index]


def capture_segments(pool, device, run) -> tuple[list, object]:
    """Capture run(cut) as consecutive CUDA graphs, starting a new one whenever run calls cut() -> (the graphs, run's
    result). run first runs twice uncaptured on the capture stream (lazy initialisation and Triton compilation
    happen outside the graph). Tensors made in one segment and read in a later one stay referenced while run runs,
    and the segments share `pool`; they must be replayed in capture order with nothing in between."""
    stream = capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            run(lambda: None)
    torch.cuda.current_stream(device).wait_stream(stream)
    segments: list = []

    def begin() -> None:
        segments.append(torch.cuda.CUDAGraph())
        segments[-1].capture_begin(pool=pool)

    def cut() -> None:
        segments[-1].capture_end()
        begin()

    torch.cuda.synchronize(device)
    with torch.cuda.stream(stream):
        begin()
        out = run(cut)
        segments[-1].capture_end()
    return segments, out
