"""Stopping: max_new_tokens, stop_token_ids, stop strings, EOS, the context limit; streaming equals non-streaming."""

from __future__ import annotations

import pytest

from conftest import generate_ids, greedy, random_prompts
from hyperdraft import SamplingParams

TEXT_PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Paged attention stores", "Hello, world! How are"]
REF_TOKENS = 40


@pytest.fixture(scope="module")
def llm_ref(llama_path):
    """A module-wide engine for reference runs (checked clean at the end of the module)."""
    from conftest import assert_engine_clean
    from hyperdraft import LLM

    llm = LLM(llama_path, device="cpu", dtype="float32")
    yield llm
    assert_engine_clean(llm)


@pytest.fixture(scope="module")
def refs(llm_ref):
    """Greedy reference outputs (ignore_eos, no stop conditions) of the text prompts."""
    return llm_ref.generate(TEXT_PROMPTS, greedy(REF_TOKENS), use_tqdm=False)


def _pick_stop_string(text: str, length: int) -> tuple[str, int]:
    """A substring of text from its middle third, whose first occurrence is where we took it, free of U+FFFD."""
    for i in range(len(text) // 3, 2 * len(text) // 3):
        s = text[i:i + length]
        if len(s) == length and "\ufffd" not in s and text.find(s) == i and s.strip():
            return s, i
    raise AssertionError(f"no usable stop string of length {length} in {text!r}")


def test_reference_texts_are_usable(refs, llm_ref):
    tok = llm_ref.tokenizer
    for out in refs:
        assert len(out.token_ids) == REF_TOKENS and out.finish_reason == "length"
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        assert len(out.text) >= 20


@pytest.mark.parametrize("n", [1, 2, 7, 33])
def test_max_new_tokens_exact(make_llm, llama_path, refs, n):
    llm = make_llm(llama_path, page_size=4)
    outs = llm.generate(TEXT_PROMPTS, greedy(n), use_tqdm=False)
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref.token_ids[:n]
        assert out.finish_reason == "length"
        assert out.meta_info["completion_tokens"] == n


def test_max_tokens_alias(make_llm, llama_path, refs):
    llm = make_llm(llama_path)
    out = llm.generate(TEXT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert out.token_ids == refs[0].token_ids[:5]


def test_context_length_stops_generation(make_llm, llama_path):
    """Sequence reaching context_length ends the request with 'length' even below max_new_tokens."""
    llm = make_llm(llama_path, context_length=64, page_size=4)
    prompts = random_prompts([60, 63, 10], seed=30)
    outs = generate_ids(llm, prompts, greedy(100))
    assert [len(o.token_ids) for o in outs] == [4, 1, 54]
    assert all(o.finish_reason == "length" for o in outs)
    big = make_llm(llama_path, page_size=4)
    assert [o.token_ids for o in outs] == [o.token_ids[:len(s.token_ids)] for o, s in
                                           zip(generate_ids(big, prompts, greedy(54)), outs)]


def test_stop_token_ids_stop_at_first_occurrence(make_llm, llama_path, refs):
    llm = make_llm(llama_path, page_size=3)
    tok = llm.tokenizer
    checked = 0
    for prompt, ref in zip(TEXT_PROMPTS, refs):
        ids = ref.token_ids
        # A token whose first occurrence is well inside the output.
        k = next((k for k in range(5, len(ids) - 1) if ids.index(ids[k]) == k), None)
        if k is None:
            continue
        other = next(t for t in range(1, 384) if t not in ids)  # a stop token that never shows up
        out = llm.generate(prompt, greedy(REF_TOKENS, stop_token_ids=[other, ids[k]]), use_tqdm=False)
        assert out.token_ids == ids[:k + 1]
        assert out.finish_reason == "stop"
        assert out.text == tok.decode(ids[:k])  # as SGLang: the stop token's text is trimmed
        kept = llm.generate(prompt, greedy(REF_TOKENS, stop_token_ids=[ids[k]], no_stop_trim=True), use_tqdm=False)
        assert kept.token_ids == ids[:k + 1] and kept.text == tok.decode(ids[:k + 1])
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("length", [1, 3, 6])
def test_stop_string(make_llm, llama_path, refs, length):
    llm = make_llm(llama_path, page_size=2)
    tok = llm.tokenizer
    for prompt, ref in zip(TEXT_PROMPTS, refs):
        stop, at = _pick_stop_string(ref.text, length)
        out = llm.generate(prompt, greedy(REF_TOKENS, stop=stop), use_tqdm=False)
        assert out.finish_reason == "stop"
        assert out.text == ref.text[:at], f"stop={stop!r}"
        assert stop not in out.text
        # Generation ends at the token that completes the stop string, not earlier, not later.
        n = len(out.token_ids)
        assert out.token_ids == ref.token_ids[:n]
        assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])
        kept = llm.generate(prompt, greedy(REF_TOKENS, stop=stop, no_stop_trim=True), use_tqdm=False)
        assert kept.token_ids == out.token_ids and kept.text == ref.text[:at] + stop  # SGLang's no_stop_trim


def test_earliest_of_several_stop_strings_wins(make_llm, llama_path, refs):
    llm = make_llm(llama_path)
    ref = refs[1]
    late, late_at = _pick_stop_string(ref.text, 4)
    early = next(ref.text[i:i + 2] for i in range(2, late_at - 2)
                 if "\ufffd" not in ref.text[i:i + 2] and ref.text.find(ref.text[i:i + 2]) == i)
    out = llm.generate(TEXT_PROMPTS[1], greedy(REF_TOKENS, stop=[late, "zzzz-never", early]), use_tqdm=False)
    assert out.finish_reason == "stop"
    assert out.text == ref.text[:ref.text.find(early)]


def test_stop_string_never_hit(make_llm, llama_path, refs):
    llm = make_llm(llama_path)
    out = llm.generate(TEXT_PROMPTS[2], greedy(REF_TOKENS, stop=["\u2603never\u2603"]), use_tqdm=False)
    assert out.finish_reason == "length"
    assert out.text == refs[2].text and out.token_ids == refs[2].token_ids


@pytest.fixture(scope="module")
def eos_case(llm_ref):
    """A prompt whose greedy output (EOS ignored) contains the EOS token after a few other tokens."""
    eos = llm_ref.tokenizer.eos_token_id
    assert eos in llm_ref.engine.model_config.eos_token_ids
    prompts = random_prompts([1 + (7 * i) % 30 for i in range(32)], seed=20)
    outs = generate_ids(llm_ref, prompts, greedy(24))
    for p, o in zip(prompts, outs):
        if eos in o.token_ids[2:]:
            return p, o.token_ids, o.token_ids.index(eos)
    raise AssertionError("no greedy output contains EOS: pick other prompts")


def test_eos_stops_unless_ignore_eos(make_llm, llama_path, eos_case):
    prompt, ref, k = eos_case
    llm = make_llm(llama_path, page_size=4)
    tok = llm.tokenizer
    stopped = generate_ids(llm, [prompt], SamplingParams(temperature=0, max_new_tokens=24))[0]
    assert stopped.token_ids == ref[:k + 1]  # the EOS token is the last output token
    assert stopped.finish_reason == "stop"
    assert stopped.text == tok.decode(ref[:k + 1], skip_special_tokens=True)
    assert tok.eos_token not in stopped.text
    # as SGLang: the matched stop token shows no text, even unskipped, unless no_stop_trim
    unskipped = generate_ids(llm, [prompt], SamplingParams(temperature=0, max_new_tokens=24,
                                                           skip_special_tokens=False))[0]
    assert unskipped.token_ids == ref[:k + 1] and not unskipped.text.endswith(tok.eos_token)
    shown = generate_ids(llm, [prompt], SamplingParams(temperature=0, max_new_tokens=24, skip_special_tokens=False,
                                                       no_stop_trim=True))[0]
    assert shown.text.endswith(tok.eos_token)
    ignored = generate_ids(llm, [prompt], greedy(24))[0]
    assert ignored.token_ids == ref and ignored.finish_reason == "length"


def test_eos_in_batch_does_not_disturb_others(make_llm, llama_path, eos_case, refs):
    prompt, ref, k = eos_case
    llm = make_llm(llama_path, page_size=4)
    others = random_prompts([12, 25], seed=31)
    expect = generate_ids(llm, others, greedy(24))
    outs = generate_ids(llm, [others[0], prompt, others[1]],
                        [greedy(24), SamplingParams(temperature=0, max_new_tokens=24), greedy(24)])
    assert outs[1].token_ids == ref[:k + 1] and outs[1].finish_reason == "stop"
    assert [outs[0].token_ids, outs[2].token_ids] == [e.token_ids for e in expect]


def _collect_stream(llm, prompts, params):
    texts = [""] * len(prompts)
    tokens = [[] for _ in prompts]
    finals = [None] * len(prompts)
    for d in llm.stream(prompts, params):
        assert finals[d.index] is None, "delta after the finishing delta"
        texts[d.index] += d.text
        tokens[d.index] += d.token_ids
        if d.finished:
            finals[d.index] = d
    return texts, tokens, finals


def test_stream_matches_generate(make_llm, llama_path, refs):
    llm = make_llm(llama_path, page_size=4)
    stop1, _ = _pick_stop_string(refs[0].text, 3)
    stop3, _ = _pick_stop_string(refs[3].text, 2)
    params = [greedy(REF_TOKENS, stop=stop1), greedy(9), greedy(REF_TOKENS, stop_token_ids=[refs[2].token_ids[6]]),
              greedy(REF_TOKENS, stop=[stop3, "never!"])]
    expect = llm.generate(TEXT_PROMPTS, params, use_tqdm=False)
    texts, tokens, finals = _collect_stream(llm, TEXT_PROMPTS, params)
    for i, out in enumerate(expect):
        assert texts[i] == out.text
        assert tokens[i] == out.token_ids
        assert finals[i].finish_reason == out.finish_reason
        assert finals[i].output.text == out.text and finals[i].output.token_ids == out.token_ids
    assert [o.finish_reason for o in expect] == ["stop", "length", "stop", "stop"]


def test_stream_single_prompt_token_by_token(make_llm, llama_path, refs):
    """One request, so every step delivers one token; the text arrives incrementally, never rewritten."""
    llm = make_llm(llama_path)
    deltas = list(llm.stream(TEXT_PROMPTS[3], greedy(REF_TOKENS)))
    assert [t for d in deltas for t in d.token_ids] == refs[3].token_ids
    assert all(len(d.token_ids) == 1 for d in deltas)
    assert "".join(d.text for d in deltas) == refs[3].text
    assert sum(1 for d in deltas if d.text) > 5
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]


def _alternate(streams: list) -> list[tuple[str, list[int], object]]:
    """Consume the streams one delta at a time in turn -> per stream (its deltas' text, their tokens, the final
    output); a delta after a stream's finishing delta fails."""
    got = [["", [], None] for _ in streams]
    live = list(range(len(streams)))
    while live:
        for k in list(live):
            delta = next(streams[k], None)
            if delta is None:
                live.remove(k)
                continue
            assert got[k][2] is None, "delta after the finishing delta"
            got[k][0] += delta.text
            got[k][1] += delta.token_ids
            if delta.finished:
                got[k][2] = delta.output
    return [tuple(g) for g in got]


@pytest.mark.parametrize("spec", [{}, dict(speculative_algorithm="NGRAM", speculative_num_steps=3)],
                         ids=["plain", "ngram"])
def test_interleaved_streams_each_get_all_their_text(make_llm, llama_path, refs, spec):
    """Two streams consumed in turn step one engine: each step advances both streams' requests, and each stream's
    deltas must still carry every token and character of its own requests (the steps' outputs went to whichever
    stream ran the step, and the other one lost that text)."""
    llm = make_llm(llama_path, page_size=4, **spec)
    stop, _ = _pick_stop_string(refs[1].text, 3)
    expect = [llm.generate(TEXT_PROMPTS[0], greedy(REF_TOKENS), use_tqdm=False),
              llm.generate(TEXT_PROMPTS[1], greedy(REF_TOKENS, stop=[stop]), use_tqdm=False)]
    assert expect[0].token_ids == refs[0].token_ids and expect[1].finish_reason == "stop"
    got = _alternate([llm.stream(TEXT_PROMPTS[0], greedy(REF_TOKENS)),
                      llm.stream(TEXT_PROMPTS[1], greedy(REF_TOKENS, stop=[stop]))])
    for (text, tokens, output), out in zip(got, expect):
        assert (text, tokens) == (out.text, out.token_ids)
        assert (output.text, output.token_ids, output.finish_reason) == (out.text, out.token_ids, out.finish_reason)


def test_generate_inside_an_open_stream(make_llm, llama_path, refs):
    """A generate() while a stream is open runs steps that advance the stream's request too."""
    llm = make_llm(llama_path, page_size=4)
    stream = llm.stream(TEXT_PROMPTS[2], greedy(REF_TOKENS))
    first = next(stream)
    inner = llm.generate(TEXT_PROMPTS[3], greedy(REF_TOKENS), use_tqdm=False)
    rest = list(stream)
    assert inner.token_ids == refs[3].token_ids
    assert first.token_ids + [t for d in rest for t in d.token_ids] == refs[2].token_ids
    assert first.text + "".join(d.text for d in rest) == refs[2].text
    assert [d.finished for d in rest] == [False] * (len(rest) - 1) + [True]
    assert rest[-1].output.text == refs[2].text
