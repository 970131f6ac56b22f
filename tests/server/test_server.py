"""The OpenAI-compatible server, end to end: a real `hyperdraft serve` process on 127.0.0.1 (one per module) with
a tiny model, driven by the official `openai` client (raw httpx for malformed input and disconnects).

Every answer is checked against the offline LLM on the same model: at temperature 0 (and for seeded sampling)
the text must be identical, streamed or not. After each test the engine must be idle with its KV pool free,
and the server process alive.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import time

import httpx
import openai
import pytest

from conftest import assert_engine_clean
from hyperdraft import LLM, SamplingParams
from hyperdraft.engine.gc_policy import YOUNG_THRESHOLD
from helpers.server_fixtures import (API_KEY, ServerProcess, add_chat_template, assert_idle, client_aborts, engine_state,
                                    prompts,
                                    scrape_metrics, served_name, split_characters, stream_text, wait_client_aborts,
                                    wait_engine_idle)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
FAULT_USER = "inject-a-fault"
MAX_RUNNING = 16


@pytest.fixture(scope="module")
def chat_model(llama_path, tmp_path_factory) -> str:
    return add_chat_template(shutil.copytree(llama_path, str(tmp_path_factory.mktemp("server") / "chat")))


@pytest.fixture(scope="module")
def server(chat_model):
    srv = ServerProcess(chat_model, "--api-key", API_KEY, "--max-running-requests", str(MAX_RUNNING),
                        fault_user=FAULT_USER)
    try:
        yield srv
        srv.assert_alive()
    finally:
        assert srv.stop(), "the server did not shut down gracefully"


@pytest.fixture(scope="module")
def offline(chat_model):
    llm = LLM(chat_model, device="cpu", dtype="float32", max_running_requests=MAX_RUNNING)
    yield llm
    assert_engine_clean(llm)
    llm.shutdown()


@pytest.fixture(scope="module")
def client(server, chat_model):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def _idle_after(request):
    """Every test leaves the server alive, idle, with its whole KV pool free."""
    yield
    if "server" in request.fixturenames:
        srv = request.getfixturevalue("server")
        srv.assert_alive()
        wait_engine_idle(srv.url, AUTH)


def metrics(url: str) -> dict[str, float]:
    return scrape_metrics(url, AUTH)


# ---- basics -------------------------------------------------------------------------------------------------------


def test_models_health_and_api_key(server, client, chat_model):
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed for liveness
    assert [m.id for m in client.models.list().data] == [served_name(chat_model)]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/server_info"),
                             ("GET", "/metrics")):
            r = httpx.request(method, server.url + path, headers=headers, json={"prompt": "a"})
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=served_name(chat_model), prompt="a", max_tokens=2)


def test_completions_stream_equals_nonstream_and_offline(client, offline, chat_model):
    for prompt in prompts(4, seed=1):
        ref = offline.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24), use_tqdm=False)
        out = client.completions.create(model=served_name(chat_model), prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == ref.text
        assert out.choices[0].finish_reason == ref.finish_reason
        assert out.usage.completion_tokens == len(ref.token_ids)
        assert out.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
        streamed = client.completions.create(model=served_name(chat_model), prompt=prompt, max_tokens=24, temperature=0,
                                             stream=True)
        assert stream_text(streamed) == (ref.text, ref.finish_reason)


def test_a_stop_token_shows_no_text_unless_no_stop_trim(client, offline, chat_model):
    """As SGLang: the token that ended the request (a stop id, EOS) stays in the output and the usage, and its text is
    trimmed; no_stop_trim keeps it (found by an audit: ',' as a stop id came back in the text)."""
    prompt = prompts(1, seed=5)[0]
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24), use_tqdm=False)
    k = next(k for k in range(3, len(ref.token_ids)) if ref.token_ids.index(ref.token_ids[k]) == k)
    tok, stop_id = offline.tokenizer, ref.token_ids[k]
    for keep in (False, True):
        for stream in (False, True):
            out = client.completions.create(model=served_name(chat_model), prompt=prompt, max_tokens=24,
                                            temperature=0, stream=stream,
                                            extra_body={"stop_token_ids": [stop_id], "no_stop_trim": keep})
            text, reason = stream_text(out) if stream else (out.choices[0].text, out.choices[0].finish_reason)
            assert reason == "stop" and text == tok.decode(ref.token_ids[:k + 1 if keep else k]), (keep, stream)


def test_vllm_include_stop_str_in_output_keeps_the_stop_string(client, offline, chat_model):
    """vLLM's name for no_stop_trim: it was ignored (the stop string trimmed) with a 200."""
    prompt = prompts(1, seed=5)[0]
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_new_tokens=24), use_tqdm=False)
    stop = ref.text[len(ref.text) // 2:][:3]
    assert stop and stop in ref.text
    out = client.completions.create(model=served_name(chat_model), prompt=prompt, max_tokens=24, temperature=0,
                                    stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert out.choices[0].text == ref.text[:ref.text.index(stop) + len(stop)]


def test_null_optional_fields_mean_their_defaults(server, chat_model):
    """The openai SDK sends these as null when a caller passes None; they were 400s ("should be a valid
    boolean")."""
    base = {"model": served_name(chat_model), "max_tokens": 4, "temperature": 0}
    for path, body in [("/v1/completions", {**base, "prompt": "hello", "echo": None, "stream": None}),
                       ("/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "hi"}],
                                                  "logprobs": None, "stream": None})]:
        r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"] is None


def test_completions_batch_prompts_token_ids_n_and_echo(client, offline, chat_model):
    texts = prompts(2, seed=2)
    ids = offline.tokenizer.encode(texts[0])
    out = client.completions.create(model=served_name(chat_model), prompt=texts, max_tokens=12, temperature=0.9, seed=5, n=2)
    params = [SamplingParams(temperature=0.9, seed=5 + s, max_new_tokens=12) for _ in texts for s in (0, 1)]
    refs = offline.generate([t for t in texts for _ in range(2)], params, use_tqdm=False)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert out.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    by_ids = client.completions.create(model=served_name(chat_model), prompt=ids, max_tokens=12, temperature=0.9, seed=5)
    assert by_ids.choices[0].text == refs[0].text  # a token-id prompt is the same request
    echoed = client.completions.create(model=served_name(chat_model), prompt=texts[0], max_tokens=12, temperature=0.9, seed=5,
                                       echo=True, stream=True, stream_options={"include_usage": True})
    chunks = list(echoed)
    assert "".join(c.text for ch in chunks for c in ch.choices) == texts[0] + refs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(refs[0].token_ids)


def test_stop_string_is_never_streamed(client, offline, chat_model):
    prompt = prompts(1, seed=3)[0]
    full = offline.generate(prompt, SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True), use_tqdm=False)
    stop = full.text[10:13]  # a piece of the real continuation: generation must stop there
    ref = offline.generate(prompt, SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)
    assert ref.finish_reason == "stop" and stop not in ref.text
    streamed = client.completions.create(model=served_name(chat_model), prompt=prompt, max_tokens=32, temperature=0, stop=stop,
                                         extra_body={"ignore_eos": True}, stream=True)
    assert stream_text(streamed) == (ref.text, "stop")


def test_multibyte_characters_split_across_tokens_stream_intact(client, offline, chat_model):
    """A character whose bytes come from two tokens (two steps, without speculation) is streamed once, whole."""
    tok = offline.tokenizer
    candidates = prompts(8, seed=4)
    refs = offline.generate(candidates, SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True),
                            use_tqdm=False)
    split = [(p, r) for p, r in zip(candidates, refs) if split_characters(tok, r.token_ids)]
    assert split, "precondition: some reference output must hold a character split across tokens"
    for prompt, ref in split:
        streamed = client.completions.create(model=served_name(chat_model), prompt=prompt, max_tokens=40, temperature=0,
                                             extra_body={"ignore_eos": True}, stream=True)
        assert stream_text(streamed)[0] == ref.text


def test_chat_stream_equals_nonstream_and_offline_with_logprobs(client, offline, chat_model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "你好, how are you?"}]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_new_tokens=20, return_logprob=True), use_tqdm=False)
    out = client.chat.completions.create(model=served_name(chat_model), messages=messages, max_tokens=20, temperature=0,
                                         logprobs=True)
    assert out.choices[0].message.content == ref.text and out.choices[0].message.role == "assistant"
    got = [t.logprob for t in out.choices[0].logprobs.content]
    assert got == pytest.approx(ref.meta_info["output_token_logprobs"], abs=1e-4)
    stream = client.chat.completions.create(model=served_name(chat_model), messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for ch in chunks for c in ch.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    # no max_tokens: the rest of the context, as OpenAI's chat does
    long = client.chat.completions.create(model=served_name(chat_model), messages=messages, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert long.usage.prompt_tokens + long.usage.completion_tokens == offline.engine.context_len
    assert long.choices[0].finish_reason == "length"


# ---- load -----------------------------------------------------------------------------------------------------------


def test_64_concurrent_requests_half_streaming_match_offline(server, offline, chat_model):
    texts = prompts(64, seed=5)
    lengths = [8 + (i * 7) % 33 for i in range(64)]
    sampled = [i % 4 == 3 for i in range(64)]  # a quarter use seeded sampling, the rest greedy
    params = [SamplingParams(temperature=0.8 if s else 0.0, seed=100 + i, max_new_tokens=n, ignore_eos=True)
              for i, (n, s) in enumerate(zip(lengths, sampled))]
    refs = offline.generate(texts, params, use_tqdm=False)

    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        kw = dict(model=served_name(chat_model), prompt=texts[i], max_tokens=lengths[i], temperature=params[i].temperature,
                  seed=100 + i, extra_body={"ignore_eos": True})
        if i % 2:
            return (await c.completions.create(**kw)).choices[0].text
        return "".join([ch.choices[0].text async for ch in await c.completions.create(stream=True, **kw)])

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    outs = asyncio.run(run())
    assert [i for i in range(64) if outs[i] != refs[i].text] == []
    wait_engine_idle(server.url, AUTH)


# ---- disconnects and failures ---------------------------------------------------------------------------------------


def test_disconnect_mid_stream_aborts_and_frees_kv(server, client, offline, chat_model):
    before, aborts, log_from = metrics(server.url), client_aborts(server.url, AUTH), len(server.output())
    body = {"model": served_name(chat_model), "prompt": "hello", "max_tokens": 450, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # the request is running
            # another request, running alongside, is unaffected by the disconnect below
            other = client.completions.create(model=served_name(chat_model), prompt="the quick", max_tokens=8, temperature=0)
        # leaving the block closed the connection mid-stream
    ref = offline.generate("the quick", SamplingParams(temperature=0, max_new_tokens=8), use_tqdm=False)
    assert other.choices[0].text == ref.text
    assert_idle(wait_client_aborts(server.url, aborts + 1, AUTH))  # KV freed by the abort itself
    after = metrics(server.url)
    aborted = 'hyperdraft_requests_finished_total{"reason": "abort"}'
    assert after[aborted] == before[aborted] + 1
    assert after["hyperdraft_generation_tokens_total"] - before["hyperdraft_generation_tokens_total"] == 8
    assert_client_closed_not_failed(server, before, after, log_from)


def assert_client_closed_not_failed(server, before: dict, after: dict, log_from: int) -> None:
    """A disconnect is counted as 499 (client closed), never as a 500, and logs no traceback (in the server's log
    from offset log_from on)."""
    closed, failed = 'hyperdraft_http_errors_total{"status": "499"}', 'hyperdraft_http_errors_total{"status": "500"}'
    assert after.get(closed, 0) == before.get(closed, 0) + 1
    assert after.get(failed, 0) == before.get(failed, 0)
    log = server.output()[log_from:]
    assert "Traceback" not in log and "InvalidStateError" not in log, log


def test_disconnect_while_sending_the_body_is_a_499(server):
    """A client gone before its body arrived whole was logged with a traceback and counted as a 500."""
    import socket

    before, log_from = metrics(server.url), len(server.output())
    host, port = server.url.removeprefix("http://").split(":")
    body = b'{"prompt": "hello", "max_tokens": 4}'
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body) + 10}\r\n\r\n".encode() + body)
    for _ in range(100):  # the server notices the closed socket asynchronously
        after = metrics(server.url)
        if after.get('hyperdraft_http_errors_total{"status": "499"}', 0) > before.get(
                'hyperdraft_http_errors_total{"status": "499"}', 0):
            break
        time.sleep(0.05)
    assert_client_closed_not_failed(server, before, after, log_from)


def test_disconnect_before_a_nonstream_answer_aborts(server, chat_model):
    before, aborts, log_from = metrics(server.url), client_aborts(server.url, AUTH), len(server.output())
    body = {"model": served_name(chat_model), "prompt": "hello", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "n": 4}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 4 x 500 tokens are done
        httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=httpx.Timeout(60, read=0.3))
    assert_idle(wait_client_aborts(server.url, aborts + 4, AUTH))  # all four choices, KV freed by the aborts
    after = metrics(server.url)
    aborted = 'hyperdraft_requests_finished_total{"reason": "abort"}'
    assert after[aborted] == before[aborted] + 4
    assert after["hyperdraft_generation_tokens_total"] == before["hyperdraft_generation_tokens_total"]
    assert_client_closed_not_failed(server, before, after, log_from)


def test_internal_error_fails_only_its_request(server, offline, chat_model):
    texts = prompts(3, seed=6)
    refs = offline.generate(texts, SamplingParams(temperature=0, max_new_tokens=16), use_tqdm=False)

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0) as c:
            async def good(t):
                out = await c.completions.create(model=served_name(chat_model), prompt=t, max_tokens=16, temperature=0)
                return out.choices[0].text

            async def bad_stream():
                stream = await c.completions.create(model=served_name(chat_model), prompt="x", max_tokens=16, user=FAULT_USER,
                                                    stream=True)
                return [ch async for ch in stream]

            bad = c.completions.create(model=served_name(chat_model), prompt="x", max_tokens=16, user=FAULT_USER)
            return await asyncio.gather(bad, bad_stream(), *(good(t) for t in texts), return_exceptions=True)

    bad, bad_stream, *good = asyncio.run(run())
    assert isinstance(bad, openai.InternalServerError) and bad.status_code == 500, bad
    assert bad.body["code"] == "internal_error" and "fault injected" in bad.body["message"]
    assert isinstance(bad_stream, openai.APIError) and "fault injected" in str(bad_stream), bad_stream
    assert good == [r.text for r in refs]


# ---- errors -------------------------------------------------------------------------------------------------------

BAD_COMPLETIONS = [  # (body, status, param, code)
    (b'{"prompt": "a", "max_tokens": ', 400, None, "invalid_json"),
    (b'["prompt"]', 400, None, "invalid_type"),
    ({"prompt": "a", "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ({"prompt": "a", "max_tokens": "ten"}, 400, "max_tokens", "invalid_type"),
    ({"prompt": "a", "temperature": -1}, 400, "temperature", "invalid_value"),
    ({"prompt": "a", "top_p": 2}, 400, "top_p", "invalid_value"),
    ({"prompt": "a", "n": 0}, 400, "n", "invalid_value"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream", "invalid_type"),
    ({"prompt": "a", "stop_token_ids": [100000]}, 400, "stop_token_ids", "invalid_value"),
    ({"prompt": "a", "seed": 2**70}, 400, "seed", "invalid_value"),  # would overflow an int64 inside the step
    ({"prompt": "a", "top_k": 10**30}, 400, "top_k", "invalid_value"),
    ({"prompt": [5, 100000]}, 400, "prompt", "invalid_value"),
    ({"prompt": []}, 400, "prompt", "invalid_value"),
    ({"prompt": {"text": "a"}}, 400, "prompt", "invalid_type"),
    ({"max_tokens": 4}, 400, "prompt", "missing_required_parameter"),
    ({"prompt": "a " * 4000}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "a", "logprobs": 3}, 400, "logprobs", "unsupported_parameter"),
    ({"prompt": "a", "model": "gpt-9"}, 404, "model", "model_not_found"),
    # were 500s: ids decoded for the echo before they were checked, and float limits that JSON allows
    ({"prompt": [-331, 192], "echo": True}, 400, "prompt", "invalid_value"),
    ({"prompt": [4294967296]}, 400, "prompt", "invalid_value"),
    ({"prompt": [[1, 2], [3, -1]], "echo": True}, 400, "prompt", "invalid_value"),
    ({"prompt": "a", "repetition_penalty": 5e-324, "logprobs": 0}, 400, "repetition_penalty", "invalid_value"),
    ({"prompt": "a", "repetition_penalty": 0.0}, 400, "repetition_penalty", "invalid_value"),
    (b'{"prompt": "a", "temperature": Infinity}', 400, "temperature", "invalid_value"),
    (b'{"prompt": "a", "repetition_penalty": Infinity}', 400, "repetition_penalty", "invalid_value"),
    (b'{"prompt": "a", "top_p": NaN}', 400, "top_p", "invalid_value"),
    ({"prompt": "a", "stop": ["zq"] * 65}, 400, "stop", "invalid_value"),  # 110,000 held the event loop 45 s
    ({"prompt": "a", "stop": "z" * 257}, 400, "stop", "invalid_value"),
    # output constraints of SGLang and vLLM were accepted and ignored (found by an audit)
    ({"prompt": "a", "regex": "[0-9]+"}, 400, "regex", "unsupported_parameter"),
    ({"prompt": "a", "json_schema": "{}"}, 400, "json_schema", "unsupported_parameter"),
    ({"prompt": "a", "guided_choice": ["yes", "no"]}, 400, "guided_choice", "unsupported_parameter"),
    ({"prompt": "a", "min_tokens": 5}, 400, "min_tokens", "unsupported_parameter"),
    # the prompt plus max_tokens past the context: was cut at the context (10**9 ran for minutes)
    ({"prompt": "a", "max_tokens": 10**9}, 400, "max_tokens", "context_length_exceeded"),
    # vLLM's fields that change the output were ignored, with a 200 (found by an audit)
    ({"prompt": "a", "allowed_token_ids": [5, 6]}, 400, "allowed_token_ids", "unsupported_parameter"),
    ({"prompt": "a", "bad_words": ["x"]}, 400, "bad_words", "unsupported_parameter"),
    ({"prompt": "a", "use_beam_search": True}, 400, "use_beam_search", "unsupported_parameter"),
    ({"prompt": "a", "prompt_logprobs": 0}, 400, "prompt_logprobs", "unsupported_parameter"),
]
BAD_CHATS = [
    ({"messages": []}, 400, "messages", "invalid_value"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0].role", "missing_required_parameter"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, 400, "messages", "invalid_value"),  # the template raises
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}, 400, "top_logprobs",
     "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi " * 4000}]}, 400, "messages", "context_length_exceeded"),
    # were blamed on messages ("got multiple values for keyword argument 'tokenize'")
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs", "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"add_generation_prompt": False}},
     400, "chat_template_kwargs", "invalid_value"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400, "tool_choice",
     "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}, 400, "functions",
     "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}], "guided_json": {"type": "object"}}, 400, "guided_json",
     "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**9}, 400, "max_completion_tokens",
     "context_length_exceeded"),
    ({"messages": [{"role": "assistant", "content": "Once"}], "continue_final_message": True,
      "add_generation_prompt": False}, 400, "continue_final_message", "unsupported_parameter"),
]


@pytest.mark.parametrize("path, case", [("/v1/completions", c) for c in BAD_COMPLETIONS]
                         + [("/v1/chat/completions", c) for c in BAD_CHATS])
def test_bad_input_gets_an_openai_error_naming_the_field(server, path, case):
    body, status, param, code = case
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code), error
    assert error["type"] == "invalid_request_error"


def test_a_seed_too_large_for_n_choices_names_the_value_sent(server):
    """Choice i samples with seed + i; the error named seed + 1 = 2**63, a value the client never sent."""
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "seed": 2**63 - 1, "n": 2}, headers=AUTH,
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    assert str(2**63) not in r.json()["error"]["message"] and f"got {2**63 - 1}" in r.json()["error"]["message"]


def test_no_filesystem_path_leaves_the_server(server, client, chat_model):
    """The model is named by its base name (--served-model-name overrides it); the directory never appears."""
    assert [m.id for m in client.models.list().data] == [served_name(chat_model)]
    answers = [httpx.get(server.url + "/v1/models", headers=AUTH).text,
               httpx.get(server.url + "/server_info", headers=AUTH).text,
               httpx.post(server.url + "/v1/completions", json={"prompt": "a", "model": "nope"}, headers=AUTH).text,
               httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, headers=AUTH).text]
    parent = os.path.dirname(os.path.normpath(chat_model))
    for text in answers:
        assert parent not in text and parent.replace("/", "\\/") not in text, text


def test_405_names_the_allowed_methods(server):
    r = httpx.delete(server.url + "/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "POST", (r.status_code, r.headers)
    assert r.json()["error"]["message"]
    r = httpx.post(server.url + "/health")
    assert r.status_code == 405 and r.headers["allow"] == "GET"


def test_openai_client_sees_the_field_in_a_400(client, chat_model):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=served_name(chat_model), prompt="a", max_tokens=4, temperature=-1)
    assert err.value.param == "temperature" and "temperature" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "a"}])


# ---- metrics --------------------------------------------------------------------------------------------------------


def test_prefix_cache_usage_metrics_and_flush(server, client, chat_model):
    """A repeated prompt is served from the prefix cache: usage.prompt_tokens_details.cached_tokens, the hit and
    lookup counters of /metrics and the cache size in /server_info say so; POST /flush_cache empties it."""
    prompt = " ".join(f"word{i}" for i in range(40))
    before = metrics(server.url)
    first = client.completions.create(model=served_name(chat_model), prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=served_name(chat_model), prompt=prompt, max_tokens=4, temperature=0)
    assert second.choices[0].text == first.choices[0].text
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and first.usage.prompt_tokens_details.cached_tokens <= cached
    after = metrics(server.url)
    assert after["hyperdraft_cache_hit_tokens_total"] - before.get("hyperdraft_cache_hit_tokens_total", 0) >= cached
    assert after["hyperdraft_cache_lookup_tokens_total"] > 0 and 0 < after["hyperdraft_cache_hit_rate"] <= 1
    assert after["hyperdraft_cache_tokens"] >= cached and "hyperdraft_cache_evicted_tokens_total" in after
    state = wait_engine_idle(server.url, AUTH)
    assert state["radix_cache"] is True and state["cache_tokens"] >= cached
    assert httpx.post(server.url + "/flush_cache").status_code == 401
    r = httpx.post(server.url + "/flush_cache", headers=AUTH)
    assert r.status_code == 200, r.text
    state = engine_state(server.url, AUTH)
    assert state["cache_tokens"] == 0 and state["kv_free_tokens"] == state["kv_capacity_tokens"]
    chat = client.chat.completions.create(model=served_name(chat_model), messages=[{"role": "user", "content": prompt}],
                                          max_tokens=2, temperature=0)
    assert chat.usage.prompt_tokens_details.cached_tokens == 0  # just flushed


def test_metrics_parse_and_count_a_request(server, client, chat_model):
    before = metrics(server.url)
    out = client.completions.create(model=served_name(chat_model), prompt="hello there", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = metrics(server.url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["hyperdraft_requests_received_total"] == 1
    assert delta['hyperdraft_requests_finished_total{"reason": "length"}'] == 1
    assert delta["hyperdraft_generation_tokens_total"] == out.usage.completion_tokens == 12
    assert delta["hyperdraft_prompt_tokens_total"] == out.usage.prompt_tokens
    assert delta["hyperdraft_time_to_first_token_seconds_count"] == 1
    assert delta["hyperdraft_e2e_request_latency_seconds_count"] == 1
    assert delta["hyperdraft_inter_token_latency_seconds_count"] == 11  # one gap per token after the first
    assert after["hyperdraft_num_running_reqs"] == after["hyperdraft_num_waiting_reqs"] == 0
    assert after["hyperdraft_kv_usage"] == 0 and after["hyperdraft_kv_capacity_tokens"] > 0
    assert after["hyperdraft_lossy_benchmark_mode"] == 0
    assert not any(k.startswith("hyperdraft_spec_") for k in after)  # no speculation on this server
    info = httpx.get(server.url + "/server_info", headers=AUTH).json()
    assert info["model_path"] == served_name(chat_model) and info["lossy_benchmark_mode"] is False
    assert info["max_running_requests"] == MAX_RUNNING
    old_route = httpx.get(server.url + "/get_server_info", headers=AUTH).json()  # SGLang's older name, kept by it
    assert old_route["model_path"] == info["model_path"] and old_route["context_length"] == info["context_length"] > 0
    assert info["enable_deterministic_inference"] is False  # the mode: docs/numerics.md
    assert info["internal_states"][0]["numerics"] == "float32"
    # the startup heap is frozen out of the cyclic GC's walks (engine/gc_policy.py): a tiny model's process holds
    # ~1e5 objects then, and none would be frozen otherwise; the youngest generation waits for YOUNG_THRESHOLD
    assert info["gc_frozen_objects"] > 10_000, info["gc_frozen_objects"]
    assert info["gc_thresholds"][0] == YOUNG_THRESHOLD != gc.get_threshold()[0], info["gc_thresholds"]
