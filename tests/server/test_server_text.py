"""What the server's answers read as, beyond the byte-level tokenizer of test_server.py: a SentencePiece-style
(Metaspace) model, whose decoder strips the leading space of a text's first piece, and a server without a
tokenizer (--skip-tokenizer-init), whose answers are token ids. Each against the offline LLM on the same model."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import assert_engine_clean
from hyperdraft import LLM, SamplingParams
from hyperdraft.testing.tiny import make_tiny_model
from helpers.real_tokenizers import metaspace  # noqa: F401 (a fixture)
from helpers.server_fixtures import ServerProcess, wait_engine_idle

PROMPTS = ["The fox jumps", "Le café", "twice: fox", "naïve"]


@pytest.fixture(scope="module")
def sp_model(metaspace, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("sp") / "model")
    make_tiny_model(path, "llama", with_tokenizer=False, vocab_size=len(metaspace), eos_token_id=metaspace.eos_token_id)
    metaspace.save_pretrained(path)
    return path


def _offline(path: str, prompts, **engine_args) -> list:
    llm = LLM(path, device="cpu", dtype="float32", **engine_args)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True), use_tqdm=False)
    assert_engine_clean(llm)
    llm.shutdown()
    return outs


def _sse_chunks(r: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_sentencepiece_answers_read_as_the_prompt_continued(sp_model, metaspace):
    """Found by an audit: each answer was decoded with no prompt context, so its first word lost its space ("The
    fox jumpsover" with echo), a stop string starting with a space never matched there, and the logprob tokens
    dropped the space of every "▁" piece. Now text, echo, stop and logprob tokens read as decode(prompt + answer)
    past the prompt, as SGLang and vLLM give them."""
    refs = _offline(sp_model, PROMPTS)
    with ServerProcess(sp_model) as srv:
        spaced = 0
        for prompt, ref in zip(PROMPTS, refs):
            ids = metaspace.encode(prompt)
            want = metaspace.decode(ids + ref.token_ids, skip_special_tokens=True)[len(metaspace.decode(ids)):]
            body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            out = httpx.post(srv.url + "/v1/completions", json={**body, "echo": True}, timeout=60).json()["choices"][0]
            assert out["text"] == prompt + want == prompt + ref.text, (prompt, ref.token_ids)
            plain = httpx.post(srv.url + "/v1/completions", json={**body, "logprobs": 0}, timeout=60).json()["choices"][0]
            # logprob tokens show special tokens (<unk> here), which the text skips
            assert "".join(plain["logprobs"]["tokens"]).replace("<unk>", "") == want
            assert plain["logprobs"]["text_offset"][0] == 0
            streamed = httpx.post(srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
            assert "".join(c["choices"][0]["text"] for c in _sse_chunks(streamed)) == want
            if want.startswith(" ") and len(want) > 3:
                spaced += 1
                stop = want[:3]  # " jum", say: it begins at the answer's first character
                cut = httpx.post(srv.url + "/v1/completions", json={**body, "stop": [stop]}, timeout=60).json()
                assert (cut["choices"][0]["text"], cut["choices"][0]["finish_reason"]) == ("", "stop")
        assert spaced > 0
        wait_engine_idle(srv.url)


def test_a_server_without_a_tokenizer_answers_token_ids(llama_path):
    """--skip-tokenizer-init: answers had neither text nor ids (an empty text, empty logprob tokens), so a client
    could not see what was generated. Now each choice and stream chunk carries token_ids, and logprob tokens are
    vLLM's "token_id:N"."""
    prompts = [[5, 6, 7], [9, 3, 8, 1, 2]]
    llm = LLM(llama_path, device="cpu", dtype="float32", skip_tokenizer_init=True)
    refs = llm.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=10,
                                                                          ignore_eos=True), use_tqdm=False)
    assert_engine_clean(llm)
    llm.shutdown()
    with ServerProcess(llama_path, "--skip-tokenizer-init") as srv:
        for prompt, ref in zip(prompts, refs):
            body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 0}
            out = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
            assert out["token_ids"] == ref.token_ids and out["text"] == ""
            assert out["logprobs"]["tokens"] == [f"token_id:{t}" for t in ref.token_ids]
            streamed = httpx.post(srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
            assert [t for c in _sse_chunks(streamed) for t in c["choices"][0].get("token_ids", [])] == ref.token_ids
        wait_engine_idle(srv.url)
