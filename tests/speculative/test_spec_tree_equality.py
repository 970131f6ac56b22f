"""Greedy tree speculative decoding (STANDALONE, speculative_eagle_topk > 1) is lossless: token for token the output
of plain (spec-off) decoding.

Trees: topk 2 and 4 siblings, 4, 8 and 16 verified nodes (root included), beams of 2 to 5 steps; page_size 1 and 4;
12 concurrent prompts (repetitive and random, lengths 1..100) with max_new_tokens from 1 to 28, so rows finish (and
free their slots in both pools) while others are mid-round. Drafts:
  draft_small        an unrelated qwen3-kind draft of another shape: nearly every tree is rejected at the root
  draft_wide         computes the target's function in another shape: long accepted paths, so the accepted path's
                     K/V is moved over long distances in both pools (compaction)
  draft_wide_noisy   the widened copy with perturbed weights: accepted paths of every length, rejections at every
                     depth, first and later siblings accepted
"""

from __future__ import annotations

import pytest

from hyperdraft import LLM
from hyperdraft.llm import meta_info
from helpers.spec_fixtures import spec_off_reference, step_until_done  # noqa: F401
from helpers.spec_fixtures import (_single_torch_thread, assert_clean, gen, greedy, llm_factory, mixed_prompts,  # noqa: F401
                           spec_models, spec_state)

# (topk, num_draft_tokens, steps): every num_draft_tokens in [2, topk + (steps-1)*topk^2 + 1]
TREES = [(2, 4, 3), (2, 8, 5), (2, 16, 5), (4, 4, 3), (4, 8, 2), (4, 16, 3)]
DRAFTS = ["draft_small", "draft_wide", "draft_wide_noisy"]
NEW_TOKENS = [1, 28, 5, 17, 9, 24, 2, 12, 20, 7, 14, 26]


def tree_args(spec_models, draft: str, topk: int, n: int, steps: int) -> dict:
    return dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=spec_models[draft],
                speculative_eagle_topk=topk, speculative_num_draft_tokens=n, speculative_num_steps=steps)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts(len(NEW_TOKENS), seed=23)  # lengths 1..100, half repetitive


_REF: dict = {}


def reference(spec_models, prompts, params, key) -> list:
    return spec_off_reference(_REF, spec_models, prompts, params, key)


def assert_same_outputs(outs, refs, label: str):
    assert len(outs) == len(refs)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.token_ids == r.token_ids, f"{label} request {i}: spec {o.token_ids} != spec-off {r.token_ids}"
        assert o.finish_reason == r.finish_reason, f"{label} request {i}"
        assert o.meta_info["completion_tokens"] == r.meta_info["completion_tokens"], f"{label} request {i}"


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("topk,n,steps", TREES, ids=[f"topk{k}-n{n}-steps{s}" for k, n, s in TREES])
@pytest.mark.parametrize("draft", DRAFTS)
def test_greedy_tree_spec_equals_spec_off(spec_models, llm_factory, prompts, draft, topk, n, steps, page_size):
    params = [greedy(k) for k in NEW_TOKENS]
    refs = reference(spec_models, prompts, params, "plain")
    llm = llm_factory(spec_models["target"], page_size=page_size, **tree_args(spec_models, draft, topk, n, steps))
    outs = gen(llm, prompts, params)
    label = f"{draft} topk={topk} n={n} steps={steps} page_size={page_size}"
    assert_same_outputs(outs, refs, label)
    for o, k in zip(outs, NEW_TOKENS):
        assert o.finish_reason == "length" and len(o.token_ids) == k
        if k > 1:
            assert o.meta_info["spec_verify_ct"] >= 1  # every token after the first came out of a tree verify

    state = spec_state(llm)
    settings = (state["speculative_eagle_topk"], state["speculative_num_draft_tokens"], state["speculative_num_steps"])
    assert settings == (topk, n, steps)
    # The pool is large, so every verify checked a full tree: n - 1 draft nodes.
    assert state["spec_draft_tokens"] == (n - 1) * state["spec_verifies"], state
    hist = state["spec_accept_length_histogram"]
    assert sum(hist) == state["spec_verifies"] and len(hist) == steps + 2
    # Accepted paths are at most min(steps, n - 1) long; the deepest reachable one needs a chain in the tree.
    assert all(h == 0 for h in hist[min(steps, n - 1) + 2:]), hist
    longest = max(a for a, h in enumerate(hist) if h) - 1  # accepted draft tokens of the best verify
    if draft == "draft_wide":
        # The draft's top-1 child is always the greedy token: at least one token accepted per verify, and long paths.
        assert hist[1] == 0, f"a verify rejected the exact draft's whole tree: {hist}"
        assert longest >= min(steps, 2 if n == 4 else 3), hist  # 4 nodes hold both root children and one grandchild
    if draft == "draft_wide_noisy":
        assert hist[1] > 0 and hist[2] > 0 and longest >= 2, f"expected rejections and accepted paths: {hist}"


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("topk,n,steps", [(2, 8, 4), (4, 16, 3)], ids=["topk2-n8-steps4", "topk4-n16-steps3"])
def test_greedy_tree_spec_equals_spec_off_with_retraction(spec_models, llm_factory, prompts, topk, n, steps, page_size):
    """Chunked prefill (16-token chunks) and a KV pool far too small for 12 requests with a verify reservation of n
    slots each: requests are retracted while speculating (their K/V in both pools freed, recomputed later), and the
    outputs must not change. Driven step by step to see that retractions hit requests already verified."""
    params = [greedy(k + 12) for k in NEW_TOKENS]  # up to 40 tokens: the 100-token prompts fill the whole pool
    refs = reference(spec_models, prompts, params, "plain-long")
    llm = llm_factory(spec_models["target"], page_size=page_size, max_total_tokens=140, chunked_prefill_size=16,
                      **tree_args(spec_models, "draft_wide_noisy", topk, n, steps))
    engine = llm.engine
    reqs = [engine.add_request(input_ids=p, params=sp) for p, sp in zip(prompts, params)]
    _, retracted_while_speculating = step_until_done(engine, reqs, page_size, 3000, check_draft=True)
    for i, (r, ref) in enumerate(zip(reqs, refs)):
        assert r.output_ids == ref.token_ids, (f"topk={topk} n={n} page_size={page_size} request {i} "
                                               f"(retractions: {r.num_retractions})")
        assert r.finish_reason == "length"
    metas = [meta_info(r) for r in reqs]
    assert any(m["num_retractions"] > 0 for m in metas), "the pool was meant to be too small: no request was retracted"
    assert retracted_while_speculating > 0, "no request was retracted after it had been through a verify"
    assert spec_state(llm)["spec_accepted_tokens"] > 0


PENALTIES = {
    "discouraging": dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
    "encouraging": dict(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=-0.2),
}


@pytest.mark.parametrize("penalties", list(PENALTIES))
def test_greedy_tree_spec_equals_spec_off_with_penalties(spec_models, llm_factory, prompts, penalties):
    """Penalties make a tree node's verify row depend on the tokens of its own path (not its siblings'); greedy
    output must still match spec-off. One request in four has no penalties."""
    params = [greedy(k) if i % 4 == 3 else greedy(k, **PENALTIES[penalties]) for i, k in enumerate(NEW_TOKENS)]
    refs = reference(spec_models, prompts, params, "penalties-" + penalties)
    llm = llm_factory(spec_models["target"], **tree_args(spec_models, "draft_wide_noisy", 2, 8, 4))
    outs = gen(llm, prompts, params)
    assert_same_outputs(outs, refs, penalties)
    # Meaningful only if penalised requests had paths of 2+ tokens accepted through the penalised tree verify.
    assert sum(o.meta_info.get("spec_accepted_tokens", 0) for i, o in enumerate(outs) if i % 4 != 3) > 0


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("topk,n,steps", [(2, 8, 5), (4, 16, 3)], ids=["topk2-n8-steps5", "topk4-n16-steps3"])
def test_greedy_sampled_tree_spec_equals_spec_off(spec_models, llm_factory, prompts, topk, n, steps, page_size):
    """speculative_use_rejection_sampling with trees: greedy requests get the draft's top-k children in a random
    order and per-level node budgets (tree_sampled.py); the output must still be plain greedy decoding's."""
    params = [greedy(k) for k in NEW_TOKENS]
    refs = reference(spec_models, prompts, params, "plain")
    llm = llm_factory(spec_models["target"], page_size=page_size, speculative_use_rejection_sampling=True,
                      **tree_args(spec_models, "draft_wide_noisy", topk, n, steps))
    assert_same_outputs(gen(llm, prompts, params), refs, f"sampled tree topk={topk} n={n} page_size={page_size}")
    hist = spec_state(llm)["spec_accept_length_histogram"]
    assert hist[1] > 0 and sum(hist[3:]) > 0, f"expected rejections and accepted paths of 2+ nodes: {hist}"
