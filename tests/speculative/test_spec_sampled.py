"""Sampled speculative decoding with the rejection sampler (--speculative-sampling rejection) is lossless end to end:
the token distribution is that of plain decoding. (The default, coupled verification, gives plain decoding's very
tokens: test_spec_coupled.py checks that by equality.)

A 12-token-vocabulary target (no tokenizer) continues one fixed prompt by 4 tokens, 3000 times with seeds
0..2999 spec-off and seeds 10^6..10^6+2999 with speculation (distinct seeds: the two samples must be independent;
the counter-based sampler would otherwise give both runs the same first token). At each output position the two
token histograms are compared with a two-sample chi-square test (scipy.stats.chi2_contingency).

Statistics: 4 positions per test, each at p-value threshold 1e-6 / 4 (Bonferroni): each test's false-failure
probability is at most 1e-6. All seeds are fixed, so the outcome is deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from hyperdraft import SamplingParams
from helpers.spec_fixtures import SMALL_VOCAB, _single_torch_thread, llm_factory, spec_models, spec_state  # noqa: F401

N_REQ = 3000
NEW_TOKENS = 4
ALPHA = 1e-6  # per test
SPEC_SEED_OFFSET = 10**6
PROMPT_RANDOM = [5, 2, 9, 0, 11, 3, 7, 4]
PROMPT_REPETITIVE = [3, 7, 1, 3, 7, 1, 3, 7]  # NGRAM proposes "1 3 7 ..." and keeps finding matches

PLAIN = dict(temperature=1.0)
FILTERED = dict(temperature=0.7, top_k=5, top_p=0.95, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5,
                frequency_penalty=0.2)

CASES = {
    # name: (prompt, sampling options, engine args given the model paths)
    "STANDALONE-greedy-drafts": (PROMPT_RANDOM, PLAIN, lambda m: dict(
        speculative_algorithm="STANDALONE", speculative_draft_model_path=m["sv_draft"], speculative_num_steps=2,
        speculative_use_rejection_sampling=False, speculative_sampling="rejection")),
    "STANDALONE-rejection-sampling": (PROMPT_RANDOM, PLAIN, lambda m: dict(
        speculative_algorithm="STANDALONE", speculative_draft_model_path=m["sv_draft"], speculative_num_steps=3,
        speculative_use_rejection_sampling=True)),
    "STANDALONE-rejection-sampling-filtered": (PROMPT_RANDOM, FILTERED, lambda m: dict(
        speculative_algorithm="STANDALONE", speculative_draft_model_path=m["sv_draft"], speculative_num_steps=3,
        speculative_use_rejection_sampling=True)),
    "NGRAM": (PROMPT_REPETITIVE, PLAIN, lambda m: dict(speculative_algorithm="NGRAM", speculative_num_steps=3,
                                                       speculative_sampling="rejection")),
    # Trees: deterministic top-k children (q one-hot per child) and children drawn from q (real-q recursive RS).
    "STANDALONE-tree-topk": (PROMPT_RANDOM, PLAIN, lambda m: dict(
        speculative_algorithm="STANDALONE", speculative_draft_model_path=m["sv_draft"], speculative_num_steps=3,
        speculative_eagle_topk=3, speculative_num_draft_tokens=8, speculative_use_rejection_sampling=False,
        speculative_sampling="rejection")),
    "STANDALONE-tree-sampled": (PROMPT_RANDOM, PLAIN, lambda m: dict(
        speculative_algorithm="STANDALONE", speculative_draft_model_path=m["sv_draft"], speculative_num_steps=3,
        speculative_eagle_topk=3, speculative_num_draft_tokens=8, speculative_use_rejection_sampling=True)),
    "STANDALONE-tree-sampled-filtered": (PROMPT_RANDOM, FILTERED, lambda m: dict(
        speculative_algorithm="STANDALONE", speculative_draft_model_path=m["sv_draft"], speculative_num_steps=3,
        speculative_eagle_topk=4, speculative_num_draft_tokens=10, speculative_use_rejection_sampling=True)),
}

_BASELINE: dict = {}


def sample(llm, prompt, options, seed_offset) -> np.ndarray:
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=seed_offset + i, **options) for i in range(N_REQ)]
    outs = llm.generate(input_ids=[prompt] * N_REQ, sampling_params=params, use_tqdm=False)
    assert all(len(o.token_ids) == NEW_TOKENS for o in outs)
    return np.array([o.token_ids for o in outs])


def baseline(llm_factory, spec_models, prompt, options) -> np.ndarray:
    key = (tuple(prompt), tuple(sorted(options.items())))
    if key not in _BASELINE:
        llm = llm_factory(spec_models["sv_target"], skip_tokenizer_init=True)
        _BASELINE[key] = sample(llm, prompt, options, 0)
    return _BASELINE[key]


def position_pvalues(a: np.ndarray, b: np.ndarray) -> list[float]:
    pvalues = []
    for j in range(a.shape[1]):
        table = np.stack([np.bincount(a[:, j], minlength=SMALL_VOCAB), np.bincount(b[:, j], minlength=SMALL_VOCAB)])
        table = table[:, table.sum(0) > 0]  # tokens neither run produced carry no information
        if table.shape[1] < 2:
            pvalues.append(1.0 if (table[0] == table[1]).all() else 0.0)  # one token only: counts must agree
            continue
        pvalues.append(float(chi2_contingency(table).pvalue))
    return pvalues


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_spec_matches_spec_off_distribution(spec_models, llm_factory, case):
    prompt, options, engine_args = CASES[case]
    ref = baseline(llm_factory, spec_models, prompt, options)
    llm = llm_factory(spec_models["sv_target"], skip_tokenizer_init=True, **engine_args(spec_models))
    got = sample(llm, prompt, options, SPEC_SEED_OFFSET)

    state = spec_state(llm)
    # Meaningful only when verification both accepted and rejected drafts, at more than one depth.
    assert 0 < state["spec_accepted_tokens"] < state["spec_draft_tokens"], state
    assert state["spec_acceptance_by_position"][1] > 0, state

    pvalues = position_pvalues(ref, got)
    threshold = ALPHA / NEW_TOKENS
    for j, pv in enumerate(pvalues):
        assert pv > threshold, (f"{case}: position {j} token histogram differs from spec-off (p = {pv:.3g})\n"
                                f"spec-off {np.bincount(ref[:, j], minlength=SMALL_VOCAB).tolist()}\n"
                                f"spec     {np.bincount(got[:, j], minlength=SMALL_VOCAB).tolist()}")


def test_sampled_spec_is_reproducible_per_seed(spec_models, llm_factory):
    """A seeded request samples the same tokens whatever its batch: alone, or among 63 others."""
    _, options, engine_args = CASES["STANDALONE-rejection-sampling"]
    llm = llm_factory(spec_models["sv_target"], skip_tokenizer_init=True, **engine_args(spec_models))
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, seed=100 + i, **options) for i in range(64)]
    batch = llm.generate(input_ids=[PROMPT_RANDOM] * 64, sampling_params=params, use_tqdm=False)
    for i in (0, 17, 63):
        alone = llm.generate(input_ids=[PROMPT_RANDOM], sampling_params=[params[i]], use_tqdm=False)[0]
        assert alone.token_ids == batch[i].token_ids
    assert len({tuple(o.token_ids) for o in batch}) > 1  # the seeds do matter
