"""Timers for the kernel micro-benchmarks (CUDA only; importable anywhere)."""

from __future__ import annotations

import statistics

import torch


def graph_ms(fn, reps: int = 30, warm_replays: int = 3) -> float:
    """Milliseconds per replay of a CUDA graph capturing fn (warmed on a side stream first, as capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warm_replays):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def graph_call_us(fn, calls: int = 20, replays: int = 15) -> float:
    """Microseconds per call of fn: `calls` calls captured in one CUDA graph, the median of `replays` replays, each
    timed with its own events (fn runs once eagerly first, to compile and warm up)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def eager_us(fn) -> float:
    """Median microseconds per eager call of fn, launch overhead included (triton.testing.do_bench)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def shape_table(shapes: list[tuple[int, int]], rows: list[tuple[float, str, list[float]]],
                best_of: list[tuple[float, str, list[float]]] | None = None) -> list[str]:
    """Markdown lines of a tile sweep over weight shapes: rows (total us, tile label, us per shape) as given, then
    each shape's best tile among best_of (default: the rows)."""
    lines = ["| tile | " + " | ".join(f"{n}x{k}" for n, k in shapes) + " | total |", "|---" * (len(shapes) + 2) + "|"]
    lines += [f"| {label} | " + " | ".join(f"{us:.1f}" for us in per_shape) + f" | {total:.1f} |"
              for total, label, per_shape in rows]
    best = [min(best_of or rows, key=lambda r: r[2][i]) for i in range(len(shapes))]
    return lines + ["", "best per shape: " + ", ".join(f"{n}x{k} {r[1]} {r[2][i]:.1f} us"
                                                        for i, ((n, k), r) in enumerate(zip(shapes, best))), ""]
