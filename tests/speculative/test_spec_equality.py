"""Greedy speculative decoding is lossless: token-for-token the output of plain (spec-off) decoding.

Drafters:
  NGRAM                   prompt lookup; the repetitive prompts give it matches (accepted runs)
  STANDALONE-small        an unrelated qwen3-kind draft of another shape (hidden 32, 1 layer, 2/1 heads): its own
                          KV pool, its own layout; nearly every draft is rejected
  STANDALONE-wide-noisy   a draft of another shape (hidden 80, 3 layers, 8/4 heads) that approximates the target:
                          accepts runs of every length and rejects at every depth, so both KV pools roll back a lot
"""

from __future__ import annotations

import pytest

from hyperdraft import LLM, SamplingParams
from hyperdraft.llm import meta_info
from helpers.spec_fixtures import spec_off_reference, step_until_done  # noqa: F401
from helpers.spec_fixtures import (_single_torch_thread, assert_clean, gen, greedy, llm_factory, mixed_prompts,  # noqa: F401
                           spec_models, spec_state)

DRAFTERS = {
    "NGRAM": ("NGRAM", None),
    "STANDALONE-small": ("STANDALONE", "draft_small"),
    "STANDALONE-wide-noisy": ("STANDALONE", "draft_wide_noisy"),
}
NEW_TOKENS = 24
RETRACT_NEW_TOKENS = 32


def spec_args(spec_models, drafter: str, steps: int) -> dict:
    algo, draft = DRAFTERS[drafter]
    args = dict(speculative_algorithm=algo, speculative_num_steps=steps)
    if draft is not None:
        args["speculative_draft_model_path"] = spec_models[draft]
    return args


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts(16, seed=11)  # lengths 1..100, half repetitive


_REF: dict = {}


def reference(spec_models, prompts, params, key) -> list:
    return spec_off_reference(_REF, spec_models, prompts, params, key)


def assert_same_outputs(outs, refs, label=""):
    assert len(outs) == len(refs)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.token_ids == r.token_ids, f"{label} request {i}: spec {o.token_ids} != spec-off {r.token_ids}"
        assert o.finish_reason == r.finish_reason, f"{label} request {i}"
        assert o.meta_info["completion_tokens"] == r.meta_info["completion_tokens"]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("steps", [1, 2, 4])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_spec_equals_spec_off(spec_models, llm_factory, prompts, drafter, steps, page_size):
    refs = reference(spec_models, prompts, greedy(NEW_TOKENS), "plain")
    llm = llm_factory(spec_models["target"], page_size=page_size, **spec_args(spec_models, drafter, steps))
    outs = gen(llm, prompts, greedy(NEW_TOKENS))
    assert_same_outputs(outs, refs, f"{drafter} steps={steps} page_size={page_size}")
    for o in outs:
        assert o.finish_reason == "length" and len(o.token_ids) == NEW_TOKENS
        assert o.meta_info["spec_verify_ct"] >= 1  # every token after the first came out of a verify

    state = spec_state(llm)
    assert state["speculative_num_steps"] == steps and state["speculative_num_draft_tokens"] == steps + 1
    if drafter != "STANDALONE-small":
        # The test is only meaningful if verification really committed multi-token runs.
        assert state["spec_accepted_tokens"] > 0, state
    if drafter == "STANDALONE-wide-noisy":
        hist = state["spec_accept_length_histogram"]
        assert hist[1] > 0 and hist[steps + 1] > 0, f"expected both full rejections and full acceptances: {hist}"


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_spec_equals_spec_off_with_retraction(spec_models, llm_factory, prompts, drafter, page_size):
    """Chunked prefill (16-token chunks) and a KV pool far too small for 16 requests: requests are retracted while
    speculating (their K/V in both pools freed, recomputed later), and the outputs must not change.

    Driven step by step so the test can see that retractions hit requests that had already been verified."""
    refs = reference(spec_models, prompts, greedy(RETRACT_NEW_TOKENS), "plain-long")
    llm = llm_factory(spec_models["target"], page_size=page_size, max_total_tokens=200, chunked_prefill_size=16,
                      **spec_args(spec_models, drafter, 3))
    engine = llm.engine
    reqs = [engine.add_request(input_ids=p, params=greedy(RETRACT_NEW_TOKENS)) for p in prompts]
    seen_retractions, retracted_while_speculating = step_until_done(engine, reqs, page_size, 2000)
    for i, (r, ref) in enumerate(zip(reqs, refs)):
        assert r.output_ids == ref.token_ids, f"{drafter} page_size={page_size} request {i} (retractions: {r.num_retractions})"
        assert r.finish_reason == "length"
    metas = [meta_info(r) for r in reqs]  # what generate() would report
    assert any(m["num_retractions"] > 0 for m in metas), "the pool was meant to be too small: no request was retracted"
    assert [m["num_retractions"] for m in metas] == seen_retractions
    assert retracted_while_speculating > 0, "no request was retracted after it had been through a verify"


PENALTIES = {
    "discouraging": dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
    "encouraging": dict(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=-0.2),  # NGRAM still matches
}


@pytest.mark.parametrize("drafter,penalties", [("NGRAM", "encouraging"), ("STANDALONE-wide-noisy", "encouraging"),
                                               ("STANDALONE-wide-noisy", "discouraging")])
def test_greedy_spec_equals_spec_off_with_penalties(spec_models, llm_factory, prompts, drafter, penalties):
    """Penalties make verify row j depend on drafts 0..j-1 (they count as generated tokens there); greedy output must
    still match spec-off. One request in four has no penalties, so penalised and plain rows share the batch."""
    params = [greedy(NEW_TOKENS) if i % 4 == 3 else greedy(NEW_TOKENS, **PENALTIES[penalties]) for i in range(len(prompts))]
    refs = reference(spec_models, prompts, params, "penalties-" + penalties)
    llm = llm_factory(spec_models["target"], **spec_args(spec_models, drafter, 3))
    outs = gen(llm, prompts, params)
    assert_same_outputs(outs, refs, f"{drafter} {penalties}")
    # Meaningful only if penalised requests had drafts accepted (multi-token runs through the penalised verify).
    assert sum(o.meta_info["spec_accepted_tokens"] for i, o in enumerate(outs) if i % 4 != 3) > 0


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_spec_equals_spec_off_few_rows(spec_models, llm_factory, prompts, drafter):
    """max_running_requests=3: requests queue, and new ones take over the page-table rows and pages (in both KV
    pools) that finished ones left behind."""
    refs = reference(spec_models, prompts, greedy(NEW_TOKENS), "plain")
    llm = llm_factory(spec_models["target"], max_running_requests=3, page_size=4, chunked_prefill_size=32,
                      **spec_args(spec_models, drafter, 2))
    assert_same_outputs(gen(llm, prompts, greedy(NEW_TOKENS)), refs, drafter)


@pytest.mark.parametrize("steps", [1, 4])
def test_greedy_spec_equals_spec_off_rejection_sampling_flag(spec_models, llm_factory, prompts, steps):
    """speculative_use_rejection_sampling on greedy requests: q is one-hot at the draft's argmax, and verification
    must still reproduce plain greedy decoding."""
    refs = reference(spec_models, prompts, greedy(NEW_TOKENS), "plain")
    llm = llm_factory(spec_models["target"], speculative_use_rejection_sampling=True,
                      **spec_args(spec_models, "STANDALONE-wide-noisy", steps))
    assert_same_outputs(gen(llm, prompts, greedy(NEW_TOKENS)), refs, f"rejection sampling steps={steps}")
    assert spec_state(llm)["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("drafter", ["NGRAM", "STANDALONE-wide-noisy"])
def test_greedy_requests_unaffected_by_sampled_neighbours(spec_models, llm_factory, prompts, drafter):
    """Greedy and sampled requests in one speculative batch: the greedy ones still equal spec-off, token for token."""
    refs = reference(spec_models, prompts, greedy(NEW_TOKENS), "plain")
    params = [greedy(NEW_TOKENS) if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    llm = llm_factory(spec_models["target"], **spec_args(spec_models, drafter, 3))
    outs = gen(llm, prompts, params)
    for i in range(0, len(prompts), 2):
        assert outs[i].token_ids == refs[i].token_ids, f"greedy request {i} changed next to sampled requests"
    for i in range(1, len(prompts), 2):
        assert len(outs[i].token_ids) == NEW_TOKENS


def test_spec_off_reference_is_page_size_independent(spec_models, llm_factory, prompts):
    """Guards the cached reference: plain decoding at page_size 4 gives the page_size-1 outputs used above."""
    refs = reference(spec_models, prompts, greedy(NEW_TOKENS), "plain")
    llm = llm_factory(spec_models["target"], page_size=4)
    assert_same_outputs(gen(llm, prompts, greedy(NEW_TOKENS)), refs, "spec-off page_size=4")


@pytest.mark.parametrize("drafter", [None, "NGRAM", "STANDALONE-wide-noisy", "STANDALONE-wide-noisy-tree"])
def test_logprobs_only_where_asked(spec_models, llm_factory, prompts, drafter):
    """A step computes logprobs only when some request in it asked (SamplingBatch.want_logprobs): requests that
    asked get exactly what they get in a batch where every request asks, the others none, and the tokens do not
    change. Covers plain decoding, chain rounds and tree rounds, with batches where nobody asks (the requests that
    did not ask finish later than the ones that did)."""
    asked = [greedy(NEW_TOKENS, return_logprob=True) for _ in prompts]
    mixed = [greedy(NEW_TOKENS if i % 2 else NEW_TOKENS // 2, return_logprob=i % 2 == 0) for i in range(len(prompts))]
    refs = reference(spec_models, prompts, asked, "logprobs-all")
    if drafter is None:
        llm = llm_factory(spec_models["target"])
    else:
        extra = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=5) if drafter.endswith("-tree") else {}
        llm = llm_factory(spec_models["target"], **spec_args(spec_models, drafter.removesuffix("-tree"), 3), **extra)
    outs = gen(llm, prompts, mixed)
    for i, (o, r) in enumerate(zip(outs, refs)):
        n = len(o.token_ids)
        assert o.token_ids == r.token_ids[:n] and n == mixed[i].max_new_tokens, f"request {i}"
        if mixed[i].return_logprob:
            assert o.meta_info["output_token_logprobs"] == pytest.approx(r.meta_info["output_token_logprobs"][:n],
                                                                         abs=1e-4), f"request {i}"
        else:
            assert "output_token_logprobs" not in o.meta_info, f"request {i}"


@pytest.mark.parametrize("drafter", ["NGRAM", "STANDALONE-wide-noisy"])
def test_logprobs_match_spec_off(spec_models, llm_factory, prompts, drafter):
    """return_logprob: every token's log-probability, whether it came from a prefill, an accepted draft or a
    recovered/bonus token, is the one plain decoding reports (up to float rounding between forward shapes)."""
    params = [greedy(NEW_TOKENS, return_logprob=True, **(PENALTIES["encouraging"] if i % 3 == 0 else {}))
              for i in range(len(prompts))]
    refs = reference(spec_models, prompts, params, "logprobs")
    llm = llm_factory(spec_models["target"], **spec_args(spec_models, drafter, 3))
    outs = gen(llm, prompts, params)
    assert_same_outputs(outs, refs, drafter)
    for i, (o, r) in enumerate(zip(outs, refs)):
        got, want = o.meta_info["output_token_logprobs"], r.meta_info["output_token_logprobs"]
        assert len(got) == len(want) == NEW_TOKENS
        assert got == pytest.approx(want, abs=1e-4), f"request {i}"
        assert all(lp <= 0 for lp in got)


@pytest.mark.parametrize("drafter", ["NGRAM", "STANDALONE-wide-noisy"])
def test_abandoned_stream_releases_everything(spec_models, llm_factory, prompts, drafter):
    """A consumer that stops reading mid-generation aborts the rest: both KV pools' slots come back (checked at
    teardown), and the engine then serves a new batch exactly like spec-off."""
    llm = llm_factory(spec_models["target"], **spec_args(spec_models, drafter, 3))
    stream = llm.stream(input_ids=prompts, sampling_params=greedy(NEW_TOKENS))
    for n, _ in enumerate(stream):
        if n == 40:
            break
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.page_table.num_private_slots == 0 and llm.engine.prefix_cache.tree.evictable_pages == llm.engine.prefix_cache.tree.num_pages
    refs = reference(spec_models, prompts, greedy(NEW_TOKENS), "plain")
    assert_same_outputs(gen(llm, prompts, greedy(NEW_TOKENS)), refs, drafter)
