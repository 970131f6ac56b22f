"""The server under speculative decoding (NGRAM and STANDALONE), the queue limit, and lossy benchmark mode.

A speculative step emits several tokens at once; streamed, non-streamed and offline (speculation off) text must
still be identical at temperature 0, and /metrics must count every verify, draft and acceptance consistently.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys

import httpx
import openai
import pytest

from conftest import assert_engine_clean
from hyperdraft import LLM, SamplingParams
from helpers.server_fixtures import (WORDS, ServerProcess, add_chat_template, free_port, prompts, scrape_metrics,
                                    served_name, split_characters, stream_text, wait_engine_idle)
from helpers.spec_fixtures import spec_models  # noqa: F401 - the session fixture

NUM_STEPS = 4
ALGORITHMS = ("NGRAM", "STANDALONE")
REPETITIVE = ["1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2", "the quick fox the quick fox the quick", "你好 世界 你好 世界 你好"]


@pytest.fixture(scope="module")
def target(spec_models, tmp_path_factory) -> str:  # noqa: F811
    return add_chat_template(shutil.copytree(spec_models["target"], str(tmp_path_factory.mktemp("spec_srv") / "t")))


def spec_flags(algorithm: str, spec_models) -> list[str]:  # noqa: F811
    flags = ["--speculative-algorithm", algorithm, "--speculative-num-steps", str(NUM_STEPS)]
    if algorithm == "STANDALONE":  # agrees with the target often but not always: accept lengths vary
        flags += ["--speculative-draft-model-path", spec_models["draft_wide_noisy"]]
    return flags


@pytest.fixture(scope="module")
def servers(target, spec_models):  # noqa: F811
    """One server per algorithm; the NGRAM one also has tight admission limits for the queue test."""
    started: dict[str, ServerProcess] = {}
    try:
        started["NGRAM"] = ServerProcess(target, *spec_flags("NGRAM", spec_models), "--max-running-requests", "2",
                                         "--max-queued-requests", "2")
        started["STANDALONE"] = ServerProcess(target, *spec_flags("STANDALONE", spec_models))
        yield started
        for srv in started.values():
            srv.assert_alive()
    finally:
        graceful = {name: srv.stop() for name, srv in started.items()}
    assert all(graceful.values()), graceful


@pytest.fixture(scope="module")
def offline(target):
    llm = LLM(target, device="cpu", dtype="float32")  # speculation off: lossless means identical text
    yield llm
    assert_engine_clean(llm)
    llm.shutdown()


@pytest.fixture(autouse=True)
def _idle_after(request):
    yield
    if "servers" in request.fixturenames:
        for srv in request.getfixturevalue("servers").values():
            srv.assert_alive()
            wait_engine_idle(srv.url)


def metrics(url: str) -> dict[str, float]:
    return scrape_metrics(url)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_spec_stream_equals_nonstream_and_offline(servers, offline, target, algorithm):
    url = servers[algorithm].url
    texts = REPETITIVE + prompts(5, seed=11)
    refs = offline.generate(texts, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True), use_tqdm=False)
    assert any(split_characters(offline.tokenizer, r.token_ids) for r in refs), "precondition: a split character"
    before = metrics(url)
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        for text, ref in zip(texts, refs):
            kw = dict(model=served_name(target), prompt=text, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
            assert client.completions.create(**kw).choices[0].text == ref.text
            assert stream_text(client.completions.create(stream=True, **kw)) == (ref.text, "length")
        messages = [{"role": "user", "content": " ".join(WORDS)}]
        chat_ref = offline.chat(messages, SamplingParams(temperature=0, max_new_tokens=30), use_tqdm=False)
        chat = client.chat.completions.create(model=served_name(target), messages=messages, max_tokens=30, temperature=0)
        assert chat.choices[0].message.content == chat_ref.text
        stream = client.chat.completions.create(model=served_name(target), messages=messages, max_tokens=30, temperature=0,
                                                stream=True)
        assert "".join(c.delta.content or "" for ch in stream for c in ch.choices) == chat_ref.text
    after = metrics(url)
    # not vacuous: some verifies really emitted several tokens in one step
    def multi_token_verifies(m: dict) -> float:
        bucket = "hyperdraft_spec_accept_length_bucket"
        return m[bucket + '{"le": "+Inf"}'] - m[bucket + '{"le": "1.0"}']

    assert multi_token_verifies(after) > multi_token_verifies(before)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_spec_metrics_count_one_request_consistently(servers, target, algorithm):
    url = servers[algorithm].url
    before = metrics(url)
    body = {"model": served_name(target), "prompt": REPETITIVE[0], "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    after = metrics(url)
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    completion = out["usage"]["completion_tokens"]
    assert completion == 32
    verifies, emitted = d["hyperdraft_spec_verifies_total"], d["hyperdraft_spec_emitted_tokens_total"]
    assert verifies == d["hyperdraft_spec_verify_steps_total"] > 0  # alone: one request-verify per verify step
    assert emitted == d["hyperdraft_spec_accepted_tokens_total"] + verifies
    assert 0 < d["hyperdraft_spec_accepted_tokens_total"] <= d["hyperdraft_spec_draft_tokens_total"]
    # the prefill samples the first token; verifies emit the rest (the last one may overshoot max_tokens)
    assert completion - 1 <= emitted <= completion - 1 + NUM_STEPS
    assert d["hyperdraft_spec_accept_length_count"] == verifies
    assert d["hyperdraft_spec_accept_length_sum"] == emitted
    accepted_by_pos = [d[f'hyperdraft_spec_position_accepted_total{{"position": "{p}"}}'] for p in range(NUM_STEPS)]
    proposed_by_pos = [d[f'hyperdraft_spec_position_proposed_total{{"position": "{p}"}}'] for p in range(NUM_STEPS)]
    assert sum(accepted_by_pos) == d["hyperdraft_spec_accepted_tokens_total"]
    assert sum(proposed_by_pos) == d["hyperdraft_spec_draft_tokens_total"]
    assert all(a <= p for a, p in zip(accepted_by_pos, proposed_by_pos))
    assert accepted_by_pos == sorted(accepted_by_pos, reverse=True)  # position j is reached only after j-1 accepted
    assert after["hyperdraft_spec_tier_num_steps"] == NUM_STEPS and after["hyperdraft_spec_tier_topk"] == 1
    state = httpx.get(url + "/server_info", timeout=30).json()["internal_states"][0]
    assert state["speculative_num_steps"] == NUM_STEPS
    assert state["avg_spec_accept_length"] == pytest.approx(after["hyperdraft_spec_avg_accept_length"])
    assert state["avg_spec_accept_length"] == pytest.approx(
        after["hyperdraft_spec_emitted_tokens_total"] / after["hyperdraft_spec_verifies_total"])


def test_queue_limit_answers_503_and_drops_nothing(servers, offline, target):
    """--max-running-requests 2 --max-queued-requests 2: two run, two wait, the fifth is refused with a 503."""
    url = servers["NGRAM"].url
    long = {"model": served_name(target), "prompt": "hello", "max_tokens": 450, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as http:
        streams = [http.stream("POST", url + "/v1/completions", json=long) for _ in range(4)]
        responses = [s.__enter__() for s in streams]
        try:
            assert [r.status_code for r in responses] == [200] * 4  # accepted: running or queued
            state = httpx.get(url + "/server_info", timeout=30).json()["internal_states"][0]
            assert (state["num_running_reqs"], state["num_waiting_reqs"]) == (2, 2)
            refused = httpx.post(url + "/v1/completions", json={**long, "stream": False}, timeout=30)
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["code"] == "queue_full" and "max-queued-requests" in error["message"]
            assert set(error) == {"message", "type", "param", "code"}
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    wait_engine_idle(url)
    ok = httpx.post(url + "/v1/completions", json={"model": served_name(target), "prompt": "hello", "max_tokens": 8,
                                                  "temperature": 0}, timeout=60)
    ref = offline.generate("hello", SamplingParams(temperature=0, max_new_tokens=8), use_tqdm=False)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == ref.text
    assert metrics(url)['hyperdraft_http_errors_total{"status": "503"}'] == 1


def test_an_address_that_cannot_be_bound_is_refused_before_the_model_loads(tmp_path):
    """--host that does not resolve, or a --port another process listens on, is refused by flag (exit 2) before the
    model loads: the model path here does not exist, so a load first would have named it instead."""
    missing = str(tmp_path / "no-model")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags, said in [(["--host", "no-such-host.invalid", "--port", str(free_port())],  # RFC 6761: never resolves
                             "--host 'no-such-host.invalid' is not an address"),
                            (["--port", str(port)], f"--host '127.0.0.1' --port {port}: cannot bind 127.0.0.1")]:
            cmd = [sys.executable, "-m", "hyperdraft", "serve", "--model", missing, *flags]
            refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            assert refused.returncode == 2 and said in refused.stderr, refused.stderr


def test_lossy_benchmark_mode_is_refused_unless_allowed_and_then_marked(target, spec_models):  # noqa: F811
    env = {**os.environ, "HYPERDRAFT_SIMULATE_ACCEPT_RATE": "0.5"}
    cmd = [sys.executable, "-m", "hyperdraft", "serve", "--model", target, "--port", str(free_port()),
           *spec_flags("NGRAM", spec_models)]
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--allow-lossy-benchmark-mode" in refused.stderr, refused.stderr
    with ServerProcess(target, *spec_flags("NGRAM", spec_models), "--allow-lossy-benchmark-mode",
                       env={"HYPERDRAFT_SIMULATE_ACCEPT_RATE": "0.5"}) as srv:
        assert httpx.get(srv.url + "/server_info").json()["lossy_benchmark_mode"] is True
        body = {"model": served_name(target), "prompt": "hello", "max_tokens": 8, "temperature": 0}
        assert httpx.post(srv.url + "/v1/completions", json=body).json()["lossy_benchmark_mode"] is True
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as client:
            chunks = list(client.completions.create(stream=True, **body))
        assert chunks and all(ch.model_extra.get("lossy_benchmark_mode") is True for ch in chunks)
        assert metrics(srv.url)["hyperdraft_lossy_benchmark_mode"] == 1
        wait_engine_idle(srv.url)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_seeded_sampling_is_reproducible_under_speculation(servers, offline, target, algorithm):
    """A seeded temperature-0.8 request gives the same text alone, again, streamed, and among concurrent requests,
    and it is the text plain decoding gives that seed (coupled verification, the default). Before it, NGRAM's
    shared history made two identical runs differ (0 of 12 identical)."""
    url = servers[algorithm].url
    texts = REPETITIVE[:2] + prompts(2, seed=3)
    params = [SamplingParams(temperature=0.8, seed=40 + i, max_new_tokens=24, ignore_eos=True) for i in range(4)]
    refs = [r.text for r in offline.generate(texts, params, use_tqdm=False)]
    kws = [dict(model=served_name(target), prompt=t, max_tokens=24, temperature=0.8, seed=40 + i,
                extra_body={"ignore_eos": True}) for i, t in enumerate(texts)]
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        for kw, ref in zip(kws, refs):
            assert client.completions.create(**kw).choices[0].text == ref
            assert client.completions.create(**kw).choices[0].text == ref
            assert stream_text(client.completions.create(stream=True, **kw))[0] == ref
    # Under load: the seeded requests among others (the NGRAM server admits 2 running + 2 queued).
    others = 0 if algorithm == "NGRAM" else 12

    async def loaded():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
            noise = [c.completions.create(model=served_name(target), prompt=t, max_tokens=32, temperature=1.0)
                     for t in prompts(others, seed=99)]
            seeded = [c.completions.create(**kw) for kw in kws[:2]]
            return await asyncio.gather(*seeded, *noise)

    outs = asyncio.run(loaded())
    assert [o.choices[0].text for o in outs[:2]] == refs[:2]


def test_a_tensor_parallel_server_answers_as_one_rank_does(target, offline):
    """--tp-size 2: the engine thread drives rank 0, which starts and, at a graceful stop, stops its follower."""
    texts = REPETITIVE[:2] + prompts(2, seed=12)
    refs = offline.generate(texts, SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True), use_tqdm=False)
    srv = ServerProcess(target, "--tp-size", "2", "--dist-timeout", "60")
    try:
        with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            for text, ref in zip(texts, refs):
                out = client.completions.create(model=served_name(target), prompt=text, max_tokens=24, temperature=0,
                                                extra_body={"ignore_eos": True})
                assert out.choices[0].text == ref.text
        srv.assert_alive()
    finally:
        graceful = srv.stop()
    assert graceful, srv.output()[-2000:]
