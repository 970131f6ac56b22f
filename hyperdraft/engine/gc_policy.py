"""Python's cyclic garbage collection kept off the step path (benchmarks/results/gc_pause.md measured both changes).
Processes that own one engine for their life (the server, each tensor-parallel follower rank) make both for good;
the offline LLM defers the youngest generation while it steps (`young_collections_deferred`) and freezes nothing.

- The startup heap frozen. Building an engine leaves a few hundred thousand container objects alive (torch,
  transformers, the tokenizer, the model's modules, the graph runners). The oldest generation's collection walks
  every one of them, and while it does no step runs: 150-230 ms every few hundred steps at 256 requests.
  gc.freeze() moves what is alive now into a permanent generation that collections skip.
- The youngest generation collected past YOUNG_THRESHOLD net new containers instead of CPython's 700. A step builds
  and drops per-request objects by the thousand at large batches, so the count crosses 700 inside a step about twice
  a step, and each collection walks objects that reference counting frees a moment later anyway.

The Engine does neither by itself, and the LLM freezes nothing: frozen objects are never collected, so a process that
builds and drops engines one after another (tests, notebooks, benchmarks) would keep the cyclic garbage of each.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

YOUNG_THRESHOLD = 50_000  # a 256-request step never got there in 3000 steps on an H200 (gc_pause.md)


def freeze_startup_heap() -> int:
    """Collect once, then freeze everything still alive -> how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def defer_young_collections() -> None:
    """For good: the youngest generation waits for YOUNG_THRESHOLD net new containers (the older two keep theirs)."""
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)


def adopt_serving_policy() -> None:
    """Both, for good: what a process that owns its engine until it ends does once the engine is built."""
    freeze_startup_heap()
    defer_young_collections()


@dataclass
class _Deferral:
    """How many young_collections_deferred blocks are open, and the thresholds the first one found: streams of
    two LLMs may interleave and close in any order, and only the last to close puts the thresholds back."""

    depth: int = 0
    saved: tuple[int, int, int] = (700, 10, 10)
    lock: threading.Lock = field(default_factory=threading.Lock)


_DEFERRAL = _Deferral()


@contextlib.contextmanager
def young_collections_deferred() -> Iterator[None]:
    """defer_young_collections() for the block's duration; nested and interleaved blocks share one deferral."""
    with _DEFERRAL.lock:
        if _DEFERRAL.depth == 0:
            _DEFERRAL.saved = gc.get_threshold()
            defer_young_collections()
        _DEFERRAL.depth += 1
    try:
        yield
    finally:
        with _DEFERRAL.lock:
            _DEFERRAL.depth -= 1
            if _DEFERRAL.depth == 0:
                gc.set_threshold(*_DEFERRAL.saved)
