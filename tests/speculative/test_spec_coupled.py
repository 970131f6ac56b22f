"""Coupled verification (--speculative-sampling coupled, the default): a sampled request's output with speculation is
plain decoding's output, token for token, for every drafter, chains and trees, with filters and penalties. So a
seeded request is reproducible whatever runs beside it: alone or in a batch (adaptive tiers change the draft
length with the batch), with NGRAM's shared history cold or warmed by other requests.

Exact equality, not a distribution test: plain decoding's distribution is the target's, so equality is the
strongest check of losslessness there is. Where drafts differ from the target (a noisy draft), the acceptance
counters show that drafts were both accepted and rejected, so verification decided something.
"""

from __future__ import annotations

import pytest

from hyperdraft import LLM, SamplingParams
from helpers.spec_fixtures import gen, llm_factory, spec_models, spec_state  # noqa: F401
from conftest import random_prompts

NEW_TOKENS = 24
PLAIN = dict(temperature=0.8)
FILTERED = dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.3,
                frequency_penalty=0.2)

DRAFTERS = {
    "NGRAM": lambda m: dict(speculative_algorithm="NGRAM", speculative_num_steps=4),
    "STANDALONE-chain": lambda m: dict(speculative_algorithm="STANDALONE", speculative_num_steps=4,
                                       speculative_draft_model_path=m["draft_wide_noisy"]),
    "STANDALONE-chain-greedy-drafts": lambda m: dict(
        speculative_algorithm="STANDALONE", speculative_num_steps=3, speculative_draft_model_path=m["draft_wide_noisy"],
        speculative_use_rejection_sampling=False),
    "STANDALONE-tree": lambda m: dict(speculative_algorithm="STANDALONE", speculative_num_steps=3,
                                      speculative_eagle_topk=3, speculative_num_draft_tokens=8,
                                      speculative_draft_model_path=m["draft_wide_noisy"]),
    "STANDALONE-small-draft": lambda m: dict(speculative_algorithm="STANDALONE", speculative_num_steps=3,
                                             speculative_draft_model_path=m["draft_small"]),
}


def _params(options: dict, n: int, seed0: int = 0) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=seed0 + i, **options) for i in range(n)]


_PLAIN: dict = {}


def _plain(spec_models, prompts, options) -> list[list[int]]:
    key = (tuple(map(tuple, prompts)), tuple(sorted(options.items())))
    if key not in _PLAIN:
        llm = LLM(spec_models["target"], device="cpu", dtype="float32")
        _PLAIN[key] = [o.token_ids for o in gen(llm, prompts, _params(options, len(prompts)))]
        llm.shutdown()
    return _PLAIN[key]


@pytest.mark.parametrize("options", [PLAIN, FILTERED], ids=["plain", "filtered-penalised"])
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_coupled_spec_equals_plain_decoding(spec_models, llm_factory, drafter, options):
    prompts = random_prompts([4, 40, 9, 23, 31, 6, 17, 12], seed=21)
    want = _plain(spec_models, prompts, options)
    llm = llm_factory(spec_models["target"], **DRAFTERS[drafter](spec_models))
    got = [o.token_ids for o in gen(llm, prompts, _params(options, len(prompts)))]
    assert got == want
    state = spec_state(llm)
    assert state["spec_draft_tokens"] > 0, state
    if "noisy" in str(DRAFTERS[drafter](spec_models)):  # close to the target: drafts accepted and rejected
        assert 0 < state["spec_accepted_tokens"] < state["spec_draft_tokens"], state


def test_seeded_request_alone_equals_it_under_adaptive_load(spec_models, llm_factory):
    """Adaptive speculation picks the draft length from the batch size: the request alone and among 47 others runs
    different tiers, and still samples the same tokens."""
    llm = llm_factory(spec_models["target"], speculative_algorithm="STANDALONE", speculative_adaptive=True,
                      speculative_draft_model_path=spec_models["draft_wide_noisy"], max_running_requests=48)
    prompts = random_prompts([4 + (7 * i) % 27 for i in range(48)], seed=5)
    params = _params(PLAIN, 48, seed0=300)
    batch = [o.token_ids for o in gen(llm, prompts, params)]
    tiers_under_load = dict(spec_state(llm)["spec_steps_per_tier"])
    for i in (0, 31):
        assert gen(llm, [prompts[i]], [params[i]])[0].token_ids == batch[i]
    assert len(spec_state(llm)["spec_steps_per_tier"]) > 1 or len(tiers_under_load) > 1, tiers_under_load
    assert len({tuple(t) for t in batch}) > 1  # the seeds matter


def test_ngram_history_warmed_by_other_requests_changes_nothing(spec_models, llm_factory):
    """NGRAM drafts from every request's tokens. Warmed by a greedy run of the same prompt, its history proposes the
    target's likely continuation, which a cold history cannot: the drafts (and how many are accepted) differ, and
    the seeded output must not notice."""
    prompt = random_prompts([12], seed=4)
    params = _params(dict(temperature=0.05), 1, seed0=11)  # (this tiny target's logits are flat: a low temperature
    # keeps the sample near the greedy path for a few tokens, then it leaves it)
    cold = llm_factory(spec_models["target"], speculative_algorithm="NGRAM", speculative_num_steps=5)
    want = gen(cold, prompt, params)[0].token_ids
    warm = llm_factory(spec_models["target"], speculative_algorithm="NGRAM", speculative_num_steps=5)
    greedy = [SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)]
    gen(warm, prompt, greedy)
    gen(warm, random_prompts([10, 30, 14], seed=2), greedy * 3)
    before = spec_state(warm)["spec_accepted_tokens"]
    assert gen(warm, prompt, params)[0].token_ids == want
    accepted_warm = spec_state(warm)["spec_accepted_tokens"] - before
    assert accepted_warm > spec_state(cold)["spec_accepted_tokens"], (accepted_warm, spec_state(cold))
    plain = LLM(spec_models["target"], device="cpu", dtype="float32")
    assert gen(plain, prompt, params)[0].token_ids == want
    plain.shutdown()


def test_coupled_cannot_be_combined_with_rejection_sampling(spec_models):
    with pytest.raises(ValueError, match="speculative_use_rejection_sampling=True.*speculative_sampling=coupled"):
        LLM(spec_models["target"], device="cpu", speculative_algorithm="STANDALONE", speculative_sampling="coupled",
            speculative_draft_model_path=spec_models["draft_wide_noisy"], speculative_use_rejection_sampling=True)
    with pytest.raises(ValueError, match=r"speculative_sampling must be one of \('coupled', 'rejection'\)"):
        LLM(spec_models["target"], device="cpu", speculative_algorithm="NGRAM", speculative_sampling="gumbel")
