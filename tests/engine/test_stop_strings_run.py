"""A run of accepted tokens meets a request's stop strings exactly where checking the text after each token would
(StopChecker.append's one decode of the run, against check() token by token), on real tokenizers: SmolLM2's
byte-level BPE and a Llama-2-style Metaspace BPE (its decoder strips a window's leading space), over text with
multi-byte characters, stop strings cut from the text around the run (so they hit, across token edges) and strings
that never occur."""

from __future__ import annotations

import random

import pytest

from hyperdraft import SamplingParams
from hyperdraft.engine.stop import StopChecker
from hyperdraft.request import Request
from helpers.real_tokenizers import TEXT, byte_fallback, metaspace, smollm2  # noqa: F401 (fixtures)


def _one_by_one(stop: StopChecker, req: Request, tokens):
    for i, tok in enumerate(tokens):
        req.output_ids.append(tok)
        reason = stop.check(req)
        if reason is not None:
            return tokens[: i + 1], reason
    return list(tokens), None


def _first_stop(tokenizer, ids: list[int], stop: str, skip_special_tokens: bool = True) -> int:
    """Tokens up to the first whose whole decoded output contains stop."""
    return next(k for k in range(1, len(ids) + 1)
                if stop in tokenizer.decode(ids[:k], skip_special_tokens=skip_special_tokens))


def test_a_stop_made_of_byte_tokens_after_wide_characters(byte_fallback):
    """Found by an audit: the engine decoded the last 4 * len(stop) + 2 tokens on their own; that window began inside
    "😀"'s bytes, so the run of byte tokens decoded to U+FFFD and "\n\n" was never seen (the user's text was cut
    at it; the engine generated to max_new_tokens)."""
    tok = byte_fallback
    ids = tok.encode("x日本😀\n\n日本 more", add_special_tokens=False)
    want = _first_stop(tok, ids, "\n\n")
    stop = StopChecker(tok, (2,), 4096)
    for run in (1, 3, len(ids)):  # a token at a time, runs of three, the whole output as one run
        req = Request("r", [1], SamplingParams(max_new_tokens=100, stop=["\n\n"]), 0)
        kept, reason = [], None
        for at in range(0, len(ids), run):
            appended, reason = stop.append(req, ids[at:at + run], [0.0] * run)
            kept += appended
            if reason:
                break
        assert (len(kept), reason, req.stop_str_hit) == (want, "stop", "\n\n"), run


def test_a_stop_across_skipped_special_tokens(byte_fallback):
    """Thirty special tokens between "Hello" and " world" decode to nothing: "o w" spans 32 tokens, more than any
    window of 4 * 3 + 2."""
    tok = byte_fallback
    ids = tok.encode("Hello", add_special_tokens=False) + [3] * 30 + tok.encode("world", add_special_tokens=False)
    want = _first_stop(tok, ids, "o w")
    assert want > len(tok.encode("Hello", add_special_tokens=False)) + 30  # the stop ends past the special tokens
    for run in (1, 5):
        req = Request("r", [1], SamplingParams(max_new_tokens=100, stop=["o w"], ignore_eos=True), 0)
        stop, kept, reason = StopChecker(tok, (2,), 4096), [], None
        for at in range(0, len(ids), run):
            appended, reason = stop.append(req, ids[at:at + run], [0.0] * run)
            kept += appended
            if reason:
                break
        assert (len(kept), reason) == (want, "stop"), run


@pytest.mark.parametrize("name", ["smollm2", "metaspace", "byte_fallback"])
def test_a_run_stops_where_token_by_token_checks_do(name, request):
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stop = StopChecker(tokenizer, (), context_len=10_000)
    rng = random.Random(0)
    outcomes = {"hit": 0, "none": 0}
    for case in range(1500):
        start = rng.randrange(len(ids) - 40)
        before, run = ids[start:start + rng.randint(0, 12)], ids[start + 12:start + 12 + rng.randint(2, 9)]
        around = tokenizer.decode(ids[start + 8:start + 24])
        cut = rng.randrange(len(around))
        stops = [around[cut:cut + rng.randint(1, 6)] or "x", "never-in-text" if rng.random() < 0.5 else "ZZ"]
        params = SamplingParams(max_new_tokens=500, stop=stops, skip_special_tokens=rng.random() < 0.5)
        req, ref = (Request("r", [1], params, 0, output_ids=list(before)) for _ in range(2))
        if before and stop.check(req) is not None:
            continue  # a request that already stopped is never appended to
        expect = _one_by_one(stop, ref, run)
        got = stop.append(req, run, [0.0] * len(run))
        assert got == expect and req.output_ids == ref.output_ids, (case, before, run, stops)
        assert req.stop_str_hit == ref.stop_str_hit
        outcomes["hit" if expect[1] else "none"] += 1
    assert min(outcomes.values()) > 200, outcomes  # both the one-decode path and the stops inside runs were met


def test_a_stop_string_starting_with_a_space_hits_at_the_first_output_token(metaspace):
    """Found by an audit: the stop check decoded the output with no prompt context, and a Metaspace decoder strips
    the leading space of a window's first piece, so a stop string " jum" at the answer's start was never seen."""
    tok = metaspace
    ids = tok.encode("The fox jumps over the lazy dog", add_special_tokens=False)
    split = next(k for k in range(2, len(ids)) if tok.convert_ids_to_tokens(ids[k]).startswith("▁"))
    prompt, answer = ids[:split], ids[split:]
    assert tok.decode(prompt + answer)[len(tok.decode(prompt)):].startswith(" ") and tok.decode(answer)[0] != " "
    first_word = tok.decode(prompt + answer)[len(tok.decode(prompt)):][:4]  # " jum", say
    stop = StopChecker(tok, (), context_len=10_000)
    req = Request("r", prompt, SamplingParams(max_new_tokens=50, stop=[first_word]), 0)
    kept, reason = stop.append(req, answer, [0.0] * len(answer))
    assert reason == "stop" and req.stop_str_hit == first_word
    assert first_word in tok.decode(prompt + kept)[len(tok.decode(prompt)):]
    assert first_word not in tok.decode(prompt + kept[:-1])[len(tok.decode(prompt)):]  # at the first token it could
