"""Finishing conditions under speculation: they must cut an accepted run exactly where plain decoding stops.

The main drafter here is STANDALONE with the target itself as the draft: every greedy draft is accepted, so each
verify emits steps + 1 tokens and most stops land inside an accepted run (not at its end). NGRAM runs the same
checks with partial acceptance. Everything is compared with spec-off on the same inputs: token ids, text and
finish reason.
"""

from __future__ import annotations

import collections
import os

import pytest

from hyperdraft import LLM, SamplingParams
from helpers.spec_fixtures import (_single_torch_thread, assert_clean, ceil_div, gen, greedy, llm_factory, mixed_prompts,  # noqa: F401
                           spec_models, with_eos)

STEPS = 3
NEW_TOKENS = 24


def drafter_args(spec_models, drafter: str, target: str | None = None) -> dict:
    if drafter == "NGRAM":
        return dict(speculative_algorithm="NGRAM", speculative_num_steps=STEPS)
    return dict(speculative_algorithm="STANDALONE", speculative_num_steps=STEPS,
                speculative_draft_model_path=target or spec_models["target"])


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts(16, seed=31)


def spec_off(path, prompts, params, **engine_args):
    llm = LLM(path, device="cpu", dtype="float32", **engine_args)
    outs = gen(llm, prompts, params)
    assert_clean(llm)
    return outs


def assert_like_spec_off(outs, refs):
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert (o.token_ids, o.text, o.finish_reason) == (r.token_ids, r.text, r.finish_reason), f"request {i}"
        assert o.meta_info["completion_tokens"] == r.meta_info["completion_tokens"]


def inside_run(j: int) -> bool:
    """Output index j >= 1 is emitted by verify (j - 1) // (STEPS + 1) under full acceptance; True unless it is the
    last token of that verify's run."""
    return (j - 1) % (STEPS + 1) != STEPS


@pytest.mark.parametrize("drafter", ["STANDALONE-self", "NGRAM"])
def test_requests_with_different_max_new_tokens(spec_models, llm_factory, prompts, drafter):
    """max_new_tokens of every remainder modulo steps + 1: each request stops at exactly max_new_tokens, while the
    others keep speculating in the same batch."""
    max_new = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 15, 19, 23]
    params = [greedy(n) for n in max_new]
    refs = spec_off(spec_models["target"], prompts, params)
    llm = llm_factory(spec_models["target"], **drafter_args(spec_models, drafter))
    outs = gen(llm, prompts, params)
    assert_like_spec_off(outs, refs)
    for o, n in zip(outs, max_new):
        assert len(o.token_ids) == n and o.finish_reason == "length"
        if drafter == "STANDALONE-self" and n > 1:
            assert o.meta_info["spec_verify_ct"] == ceil_div(n - 1, STEPS + 1)


def _stop_positions(refs) -> list[int]:
    """Per request, an output index j whose token occurs there first, preferring indices inside a run and past
    2 + i % 5 (variety); request 0 stops on its very first (prefill) token."""
    positions = []
    for i, r in enumerate(refs):
        toks = r.token_ids
        firsts = [j for j in range(1, len(toks)) if toks[j] not in toks[:j]]
        preferred = [j for j in firsts if j >= 2 + i % 5 and inside_run(j)]
        positions.append(0 if i == 0 else (preferred or [j for j in firsts if inside_run(j)] or firsts or [0])[0])
    return positions


@pytest.mark.parametrize("drafter", ["STANDALONE-self", "NGRAM"])
def test_stop_token_ids_inside_accepted_run(spec_models, llm_factory, prompts, drafter):
    plain = spec_off(spec_models["target"], prompts, greedy(NEW_TOKENS))
    stops = _stop_positions(plain)
    params = [greedy(NEW_TOKENS, stop_token_ids=[r.token_ids[j]]) for r, j in zip(plain, stops)]
    refs = spec_off(spec_models["target"], prompts, params)
    for r, p, j in zip(refs, plain, stops):  # the reference itself stops where the chosen token first occurs
        assert r.token_ids == p.token_ids[:j + 1] and r.finish_reason == "stop"

    llm = llm_factory(spec_models["target"], **drafter_args(spec_models, drafter))
    outs = gen(llm, prompts, params)
    assert_like_spec_off(outs, refs)
    if drafter == "STANDALONE-self":
        cut_inside = 0
        for o, j in zip(outs, stops):
            # The request finished in the verify that produced its stop token: no extra verify, nothing past it.
            assert o.meta_info.get("spec_verify_ct", 0) == ceil_div(j, STEPS + 1)
            cut_inside += j > 0 and inside_run(j)
        assert cut_inside >= 8, "most stops were meant to fall inside accepted runs"


@pytest.mark.parametrize("drafter", ["STANDALONE-self", "NGRAM"])
def test_stop_strings_inside_accepted_run(spec_models, llm_factory, prompts, drafter):
    """Stop strings taken from the plain output's text: one token's text, or a string spanning two tokens."""
    plain = spec_off(spec_models["target"], prompts, greedy(NEW_TOKENS))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(spec_models["target"])
    stops = []
    for i, (r, j) in enumerate(zip(plain, _stop_positions(plain))):
        j = max(j, 1)
        piece = tok.decode(r.token_ids[j:j + 1])
        before = tok.decode(r.token_ids[j - 1:j])
        if i % 2 and before and piece and "\ufffd" not in before + piece:
            s = before[-1] + piece[:2]  # spans the boundary between tokens j-1 and j
        else:
            s = piece
        if not s.strip() or "\ufffd" in s:
            s = "e"  # a common character; wherever it first occurs, spec-off defines the expected cut
        stops.append(s)
    params = [greedy(NEW_TOKENS, stop=[s]) for s in stops]
    refs = spec_off(spec_models["target"], prompts, params)
    assert sum(r.finish_reason == "stop" for r in refs) >= 10, "most requests were meant to hit their stop string"

    llm = llm_factory(spec_models["target"], **drafter_args(spec_models, drafter))
    outs = gen(llm, prompts, params)
    assert_like_spec_off(outs, refs)
    for o, s in zip(outs, stops):
        assert s not in o.text
    if drafter == "STANDALONE-self":
        cut_inside = sum(o.finish_reason == "stop" and o.meta_info.get("spec_verify_ct", 0) * (STEPS + 1) + 1 >
                         o.meta_info["completion_tokens"] for o in outs)
        assert cut_inside >= 5, "stop strings were meant to cut accepted runs short"


@pytest.mark.parametrize("drafter", ["STANDALONE-self", "NGRAM"])
def test_eos_inside_accepted_run(spec_models, llm_factory, prompts, drafter, tmp_path_factory):
    """Without ignore_eos, EOS ends the request where plain decoding ends it. The tiny model rarely emits its real
    EOS, so a copy of the checkpoint names a token the model does emit often as EOS."""
    plain = spec_off(spec_models["target"], prompts, greedy(NEW_TOKENS))
    counts = collections.Counter(t for r in plain for t in r.token_ids[1:])
    eos = counts.most_common(1)[0][0]
    path = with_eos(spec_models["target"], os.path.join(str(tmp_path_factory.getbasetemp()), f"target_eos{eos}"), eos)

    params = greedy(NEW_TOKENS, ignore_eos=False)
    refs = spec_off(path, prompts, params)
    stopped = [r for r in refs if r.finish_reason == "stop"]
    assert len(stopped) >= 3 and all(r.token_ids[-1] == eos for r in stopped)
    llm = llm_factory(path, **drafter_args(spec_models, drafter, target=path))
    assert_like_spec_off(gen(llm, prompts, params), refs)
    # The same engine with ignore_eos runs through EOS, as spec-off does.
    assert_like_spec_off(gen(llm, prompts, greedy(NEW_TOKENS)), spec_off(path, prompts, greedy(NEW_TOKENS)))


@pytest.mark.parametrize("drafter", ["STANDALONE-self", "NGRAM"])
def test_context_length_reached_while_speculating(spec_models, llm_factory, drafter):
    """A run of drafts that would cross context_length is cut at it, with finish reason length."""
    context = 48
    prompts = mixed_prompts(8, seed=41, min_len=30, max_len=45)
    refs = spec_off(spec_models["target"], prompts, greedy(NEW_TOKENS), context_length=context)
    llm = llm_factory(spec_models["target"], context_length=context, **drafter_args(spec_models, drafter))
    outs = gen(llm, prompts, greedy(NEW_TOKENS))
    assert_like_spec_off(outs, refs)
    for o, p in zip(outs, prompts):
        assert len(p) + len(o.token_ids) == min(context, len(p) + NEW_TOKENS)
        assert o.finish_reason == "length"


def test_streaming_with_stops_inside_accepted_runs(spec_models, llm_factory, prompts):
    """Streamed deltas add up to the final output even when one step delivers several tokens and a stop cuts them."""
    plain = spec_off(spec_models["target"], prompts, greedy(NEW_TOKENS))
    stops = _stop_positions(plain)
    params = [greedy(NEW_TOKENS, stop_token_ids=[r.token_ids[j]]) for r, j in zip(plain, stops)]
    llm = llm_factory(spec_models["target"], **drafter_args(spec_models, "STANDALONE-self"))
    texts, ids, finals = collections.defaultdict(str), collections.defaultdict(list), {}
    multi_token_deltas = 0
    for d in llm.stream(input_ids=prompts, sampling_params=params):
        texts[d.index] += d.text
        ids[d.index] += d.token_ids
        multi_token_deltas += len(d.token_ids) > 1
        if d.finished:
            finals[d.index] = d.output
    assert multi_token_deltas > 0
    assert sorted(finals) == list(range(len(prompts)))
    for i, out in finals.items():
        assert ids[i] == out.token_ids == plain[i].token_ids[:stops[i] + 1]
        assert texts[i] == out.text
        assert out.finish_reason == "stop"


def test_sampled_stop_token_truncates_run(spec_models, llm_factory, prompts):
    """Sampled requests (temperature 1, draft = target, so rejection sampling accepts nearly everything): a stop
    token inside an accepted run ends the output right there, never later."""
    llm = llm_factory(spec_models["target"], speculative_use_rejection_sampling=True,
                      **drafter_args(spec_models, "STANDALONE-self"))
    free = gen(llm, prompts, [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=i) for i in range(16)])
    params = []
    for i, o in enumerate(free):
        j = 5 + i % 3
        params.append(SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=i, stop_token_ids=[o.token_ids[j]]))
    outs = gen(llm, prompts, params)
    for i, (o, f) in enumerate(zip(outs, free)):
        # Same seed -> same tokens until the first stop token; the output ends at its first occurrence.
        stop = params[i].stop_token_ids[0]
        first = f.token_ids.index(stop)
        assert o.token_ids == f.token_ids[:first + 1] and o.finish_reason == "stop", f"request {i}"


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("drafter", ["STANDALONE-self", "STANDALONE-wide-noisy", "NGRAM"])
@pytest.mark.parametrize("prompt_len,max_new", [(20, 20), (20, 21), (15, 30)])
def test_request_filling_the_pool_ends_like_spec_off(spec_models, llm_factory, drafter, page_size, prompt_len, max_new):
    """One request whose K/V just fits (or just does not fit) the 40-token pool. Plain decoding needs room for one
    more token per step; a verify wants steps + 1. Near the end of the pool speculation must not give up on a request
    that plain decoding completes (nor abort it earlier than plain decoding does)."""
    capacity = 40
    prompt = mixed_prompts(2, seed=51, min_len=prompt_len, max_len=prompt_len)[1]
    refs = spec_off(spec_models["target"], [prompt], greedy(max_new), max_total_tokens=capacity, page_size=page_size)
    # a request that would outgrow the pool ends there with "length", as at its context length (SGLang's max_req_len)
    assert refs[0].finish_reason == "length"
    assert len(refs[0].token_ids) == min(max_new, capacity + 1 - prompt_len)
    args = drafter_args(spec_models, "NGRAM") if drafter == "NGRAM" else drafter_args(
        spec_models, "STANDALONE-self", target=spec_models["target" if drafter == "STANDALONE-self" else "draft_wide_noisy"])
    llm = llm_factory(spec_models["target"], max_total_tokens=capacity, page_size=page_size, **args)
    outs = gen(llm, [prompt], greedy(max_new))
    assert (outs[0].token_ids, outs[0].finish_reason) == (refs[0].token_ids, refs[0].finish_reason)
    # The engine stays usable, and a request that fits with room to spare still speculates at full width.
    again = gen(llm, [prompt[:5]], greedy(9))[0]
    assert again.finish_reason == "length" and len(again.token_ids) == 9
