"""Sampled requests through draft TREES (STANDALONE, topk 2..4 deterministic top-k siblings) are lossless end to
end: the token distribution at every output position is that of plain decoding.

A 12-token-vocabulary target (no tokenizer) continues a fixed prompt by NEW_TOKENS tokens, N_REQ times with seeds
0..N_REQ-1 spec-off and seeds 10^6.. with speculation (independent samples). Drafts:
  sv_draft        an unrelated small model: mostly rejections, the first sibling often wrong and a later one right
  sv_noisy        a widened copy of the target with perturbed weights: partial agreement at every depth
  sv_target       the target itself: long accepted paths, and after a rejected first child the residual often
                  accepts a later sibling
At each output position the two token histograms are compared with a two-sample chi-square test
(spec_fixtures.position_pvalue; tokens with fewer than MIN_BIN samples in both runs together are pooled into one bin,
so every expected cell count is at least MIN_BIN / 2 and the chi-square approximation holds).

Statistics: len(CASES) * NEW_TOKENS checks in this module, each at p-value threshold ALPHA / that number (Bonferroni):
the module's false-failure probability is at most ALPHA = 1e-6. Every seed is fixed, so the outcome is deterministic.
A spy on TreeRound.accept checks that verification really accepted later siblings (not only first children) and
paths deeper than one node, otherwise the comparison would not exercise the multi-candidate tree walk.
"""

from __future__ import annotations

import numpy as np
import pytest

from hyperdraft import SamplingParams
from hyperdraft.speculative.verify.tree import TreeRound
from helpers.spec_fixtures import (SMALL_VOCAB, _single_torch_thread, _widened_copy, llm_factory,  # noqa: F401
                                   position_pvalue, spec_models, spec_state)

N_REQ = 3000
NEW_TOKENS = 5
ALPHA = 1e-6  # for the whole module
SPEC_SEED_OFFSET = 10**6
PROMPT = [5, 2, 9, 0, 11, 3, 7, 4]

PLAIN = dict(temperature=1.0)
FILTERED = dict(temperature=0.8, top_k=6, top_p=0.95, repetition_penalty=1.2, presence_penalty=0.3)

CASES = {
    # name: (draft, topk, steps, num_draft_tokens, sampling options)
    "unrelated-topk2": ("sv_draft", 2, 3, 6, PLAIN),
    "unrelated-topk4": ("sv_draft", 4, 3, 12, PLAIN),
    "noisy-topk3": ("sv_noisy", 3, 3, 10, PLAIN),
    "self-topk2": ("sv_target", 2, 4, 9, PLAIN),
    "self-topk4-filtered": ("sv_target", 4, 2, 8, FILTERED),
}
NUM_CHECKS = len(CASES) * NEW_TOKENS


@pytest.fixture(scope="module")
def drafts(spec_models, tmp_path_factory) -> dict[str, str]:
    noisy = _widened_copy(spec_models["sv_target"], str(tmp_path_factory.mktemp("sv_noisy") / "m"), rel_noise=0.15, seed=7)
    return {"sv_draft": spec_models["sv_draft"], "sv_target": spec_models["sv_target"], "sv_noisy": noisy}


class SiblingSpy:
    """Counts, over all verifies, accepted nodes that were their parent's first child vs a later sibling."""

    def __init__(self, monkeypatch):
        self.first = self.later = 0
        original = TreeRound.accept
        spy = self

        def accept(round_, *args, **kwargs):
            out = original(round_, *args, **kwargs)
            num_accepted, tokens = round_.num_accepted.tolist(), round_.tokens.tolist()
            parents, node_tokens = round_.proposal.parents.tolist(), round_.proposal.tokens.tolist()
            for b, a in enumerate(num_accepted):
                cur = 0
                for tok in tokens[b][:a]:
                    kids = [i for i in range(1, len(parents[b])) if parents[b][i] == cur]
                    (node,) = [i for i in kids if node_tokens[b][i] == tok]
                    spy.first += node == kids[0]
                    spy.later += node != kids[0]
                    cur = node
            return out

        monkeypatch.setattr(TreeRound, "accept", accept)


def sample(llm, options, seed_offset) -> np.ndarray:
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=seed_offset + i, **options) for i in range(N_REQ)]
    outs = llm.generate(input_ids=[PROMPT] * N_REQ, sampling_params=params, use_tqdm=False)
    assert all(len(o.token_ids) == NEW_TOKENS for o in outs)
    return np.array([o.token_ids for o in outs])


_BASELINE: dict = {}


def baseline(llm_factory, spec_models, options) -> np.ndarray:
    key = tuple(sorted(options.items()))
    if key not in _BASELINE:
        _BASELINE[key] = sample(llm_factory(spec_models["sv_target"], skip_tokenizer_init=True), options, 0)
    return _BASELINE[key]


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_tree_spec_matches_spec_off_distribution(spec_models, drafts, llm_factory, monkeypatch, case):
    draft, topk, steps, n, options = CASES[case]
    ref = baseline(llm_factory, spec_models, options)
    spy = SiblingSpy(monkeypatch)
    llm = llm_factory(spec_models["sv_target"], skip_tokenizer_init=True, speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=drafts[draft], speculative_eagle_topk=topk,
                      speculative_num_steps=steps, speculative_num_draft_tokens=n,
                      speculative_use_rejection_sampling=False,  # top-k children; sampled trees: test_spec_sampled.py
                      speculative_sampling="rejection")
    got = sample(llm, options, SPEC_SEED_OFFSET)

    state = spec_state(llm)
    # Meaningful only when verification accepted and rejected nodes, later siblings included, at depth 2 and more.
    assert 0 < state["spec_accepted_tokens"] < state["spec_draft_tokens"], state
    assert state["spec_acceptance_by_position"][1] > 0, state
    assert spy.later > 0 and spy.first > 0, (spy.first, spy.later)

    threshold = ALPHA / NUM_CHECKS
    for j in range(NEW_TOKENS):
        pv = position_pvalue(ref[:, j], got[:, j])
        assert pv > threshold, (f"{case}: position {j} token histogram differs from spec-off (p = {pv:.3g})\n"
                                f"spec-off {np.bincount(ref[:, j], minlength=SMALL_VOCAB).tolist()}\n"
                                f"spec     {np.bincount(got[:, j], minlength=SMALL_VOCAB).tolist()}")
