"""Launcher: the GPU work a step queues for the NEXT step (a decode or a verify queued ahead), launched from a helper
thread while this thread commits, detokenizes and schedules.

Why: at batch 1 a small model's step is host-bound, and the largest single host cost in it is launching the queued
graph. A torch.profiler run of SmolLM2-135M chain-5 rounds on an H200 (real_accept_h200.md, session 32) put
`cudaGraphLaunch` at ~0.5 ms of a 1.35-1.8 ms round, ~320 us of it the 276-kernel verify queued ahead, while the
GPU's own work is ~0.9-1.0 ms. `CUDAGraph.replay` releases the GIL, so a helper thread can launch it while this
one runs Python.

The rule that keeps the stream's order: work goes to the helper (`submit`) only as the last GPU work of its step,
after everything it reads was queued by this thread, and this thread queues nothing on the device until `join()`
returns. The workers join first thing in each step (engine/model_worker.py, speculative/worker.py) and before
anything of theirs that may touch the device after a submit; graphs are never released under a pending launch.
The helper runs on the submitting thread's current stream, with its RuntimeOptions (a context variable), under
no_grad as Engine.step is.

Off (RuntimeOptions.launch_thread, HYPERDRAFT_LAUNCH_THREAD=0) `submit` runs the work inline. On CPU with emulated
graphs the helper runs the emulated forward itself, so a step that read a queued output before joining would read a
stale buffer and fail the CPU tests.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class Pending(Generic[T]):
    """What submitted work returns, once joined."""

    def __init__(self, future: Future | None = None, value: T | None = None):
        self._future, self._value = future, value

    def result(self) -> T:
        return self._value if self._future is None else self._future.result()


class Launcher:
    def __init__(self, enabled: bool, device: torch.device):
        self.device = device
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hyperdraft-launch") if enabled else None
        self._pending: Future | None = None
        self.submitted = 0  # work handed to the helper thread (tests, benchmarks)

    def submit(self, work: Callable[[], T]) -> Pending[T]:
        """Run `work` after everything this thread queued so far, on the helper thread when enabled (FIFO with
        earlier submissions); the caller queues nothing on the device until join()."""
        if self._pool is None:
            return Pending(value=work())
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        context = contextvars.copy_context()  # the engine's RuntimeOptions

        def run() -> T:
            with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
                return context.run(work)

        self._pending = self._pool.submit(run)
        self.submitted += 1
        return Pending(self._pending)

    def join(self) -> None:
        """Wait until the submitted work has been queued (launched, not run: the stream orders it); re-raise its
        error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Join, and stop the helper thread; later work runs inline."""
        self.join()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()

