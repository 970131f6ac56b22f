"""EngineLoop: the one thread that owns the Engine.

The Engine is single-threaded. Every add_request, abort and step runs on this thread, which takes commands from
a thread-safe queue, runs a step whenever the engine has work, and sleeps on the queue when it has none (no busy
spin). Concurrent HTTP requests therefore batch together: whatever arrived before a step joins it.

Outputs go back through each request's sink, which the caller makes thread-safe (the server uses
loop.call_soon_threadsafe). A failure while handling one request's output fails that request only. A failure
inside a batched step cannot be pinned on one request, so it fails the requests that were running in that step;
either way the loop keeps serving.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hyperdraft.engine.device import device_lost
from hyperdraft.engine.engine import Engine
from hyperdraft.llm import meta_info
from hyperdraft.request import Request
from hyperdraft.sampling_params import SamplingParams

logger = logging.getLogger("hyperdraft.server")


@dataclass
class Event:
    """What one engine step did for one request (or how it ended)."""

    token_ids: list[int]
    logprobs: list[float]  # of token_ids, when the request asked for logprobs
    time: float  # time.perf_counter() on the engine thread
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    meta: dict | None = None  # hyperdraft.llm.meta_info, on the finishing event
    error: str | None = None  # set when the request failed inside the server
    text_ids: list[int] | None = None  # of token_ids, those whose text the user gets (Request.text_ids); None: all


Sink = Callable[[int, Event], None]  # (choice index, event); called on the engine thread


@dataclass
class Submission:
    """One HTTP request's engine requests (its choices), queued or refused together."""

    input_ids: list[list[int]]
    params: list[SamplingParams]
    sink: Sink
    tag: str | None = None  # the client's `user` field; only the output hook reads it


class QueueFull(Exception):
    """The request would queue beyond --max-queued-requests."""


@dataclass
class _Tracked:
    req: Request
    index: int
    sink: Sink
    tag: str | None


@dataclass
class _Command:
    fn: Callable[[], Any]
    future: concurrent.futures.Future | None = field(default=None)


class EngineLoop:
    def __init__(self, engine: Engine, max_queued_requests: int | None = None,
                 output_hook: Callable[[str | None], None] | None = None):
        """output_hook(tag): called on the engine thread before each output of a request is handed back, with the
        request's `user` field. An exception it raises fails that request alone (a 500 for it, its KV freed): the
        tests inject faults through it to check that one request's failure stays its own."""
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.output_hook = output_hook
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._rids = itertools.count()
        self._stopping = False
        self.failure: str | None = None  # why the engine cannot step any more, once the loop found it (then it ends)
        self.client_aborts = 0  # requests the engine aborted because their client went away
        self._thread = threading.Thread(target=self._run, name="hyperdraft-engine", daemon=True)

    # ---- the caller's side (any thread) -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Fail whatever is still in flight (freeing its KV), then end the thread."""
        if self._thread.is_alive():
            self._commands.put(_Command(self._stop))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, sub: Submission) -> concurrent.futures.Future:
        """-> Future of the request ids; fails with ValueError (bad input) or QueueFull, having queued nothing."""
        return self.call(lambda engine: self._add(sub))

    def abort(self, rids: list[str]) -> None:
        """Abort the given requests (a client went away); their KV is freed before the next step."""
        self._commands.put(_Command(lambda: self._abort(rids)))

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread, between steps (engine reads for /server_info and /metrics)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Command(lambda: fn(self.engine), future))
        if not self._thread.is_alive():
            _fail_future(future, RuntimeError(self.failure or "the engine thread is not running"))
        return future

    # ---- the engine thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            for cmd in self._next_commands(block=not self.engine.has_unfinished()):
                self._execute(cmd)
            if self.engine.has_unfinished() and not self._stopping:
                self._step()
        ending = self.failure or "the server is shutting down"
        for t in list(self._tracked.values()):
            self._fail(t, ending)
        for cmd in self._next_commands(block=False):  # nobody will run these: answer their callers now
            if cmd.future is not None:
                _fail_future(cmd.future, RuntimeError(ending))
        self.engine.close()  # a tensor-parallel group's other ranks stop with the thread that drove them

    def _next_commands(self, block: bool) -> list[_Command]:
        cmds = [self._commands.get()] if block else []  # idle: sleep here until a command arrives
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    @staticmethod
    def _execute(cmd: _Command) -> None:
        try:
            result = cmd.fn()
        except Exception as e:  # noqa: BLE001 - handed to the caller, or logged: never kills the loop
            if cmd.future is not None:
                cmd.future.set_exception(e)
            else:
                logger.exception("engine command failed")
            return
        if cmd.future is not None:
            cmd.future.set_result(result)

    def _stop(self) -> None:
        self._stopping = True

    def _add(self, sub: Submission) -> list[str]:
        engine = self.engine
        # Validate every choice before queueing any, so a refused request leaves nothing behind.
        for ids, params in zip(sub.input_ids, sub.params):
            engine.check_request(params, ids)
        self._check_queue(len(sub.input_ids))
        added: list[Request] = []
        try:
            for ids, params in zip(sub.input_ids, sub.params):
                added.append(engine.add_request(params=params, input_ids=ids, rid=f"srv-{next(self._rids)}"))
        except Exception:
            engine.abort_many([req.rid for req in added])
            raise
        for index, req in enumerate(added):
            self._tracked[req.rid] = _Tracked(req, index, sub.sink, sub.tag)
        return [req.rid for req in added]

    def _check_queue(self, count: int) -> None:
        """Requests beyond the free running slots queue; refuse the submission if that queue would exceed the limit."""
        if self.max_queued_requests is None:
            return
        sched = self.engine.scheduler
        free_slots = max(0, self.engine.max_rows - len(sched.running))
        queued = max(0, len(sched.waiting) + count - free_slots)
        if queued > self.max_queued_requests:
            raise QueueFull(f"the server is saturated: {len(sched.running)} requests running and {len(sched.waiting)} "
                            f"waiting; accepting this one would queue {queued} > --max-queued-requests="
                            f"{self.max_queued_requests}. Retry later.")

    def _abort(self, rids: list[str]) -> None:
        tracked = [rid for rid in rids if self._tracked.pop(rid, None) is not None]
        self.client_aborts += len(self.engine.abort_many(tracked))

    def state(self) -> dict:
        """The loop's own counters (engine thread; through call())."""
        return {"in_flight_requests": len(self._tracked), "client_aborts": self.client_aborts}

    def _step(self) -> None:
        running = set(r.rid for r in self.engine.scheduler.running)
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001
            logger.exception("engine step failed; failing the requests it ran")
            self._fail_step(running | set(r.rid for r in self.engine.scheduler.running), e)
            return
        now = time.perf_counter()
        for out in outputs:
            t = self._tracked.get(out.req.rid)
            if t is not None:
                self._deliver(t, out.new_token_ids, now)
        # Finished outside the step's outputs: a decode the pool could never hold, ended while it was scheduled. Only
        # a running request can be (this loop's own aborts untrack theirs first); scanning every tracked request, the
        # queued ones too, cost ~2.5 ms a step with 20k queued (an audit's measurement).
        for t in [t for t in map(self._tracked.get, running) if t is not None and t.req.finished]:
            self._deliver(t, [], now)

    def _deliver(self, t: _Tracked, new_ids: list[int], now: float) -> None:
        try:
            if self.output_hook is not None:
                self.output_hook(t.tag)
            req = t.req
            logprobs = list(req.output_logprobs[-len(new_ids):]) if new_ids and req.params.return_logprob else []
            ids = list(new_ids)
            # only a finishing event can end on a stop token whose text is trimmed (Request.text_ids)
            event = Event(ids, logprobs, now, req.finished, req.finish_reason, meta_info(req) if req.finished else None,
                          text_ids=req.text_ids(ids) if req.finished else None)
            if req.finished:
                del self._tracked[req.rid]
            t.sink(t.index, event)
        except Exception as e:  # noqa: BLE001 - this request fails; the others go on
            logger.exception("handling the output of %s failed", t.req.rid)
            self._fail(t, f"internal error: {type(e).__name__}: {e}")

    def _fail_step(self, running: set[str], error: Exception) -> None:
        """A step raised: fail the requests it ran, or, when none ran, those it was admitting (so a step that fails
        before it schedules cannot spin the loop over the same queue). An engine that cannot step any more (a
        tensor-parallel rank exited, the device's context was lost) fails every request and ends the loop, so new
        requests and /health see it at once."""
        engine = self.engine
        self.failure = engine.lockstep.failure() or (
            "the device's context was lost: the engine cannot go on" if device_lost(engine.device) else None)
        message = self.failure or f"internal error in an engine step: {type(error).__name__}: {error}"
        for t in [t for rid, t in self._tracked.items() if self.failure or not running or rid in running]:
            self._fail(t, message)
        if self.failure:
            self._stopping = True

    def _fail(self, t: _Tracked, message: str) -> None:
        self._tracked.pop(t.req.rid, None)
        try:
            self.engine.abort(t.req.rid)  # frees its KV now
        except Exception:  # noqa: BLE001
            logger.exception("aborting %s failed", t.req.rid)
        try:
            t.sink(t.index, Event([], [], time.perf_counter(), True, "error", error=message))
        except Exception:  # noqa: BLE001 - the receiving side is gone (shutdown)
            pass


def _fail_future(future: concurrent.futures.Future, exc: Exception) -> None:
    try:
        future.set_exception(exc)
    except concurrent.futures.InvalidStateError:  # the other side got there first
        pass
