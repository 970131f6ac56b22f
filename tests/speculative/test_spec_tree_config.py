"""Tree settings (speculative_eagle_topk > 1): out-of-range num_draft_tokens and NGRAM trees are rejected with a
ValueError naming the field, by the resolver and by LLM(...); the extreme valid settings (the smallest tree, every
candidate, a one-level tree of siblings) run and match plain greedy decoding."""

from __future__ import annotations

import pytest

from hyperdraft import LLM
from hyperdraft.config import EngineArgs
from hyperdraft.speculative.config import resolve_spec_config
from helpers.spec_fixtures import _single_torch_thread, gen, greedy, llm_factory, mixed_prompts, spec_models, spec_state  # noqa: F401


def resolve(**kw):
    return resolve_spec_config(EngineArgs(model_path="unused", **kw))


def standalone(steps, topk, n, draft="/d") -> dict:
    args = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft, speculative_num_steps=steps,
                speculative_eagle_topk=topk)
    if n is not None:
        args["speculative_num_draft_tokens"] = n
    return args


# (steps, topk, num_draft_tokens, the allowed range the message must state)
BAD_DRAFT_TOKENS = [
    (3, 2, 12, "[2, 11]"),  # one past every candidate + the root
    (3, 2, 100, "[2, 11]"),
    (1, 4, 6, "[2, 5]"),  # one level: topk candidates
    (5, 4, 70, "[2, 69]"),  # 4 + 4*16 candidates
    (2, 3, 1, "[2, 13]"),  # the root alone is no tree
    (3, 2, 1, "[2, 11]"),
    (3, 2, 0, "[2, 11]"),
    (3, 2, -4, "[2, 11]"),
    (3, 2, None, "[2, 11]"),  # not given: a tree needs an explicit size
]


@pytest.mark.parametrize("steps,topk,n,allowed", BAD_DRAFT_TOKENS,
                         ids=[f"steps{s}-topk{k}-n{n}" for s, k, n, _ in BAD_DRAFT_TOKENS])
def test_num_draft_tokens_out_of_range(steps, topk, n, allowed):
    with pytest.raises(ValueError) as err:
        resolve(**standalone(steps, topk, n))
    msg = str(err.value)
    assert "speculative_num_draft_tokens" in msg and allowed in msg and f"got {n}" in msg, msg


@pytest.mark.parametrize("steps,topk", [(3, 2), (1, 4), (2, 3), (5, 4)])
def test_num_draft_tokens_range_bounds_are_valid(steps, topk):
    top = topk + (steps - 1) * topk * topk + 1
    for n in (2, top):
        cfg = resolve(**standalone(steps, topk, n))
        assert (cfg.num_steps, cfg.topk, cfg.num_draft_tokens, cfg.is_tree) == (steps, topk, n, True)
        # The per-round reservation covers the verify tree and the draft's own beam (root + (steps-1)*topk fed).
        assert cfg.max_verify_tokens == max(n, 1 + (steps - 1) * topk)


@pytest.mark.parametrize("extra", [dict(speculative_num_steps=3, speculative_num_draft_tokens=8), dict(speculative_num_steps=3),
                                   dict(speculative_num_draft_tokens=8)], ids=["steps-and-n", "steps", "n"])
def test_ngram_rejects_trees(extra):
    with pytest.raises(ValueError) as err:
        resolve(speculative_algorithm="NGRAM", speculative_eagle_topk=2, **extra)
    msg = str(err.value)
    assert "speculative_eagle_topk" in msg and "NGRAM" in msg, msg


@pytest.mark.parametrize("args,field", [
    (standalone(3, 2, 12), "speculative_num_draft_tokens"),
    (standalone(3, 2, 1), "speculative_num_draft_tokens"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_eagle_topk=4), "speculative_eagle_topk"),
], ids=["n-too-big", "n-1", "ngram-topk4"])
def test_bad_tree_settings_rejected_by_llm(spec_models, args, field):
    """The same checks guard LLM(...), before any model is used."""
    if "speculative_draft_model_path" in args:
        args = {**args, "speculative_draft_model_path": spec_models["draft_small"]}
    with pytest.raises(ValueError) as err:
        LLM(spec_models["target"], device="cpu", dtype="float32", **args)
    assert field in str(err.value), str(err.value)


@pytest.mark.parametrize("steps,topk,n", [(3, 2, 2), (1, 4, 5), (2, 3, 13), (4, 2, 2)],
                         ids=["smallest-tree", "one-level-siblings", "every-candidate", "deep-beam-one-node"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_extreme_valid_trees_match_spec_off(spec_models, llm_factory, steps, topk, n, page_size):
    prompts = mixed_prompts(8, seed=41)
    params = [greedy(3 + 2 * i) for i in range(len(prompts))]
    ref = gen(llm_factory(spec_models["target"]), prompts, params)
    llm = llm_factory(spec_models["target"], page_size=page_size,
                      **standalone(steps, topk, n, draft=spec_models["draft_wide_noisy"]))
    outs = gen(llm, prompts, params)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.token_ids == r.token_ids, f"request {i}"
    state = spec_state(llm)
    assert state["spec_draft_tokens"] == (n - 1) * state["spec_verifies"]
    assert state["spec_accepted_tokens"] > 0
    # A verify accepts at most min(steps, n - 1) draft tokens.
    assert all(h == 0 for h in state["spec_accept_length_histogram"][min(steps, n - 1) + 2:])
    assert llm.engine.scheduler.decode_reserve == max(n, 1 + (steps - 1) * topk)
