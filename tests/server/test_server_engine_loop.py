"""EngineLoop in-process, without HTTP: the engine thread sleeps when idle, and a failing batched step fails only
the requests it ran; the loop goes on serving with a clean KV pool."""

from __future__ import annotations

import os
import queue
import threading
import time

import pytest

from conftest import assert_engine_clean
from hyperdraft import LLM, SamplingParams
from hyperdraft.server.engine_loop import EngineLoop, Submission


@pytest.fixture
def loop_llm(llama_path):
    llm = LLM(llama_path, device="cpu", dtype="float32")
    loop = EngineLoop(llm.engine)
    loop.start()
    yield loop, llm
    loop.stop()
    assert not loop.alive
    assert_engine_clean(llm)


def submit(loop: EngineLoop, ids: list[int], max_new_tokens: int) -> queue.SimpleQueue:
    events: queue.SimpleQueue = queue.SimpleQueue()
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens, ignore_eos=True)
    loop.submit(Submission([ids], [params], lambda index, event: events.put(event))).result(timeout=30)
    return events


def drain(events: queue.SimpleQueue) -> list:
    out = []
    while not out or not out[-1].finished:
        out.append(events.get(timeout=60))
    return out


def thread_cpu_ticks(thread: threading.Thread) -> int:
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_idle_engine_thread_sleeps(loop_llm):
    loop, _ = loop_llm
    drain(submit(loop, [1, 2, 3], 4))
    time.sleep(0.1)
    before = thread_cpu_ticks(loop._thread)
    time.sleep(1.0)
    ticks = thread_cpu_ticks(loop._thread) - before
    assert ticks <= 2, f"the idle engine thread used {ticks / os.sysconf('SC_CLK_TCK'):.2f} s of CPU in 1 s"


def test_failing_step_fails_its_requests_and_the_loop_goes_on(loop_llm):
    loop, llm = loop_llm
    ref = [t for e in drain(submit(loop, [5, 6, 7], 8)) for t in e.token_ids]
    running = submit(loop, [5, 6, 7], 400)
    assert running.get(timeout=60).token_ids  # it is decoding
    real_run, calls = llm.engine.worker.run, []

    def fail_once(batch):
        if not calls:
            calls.append(1)
            raise RuntimeError("injected step failure")
        return real_run(batch)

    llm.engine.worker.run = fail_once
    last = drain(running)[-1]
    assert last.finish_reason == "error" and "injected step failure" in last.error
    assert loop.call(lambda engine: engine.flush_cache() and engine.kv_free_slots == engine.kv_capacity_slots).result(timeout=30)
    after = drain(submit(loop, [5, 6, 7], 8))  # served normally after the failure
    assert [t for e in after for t in e.token_ids] == ref and len(ref) == 8


def test_a_step_that_fails_before_scheduling_fails_what_it_was_admitting(loop_llm):
    """With nothing running, a failing step was about the waiting requests: they fail, where the loop used to retry
    the same step forever with them unanswered; the loop then serves on."""
    loop, llm = loop_llm
    scheduler = llm.engine.scheduler
    real_schedule = scheduler.schedule

    def broken(*args, **kwargs):
        raise RuntimeError("injected scheduling failure")

    scheduler.schedule = broken
    waiting = submit(loop, [5, 6, 7], 8)
    last = waiting.get(timeout=30)
    assert last.finished and last.finish_reason == "error" and "injected scheduling failure" in last.error
    scheduler.schedule = real_schedule
    assert sum(len(e.token_ids) for e in drain(submit(loop, [5, 6, 7], 8))) == 8 and loop.alive


def test_a_dead_tensor_parallel_rank_fails_every_request_and_ends_the_loop(llama_path):
    """A follower killed (as by the OOM killer): the next step fails every request with the reason, the loop ends,
    and later submissions fail with it at once, where the loop used to spin on the failing step (unanswered requests,
    /health still ok)."""
    llm = LLM(llama_path, device="cpu", dtype="float32", tp_size=2, dist_timeout=30)
    loop = EngineLoop(llm.engine)
    loop.start()
    try:
        assert drain(submit(loop, [5, 6, 7], 4))[-1].finish_reason == "length"
        follower = llm.engine.lockstep.followers[0]
        follower.kill()
        follower.join(timeout=30)
        last = submit(loop, [5, 6, 7], 4).get(timeout=30)
        assert last.finish_reason == "error" and "tensor-parallel rank 1 exited" in last.error
        loop._thread.join(timeout=60)
        assert not loop.alive and "rank 1 exited" in loop.failure
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            loop.submit(Submission([[1, 2]], [SamplingParams(max_new_tokens=2)], lambda i, e: None)).result(timeout=5)
    finally:
        loop.stop()
