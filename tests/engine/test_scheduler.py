"""Scheduler behaviour: retraction under KV pressure, batch invariance, no lost or duplicated requests, abort."""

from __future__ import annotations

import pytest

from conftest import assert_engine_clean, generate_ids, greedy, hf_greedy, random_prompts, run_until_done
from hyperdraft import SamplingParams

LENGTHS = [20, 35, 12, 40, 28, 17, 33, 25]
NEW = 40


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS, seed=10)


@pytest.fixture(scope="module")
def reference(llama_path, prompts):
    """Greedy outputs of every prompt, from transformers."""
    return hf_greedy(llama_path, prompts, NEW)


@pytest.mark.parametrize("page_size,chunk", [(1, None), (4, None), (3, 16), (16, 24)])
def test_retraction_outputs_match_big_pool(llama_path, make_llm, prompts, reference, page_size, chunk):
    # Room for about two requests at full length (prompt + NEW), eight requests submitted together.
    small = make_llm(llama_path, page_size=page_size, max_total_tokens=2 * (max(LENGTHS) + NEW),
                     chunked_prefill_size=chunk)
    outs = generate_ids(small, prompts, greedy(NEW))
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert sum(o.meta_info["num_retractions"] for o in outs) > 0, "the pool was meant to be too small: no retraction"
    big = make_llm(llama_path, page_size=page_size, chunked_prefill_size=chunk)
    big_outs = generate_ids(big, prompts, greedy(NEW))
    assert [o.token_ids for o in big_outs] == reference
    assert all(o.meta_info["num_retractions"] == 0 for o in big_outs)


def test_retraction_seeded_sampling_matches_big_pool(llama_path, make_llm, prompts):
    """Sampling draws depend only on (seed, position): recompute after retraction samples the same tokens."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_new_tokens=NEW, ignore_eos=True)
              for i in range(len(prompts))]
    small = make_llm(llama_path, page_size=2, max_total_tokens=2 * (max(LENGTHS) + NEW))
    outs = generate_ids(small, prompts, params)
    assert sum(o.meta_info["num_retractions"] for o in outs) > 0
    big = make_llm(llama_path, page_size=2)
    assert [o.token_ids for o in outs] == [o.token_ids for o in generate_ids(big, prompts, params)]


def test_batch_invariance(llama_path, make_llm, prompts, reference):
    """Same outputs whether requests run all together, one at a time, two at a time, or staggered."""
    lengths = [NEW - 3 * i for i in range(len(prompts))]  # requests finish at different steps
    params = [greedy(n) for n in lengths]
    expect = [ref[:n] for ref, n in zip(reference, lengths)]

    together = make_llm(llama_path, page_size=4)
    assert [o.token_ids for o in generate_ids(together, prompts, params)] == expect

    one_by_one = make_llm(llama_path, page_size=4)
    assert [generate_ids(one_by_one, [p], [sp])[0].token_ids for p, sp in zip(prompts, params)] == expect

    two = make_llm(llama_path, page_size=4, max_running_requests=2, chunked_prefill_size=32)
    assert [o.token_ids for o in generate_ids(two, prompts, params)] == expect

    # Staggered: new requests join a batch whose other members are mid-decode.
    staggered = make_llm(llama_path, page_size=5)
    reqs = []
    for p, sp in zip(prompts, params):
        reqs.append(staggered.engine.add_request(input_ids=p, params=sp))
        for _ in range(3):
            staggered.engine.step()
    run_until_done(staggered, reqs)
    assert [r.output_ids for r in reqs] == expect


def test_no_request_lost_or_duplicated(llama_path, make_llm):
    """Many requests through a small pool and few rows: every output once, in submission order."""
    lengths = [1, 9, 3, 27, 14, 5, 40, 2, 18, 33, 7, 11]
    prompts = random_prompts(lengths, seed=11)
    params = [greedy(5 + (i % 4) * 6) for i in range(len(prompts))]
    llm = make_llm(llama_path, page_size=2, max_total_tokens=96, max_running_requests=3, chunked_prefill_size=20)
    outs = generate_ids(llm, prompts, params)
    assert len(outs) == len(prompts)
    assert [o.meta_info["prompt_tokens"] for o in outs] == lengths
    assert len({o.meta_info["id"] for o in outs}) == len(outs)
    assert [len(o.token_ids) for o in outs] == [p.max_new_tokens for p in params]
    assert [o.token_ids for o in outs] == [r[:p.max_new_tokens] for r, p in zip(hf_greedy(llama_path, prompts, 23), params)]


def test_stream_yields_each_request_once(llama_path, make_llm):
    prompts = random_prompts([4, 30, 12, 8, 21], seed=12)
    llm = make_llm(llama_path, page_size=4, max_total_tokens=80, max_running_requests=2)
    finished = []
    tokens = {i: [] for i in range(len(prompts))}
    for d in llm.stream(input_ids=prompts, sampling_params=greedy(9)):
        assert d.index not in finished, "delta after the request finished"
        tokens[d.index] += d.token_ids
        if d.finished:
            finished.append(d.index)
            assert d.output is not None and d.output.token_ids == tokens[d.index]
    assert sorted(finished) == list(range(len(prompts)))
    assert all(len(t) == 9 for t in tokens.values())


@pytest.mark.parametrize("page_size,total,length", [(16, 64, 60), (16, 64, 63), (4, 40, 39), (1, 32, 31)])
def test_prompt_that_fits_only_alone_is_admitted(llama_path, make_llm, page_size, total, length):
    """A prompt the engine accepts (len + 1 <= pool) must run, not wait forever for headroom it can never get."""
    llm = make_llm(llama_path, page_size=page_size, max_total_tokens=total)
    prompt = random_prompts([length], seed=13)[0]
    req = llm.engine.add_request(input_ids=prompt, params=greedy(total - length))
    run_until_done(llm, [req], max_steps=200)
    assert req.finish_reason == "length"
    assert req.output_ids == hf_greedy(llama_path, [prompt], total - length)[0]


def test_request_too_long_for_pool_ends_at_its_length_not_hung(llama_path, make_llm):
    """A request that would outgrow the whole pool on its own ends with finish_reason 'length' (SGLang's max_req_len:
    the smaller of the context and the pool; it was 'abort', which no OpenAI client expects); the others finish."""
    llm = make_llm(llama_path, page_size=4, max_total_tokens=48)
    prompts = random_prompts([30, 6, 10], seed=14)
    outs = generate_ids(llm, prompts, [greedy(40), greedy(8), greedy(8)])
    assert outs[0].finish_reason == "length"
    ref = hf_greedy(llama_path, prompts, 40)
    assert outs[0].token_ids == ref[0][:len(outs[0].token_ids)]
    # It ran until its sequence filled the 48 slots plus the newest token, which needs no slot.
    assert 30 + len(outs[0].token_ids) == 48 + 1
    assert [o.token_ids for o in outs[1:]] == [r[:8] for r in ref[1:]]
    assert all(o.finish_reason == "length" for o in outs[1:])


def test_pool_stress_every_request_finishes(llama_path, make_llm):
    """Tiny pools with mixed sizes: every request ends with "length", at its max_new_tokens or where it would outgrow
    the pool, on the reference output."""
    lengths = [5, 30, 17, 2, 25, 11, 38, 8]
    prompts = random_prompts(lengths, seed=15)
    news = [30, 12, 40, 25, 8, 33, 20, 15]
    ref = hf_greedy(llama_path, prompts, max(news))
    for page_size, total, chunk in [(1, 50, None), (4, 60, 8), (8, 72, None), (3, 45, 5)]:
        llm = make_llm(llama_path, page_size=page_size, max_total_tokens=total, chunked_prefill_size=chunk)
        reqs = [llm.engine.add_request(input_ids=p, params=greedy(n)) for p, n in zip(prompts, news)]
        run_until_done(llm, reqs)
        for r, n, expect in zip(reqs, news, ref):
            assert r.finish_reason == "length", r.finish_reason
            assert r.output_ids == expect[:len(r.output_ids)]
            if len(r.output_ids) < n:
                assert r.seq_len == total + 1, "ended although it still fits the pool"
        assert sum(len(r.output_ids) == n for r, n in zip(reqs, news)) >= len(reqs) // 2


def test_abort_running_and_waiting(llama_path, make_llm, prompts, reference):
    llm = make_llm(llama_path, page_size=4, max_running_requests=2)
    reqs = [llm.engine.add_request(input_ids=p, params=greedy(NEW)) for p in prompts[:4]]
    for _ in range(5):
        llm.engine.step()
    assert reqs[0].row is not None and reqs[3].row is None  # one running, one waiting
    assert llm.engine.abort(reqs[0].rid) is reqs[0]
    assert llm.engine.abort(reqs[3].rid) is reqs[3]
    assert llm.engine.abort("no-such-request") is None
    assert reqs[0].finish_reason == reqs[3].finish_reason == "abort"
    run_until_done(llm, reqs)
    assert [r.output_ids for r in reqs[1:3]] == reference[1:3]


def test_stream_consumer_stopping_early_aborts(llama_path, make_llm, prompts):
    llm = make_llm(llama_path, page_size=4)
    stream = llm.stream(input_ids=prompts[:3], sampling_params=greedy(NEW))
    for i, _ in enumerate(stream):
        if i == 6:
            break
    stream.close()  # runs the generator's cleanup: the three requests are aborted, their KV freed
    assert not llm.engine.has_unfinished()
    # The engine still works afterwards.
    assert generate_ids(llm, prompts[:2], greedy(5))[1].token_ids == hf_greedy(llama_path, prompts[1:2], NEW)[0][:5]


def test_stream_reads_queued_requests_only_as_they_leave_the_queue(llama_path, make_llm, prompts, reference,
                                                                  monkeypatch):
    """Eight requests, one running at a time: every output is whole and right, while the stream asks whether a
    queued request has left the queue at most once per step plus once per request (it read every unfinished request
    every step: quadratic in a large generate)."""
    import hyperdraft.llm as llm_module

    asked = []
    real = llm_module._left_queue
    monkeypatch.setattr(llm_module, "_left_queue", lambda req: asked.append(req.rid) or real(req))
    llm = make_llm(llama_path, page_size=4, max_running_requests=1)
    outs = {d.index: d.output for d in llm.stream(input_ids=prompts, sampling_params=greedy(NEW)) if d.finished}
    assert [outs[i].token_ids for i in range(len(prompts))] == reference
    steps = sum(len(p) + NEW for p in prompts)  # more than the steps taken (prefills take one step each)
    assert 0 < len(asked) <= steps + len(prompts)
    assert_engine_clean(llm)


def test_queued_request_aborted_mid_stream_ends_with_abort(llama_path, make_llm, prompts, reference):
    """A request aborted while it waits behind others (not at the queue's front) still gets its final delta."""
    llm = make_llm(llama_path, page_size=4, max_running_requests=1)
    stream = llm.stream(input_ids=prompts[:4], sampling_params=greedy(NEW))
    first = next(stream)
    waiting = [r for r in llm.engine.scheduler.waiting]
    assert len(waiting) == 3 and first.index == 0
    llm.engine.abort(waiting[1].rid)  # the third request, behind the second
    ends = {d.index: d for d in stream if d.finished}
    assert ends[2].finish_reason == "abort" and ends[2].token_ids == []
    assert [ends[i].output.token_ids for i in (1, 3)] == [reference[1], reference[3]]
    assert_engine_clean(llm)


def test_stream_stopped_early_aborts_running_and_queued(llama_path, make_llm, prompts, reference):
    llm = make_llm(llama_path, page_size=4, max_running_requests=2)
    stream = llm.stream(input_ids=prompts, sampling_params=greedy(NEW))
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert len(llm.engine.scheduler.waiting) == len(prompts) - 2
    stream.close()
    assert not llm.engine.has_unfinished()
    assert generate_ids(llm, prompts[:1], greedy(NEW))[0].token_ids == reference[0]
    assert_engine_clean(llm)


def test_abort_many_ends_exactly_those_waiting_or_running(llama_path, make_llm, prompts, reference):
    llm = make_llm(llama_path, page_size=4, max_running_requests=3)
    reqs = [llm.engine.add_request(input_ids=p, params=greedy(NEW)) for p in prompts]
    for _ in range(3):
        llm.engine.step()
    running = [r.rid for r in llm.engine.scheduler.running]
    assert len(running) == 3
    gone = {running[0], reqs[4].rid, reqs[6].rid, "no-such-request"}
    aborted = llm.engine.abort_many(sorted(gone))
    assert {r.rid for r in aborted} == gone - {"no-such-request"}
    assert all(r.finish_reason == "abort" for r in aborted)
    run_until_done(llm, reqs)
    kept = [i for i, r in enumerate(reqs) if r.rid not in gone]
    assert [reqs[i].output_ids for i in kept] == [reference[i] for i in kept]
    assert_engine_clean(llm)


def test_a_stalled_schedule_raises_instead_of_stepping_forever(llama_path, make_llm):
    """A step with requests left and nothing it can run never changes by stepping again (a scheduler bug, such as
    the hybrid snapshot-cut deadlock): it raises, naming the requests, where LLM.generate looped for good. The stall
    is made here by taking the pool's free pages away from the scheduler behind its back."""
    llm = make_llm(llama_path, page_size=4, max_total_tokens=64, chunked_prefill_size=8)
    engine = llm.engine
    req = engine.add_request(input_ids=list(range(3, 43)), params=greedy(4))  # 40 tokens: five chunks
    engine.step()
    assert 0 < req.num_computed < len(req.prompt_ids)
    table = engine.page_table
    thief = table.acquire_row()
    assert table.reserve(thief, table.num_available_slots)
    with pytest.raises(RuntimeError, match=r"scheduler stalled, a bug: nothing fits with 1 running and 0 waiting "
                                           r"requests \(running: req-0 8/40"):
        engine.step()
    table.release_row(thief)  # the pages back: the request runs on, as if nothing had happened
    while engine.has_unfinished():
        engine.step()
    assert req.finish_reason == "length" and len(req.output_ids) == 4
