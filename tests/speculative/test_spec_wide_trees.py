"""Wide and deep draft trees (topk 8, up to 64 verified nodes, up to 10 steps) are lossless: greedy output with
speculation is token for token plain decoding's, for STANDALONE, EAGLE-3 and MTP drafters, with emulated CUDA graphs,
adaptive ladders of wide tiers, and a KV pool so tight that requests are retracted mid-speculation. Coupled sampled
output equals plain sampled decoding. A topk the drafter's vocabulary cannot fill, and malformed wide shapes, are
start-up errors naming the field and its allowed values. Sampled requests verified by rejection sampling through
topk-8 trees keep the target's distribution (the last section states its false-failure probability: 1e-6).

The shapes: the benchmarks' wide trees (5x8/16, 6x4/16), a wide and deep one (8x8/64), a 10-deep one (10x4/32), a
tree of every candidate at topk 8 (3x8/137, the most num_draft_tokens allows), the least it allows under a 10-deep
beam (10x8/2), and topk equal to an EAGLE-3 head's draft_vocab_size (8). Batches mix prompt lengths 1..60 and
output lengths 1..24, page_size 4, chunked prefill: rows finish while others are mid-round.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from hyperdraft import LLM, SamplingParams
from hyperdraft.llm import meta_info
from hyperdraft.speculative.adaptive.tier import max_tree_tokens
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model
from helpers.hybrid_fixtures import hybrid_models  # noqa: F401
from helpers.spec_fixtures import (_single_torch_thread, _widened_copy, gen, greedy, llm_factory,  # noqa: F401
                                   mixed_prompts, position_pvalue, spec_models, spec_state, step_until_done)

NEW_TOKENS = [24, 1, 9, 17, 3, 12]
EAGLE_VOCAB, DRAFT_VOCAB = 16, 8
EMULATE_GRAPHS_ENV = "HYPERDRAFT_EMULATE_CUDA_GRAPH"  # a RuntimeOptions override (hyperdraft/options.py)
WIDE_LADDER = {"ema_alpha": 0.5, "warmup_batches": 1, "update_interval": 1, "up_hysteresis": -1.0,
               "1": {"candidate_steps": [1, {"steps": 5, "topk": 8, "num_draft_tokens": 16},
                                         {"steps": 6, "topk": 4, "num_draft_tokens": 16},
                                         {"steps": 8, "topk": 8, "num_draft_tokens": 64}]},
               "4": {"candidate_steps": [0, 2, {"steps": 10, "topk": 4, "num_draft_tokens": 32}]}}


@pytest.fixture(scope="module")
def models(spec_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("wide_trees")
    small = make_tiny_model(str(root / "small"), "llama", num_hidden_layers=6, vocab_size=EAGLE_VOCAB,
                            with_tokenizer=False)
    (root / "wide.json").write_text(json.dumps(WIDE_LADDER))
    # the 12-token target widened, with perturbed weights: partial agreement at every depth (the sampled section)
    noisy = _widened_copy(spec_models["sv_target"], str(root / "sv_noisy"), rel_noise=0.15, seed=7)
    return dict(spec_models, small=small, ladder=str(root / "wide.json"), sv_noisy=noisy,
                eagle3=write_random_eagle_checkpoint(str(root / "e3"), small, kind="eagle3",
                                                     draft_vocab_size=DRAFT_VOCAB, seed=3))


def tree(algo: str, steps: int, topk: int, n: int) -> dict:
    return dict(speculative_algorithm=algo, speculative_num_steps=steps, speculative_eagle_topk=topk,
                speculative_num_draft_tokens=n)


# name: (target, drafter or None (the target's own MTP module), vocabulary, engine args)
CASES = {
    "standalone-5x8-n16": ("target", "draft_wide_noisy", 384, tree("STANDALONE", 5, 8, 16)),
    "standalone-6x4-n16": ("target", "draft_wide_noisy", 384, tree("STANDALONE", 6, 4, 16)),
    "standalone-8x8-n64": ("target", "draft_wide_noisy", 384, tree("STANDALONE", 8, 8, 64)),
    "standalone-10x4-n32": ("target", "draft_wide_noisy", 384, tree("STANDALONE", 10, 4, 32)),
    "standalone-3x8-nmax": ("target", "draft_wide_noisy", 384, tree("STANDALONE", 3, 8, max_tree_tokens(3, 8))),
    "standalone-10x8-nmin": ("target", "draft_wide_noisy", 384, tree("STANDALONE", 10, 8, 2)),
    "eagle3-6x8-n32-topk-is-draft-vocab": ("small", "eagle3", EAGLE_VOCAB, tree("EAGLE3", 6, DRAFT_VOCAB, 32)),
    "mtp-6x8-n32": ("with_mtp", None, 384, tree("EAGLE", 6, 8, 32)),
    # a near-bigram hybrid target: paths of several MTP drafts accepted (the random head's are all but never)
    "mtp-accepting-6x8-n32": ("accepting_mtp", None, 384, tree("EAGLE", 6, 8, 32)),
}
_REF: dict = {}


def _paths(models, hybrid_models, case: str) -> tuple[str, dict]:
    target, draft, _, args = CASES[case]
    if draft is None:
        return hybrid_models[target], dict(args)
    return models[target], dict(args, speculative_draft_model_path=models[draft])


def _spec_off(path: str, prompts, params) -> list[list[int]]:
    key = (path, tuple(map(tuple, prompts)), tuple(map(repr, params)))
    if key not in _REF:
        _REF[key] = [o.token_ids for o in gen(LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True),
                                              prompts, params)]
    return _REF[key]


@pytest.mark.parametrize("case", list(CASES))
def test_wide_and_deep_trees_equal_spec_off(models, hybrid_models, llm_factory, case):
    path, args = _paths(models, hybrid_models, case)
    prompts, params = mixed_prompts(len(NEW_TOKENS), seed=5, vocab=CASES[case][2], max_len=60), list(map(greedy, NEW_TOKENS))
    llm = llm_factory(path, skip_tokenizer_init=True, page_size=4, chunked_prefill_size=32, max_running_requests=8,
                      **args)
    outs = [o.token_ids for o in gen(llm, prompts, params)]
    assert outs == _spec_off(path, prompts, params), case
    state = spec_state(llm)
    n, steps = args["speculative_num_draft_tokens"], args["speculative_num_steps"]
    assert state["spec_draft_tokens"] == (n - 1) * state["spec_verifies"] > 0, state  # every verify a full tree
    assert all(h == 0 for h in state["spec_accept_length_histogram"][min(steps, n - 1) + 2:]), state
    if CASES[case][1] == "draft_wide_noisy" or CASES[case][0] == "accepting_mtp":  # accepted paths of several nodes
        assert max(a for a, h in enumerate(state["spec_accept_length_histogram"]) if h) >= min(3, n), state


def test_coupled_sampling_through_a_wide_deep_tree_equals_plain_sampling(models, llm_factory):
    """Coupled verification (the default) of sampled requests gives plain sampled decoding's very tokens; a 64-node
    tree 8 deep, with top-k/top-p filters narrower than the tree's 8 siblings."""
    prompts = mixed_prompts(len(NEW_TOKENS), seed=6, max_len=60)
    params = [SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=k, ignore_eos=True, seed=i)
              for i, k in enumerate(NEW_TOKENS)]
    llm = llm_factory(models["target"], skip_tokenizer_init=True, page_size=4,
                      speculative_draft_model_path=models["draft_wide_noisy"], **tree("STANDALONE", 8, 8, 64))
    assert [o.token_ids for o in gen(llm, prompts, params)] == _spec_off(models["target"], prompts, params)
    state = spec_state(llm)
    assert 0 < state["spec_accepted_tokens"] < state["spec_draft_tokens"], state


@pytest.mark.parametrize("drafter", ["standalone", "eagle3"])
def test_wide_adaptive_ladder_under_emulated_graphs_equals_spec_off(models, llm_factory, monkeypatch, drafter):
    """An adaptive ladder of the wide tiers (5x8/16, 6x4/16, 8x8/64 at batch 1; a 10x4/32 tier at batch 4), run as
    emulated CUDA graphs (batches up to 4) and eagerly above: outputs unchanged, and wide tiers really ran."""
    target, draft, vocab = ("target", "draft_wide_noisy", 384) if drafter == "standalone" else ("small", "eagle3",
                                                                                                  EAGLE_VOCAB)
    prompts, params = mixed_prompts(len(NEW_TOKENS), seed=7, vocab=vocab, max_len=60), list(map(greedy, NEW_TOKENS))
    want = _spec_off(models[target], prompts, params)
    monkeypatch.setenv(EMULATE_GRAPHS_ENV, "1")
    llm = llm_factory(models[target], skip_tokenizer_init=True, page_size=4, cuda_graph_max_bs=4,
                      speculative_algorithm="STANDALONE" if drafter == "standalone" else "EAGLE3",
                      speculative_draft_model_path=models[draft], speculative_adaptive=True,
                      speculative_adaptive_config=models["ladder"])
    assert llm.engine.worker.proposer.runner.graphs is not None
    assert [o.token_ids for o in gen(llm, prompts, params)] == want
    tiers = spec_state(llm)["spec_steps_per_tier"]
    assert any("x8/" in t for t in tiers), tiers  # a topk-8 tier ran
    assert llm.engine.scheduler.decode_reserve == 64  # sized for the 8x8/64 tier from the start


@pytest.mark.parametrize("page_size", [1, 4])
def test_wide_tree_with_a_tight_pool_retracts_and_equals_spec_off(models, llm_factory, page_size):
    """8 requests, 64-node trees (a 64-slot reservation each) and 160 KV slots, prefix cache and 16-token chunks:
    requests are retracted after they have been through a verify, and recomputed; outputs do not change."""
    prompts = mixed_prompts(8, seed=9, max_len=60)
    params = [greedy(k) for k in [30, 12, 25, 8, 40, 3, 20, 16]]
    want = _spec_off(models["target"], prompts, params)
    llm = llm_factory(models["target"], skip_tokenizer_init=True, page_size=page_size, max_total_tokens=160,
                      chunked_prefill_size=16, speculative_draft_model_path=models["draft_wide_noisy"],
                      **tree("STANDALONE", 6, 8, 64))
    engine = llm.engine
    reqs = [engine.add_request(input_ids=p, params=sp) for p, sp in zip(prompts, params)]
    _, retracted_while_speculating = step_until_done(engine, reqs, page_size, 3000, check_draft=True)
    assert [r.output_ids for r in reqs] == want
    assert retracted_while_speculating > 0, [meta_info(r)["num_retractions"] for r in reqs]


TOO_WIDE = {  # name: (target, drafter, engine args without the drafter, the range the message must state, field)
    "eagle3-topk-over-draft-vocab": ("small", "eagle3", tree("EAGLE3", 3, DRAFT_VOCAB + 1, 16), f"[1, {DRAFT_VOCAB}]",
                                     "speculative_eagle_topk"),
    "standalone-topk-over-vocab": ("sv_target", "sv_draft", tree("STANDALONE", 3, 13, 16), "[1, 12]",
                                   "speculative_eagle_topk"),
    "adaptive-tier-over-draft-vocab": ("small", "eagle3", dict(speculative_algorithm="EAGLE3", speculative_adaptive=True,
                                                               ladder=[1, {"steps": 5, "topk": 9, "num_draft_tokens": 16}]),
                                       f"[1, {DRAFT_VOCAB}]", "speculative_adaptive_config tier 5x9/16: topk"),
    # the flag's own topk under SGLang's default ladder: the flag is named, not a tier the user never wrote
    "adaptive-flag-over-draft-vocab": ("small", "eagle3", dict(tree("EAGLE3", 3, DRAFT_VOCAB + 1, 16),
                                                               speculative_adaptive=True),
                                       f"[1, {DRAFT_VOCAB}]", "speculative_eagle_topk"),
}


@pytest.mark.parametrize("case", list(TOO_WIDE))
def test_topk_beyond_the_drafters_vocabulary_is_a_start_up_error(models, tmp_path, case):
    """A beam takes each node's topk most likely children: the drafter's vocabulary must hold that many (on CUDA the
    top-k kernel asserted otherwise; on CPU an out-of-range torch.topk failed the first round)."""
    target, draft, args, allowed, field = TOO_WIDE[case]
    if "ladder" in args:
        path = tmp_path / "ladder.json"
        path.write_text(json.dumps({"1": {"candidate_steps": args["ladder"]}}))
        args = {**{k: v for k, v in args.items() if k != "ladder"}, "speculative_adaptive_config": str(path)}
    with pytest.raises(ValueError) as err:
        LLM(models[target], device="cpu", dtype="float32", skip_tokenizer_init=True,
            speculative_draft_model_path=models[draft], **args)
    msg = str(err.value)
    assert msg.startswith(field) and allowed in msg and "vocabulary" in msg, msg


BAD_WIDE = [  # (steps, topk, num_draft_tokens, field, what the message must state)
    (5, 8, max_tree_tokens(5, 8) + 1, "speculative_num_draft_tokens", "[2, 265]"),
    (10, 10, 912, "speculative_num_draft_tokens", "[2, 911]"),
    (1, 8, 16, "speculative_num_draft_tokens", "[2, 9]"),  # one level holds topk candidates
    (0, 8, 16, "speculative_num_steps", ">= 1"),
    (6, 0, 16, "speculative_eagle_topk", ">= 1"),
    (10, 22, 4097, "speculative_num_draft_tokens", "[2, 4096]"),  # a sampled tree's node streams (TREE_NODE_LIMIT)
]


@pytest.mark.parametrize("steps,topk,n,field,allowed", BAD_WIDE, ids=[f"{s}x{k}-n{n}" for s, k, n, _, _ in BAD_WIDE])
def test_malformed_wide_shapes_are_rejected_by_name(spec_models, steps, topk, n, field, allowed):
    with pytest.raises(ValueError) as err:
        LLM(spec_models["target"], device="cpu", dtype="float32", speculative_draft_model_path=spec_models["draft_small"],
            **tree("STANDALONE", steps, topk, n))
    msg = str(err.value)
    assert msg.startswith(field) and allowed in msg, msg


def test_a_ladders_tree_tier_without_steps_is_named_as_such(models, tmp_path):
    """A tree tier of 0 steps: the message names the steps, not a num_draft_tokens range its count may lie in."""
    path = tmp_path / "ladder.json"
    path.write_text(json.dumps({"1": {"candidate_steps": [1, {"steps": 0, "topk": 8, "num_draft_tokens": 5}]}}))
    with pytest.raises(ValueError, match=r"tree tier topk=8 needs steps >= 1, got steps=0"):
        LLM(models["target"], device="cpu", dtype="float32", speculative_algorithm="STANDALONE",
            speculative_draft_model_path=models["draft_small"], speculative_adaptive=True,
            speculative_adaptive_config=str(path))


# ---- sampled requests through wide trees, verified by rejection sampling: the target's distribution ----------------
# A 12-token target continues one prompt by DIST_TOKENS tokens, DIST_REQ times spec-off (seeds 0..) and with a wide tree
# (seeds 10^6..: independent samples); per position a two-sample chi-square test (test_spec_tree_sampled's pooling of
# rare tokens) at DIST_ALPHA / (cases * positions), Bonferroni: this section's false-failure probability is at most
# DIST_ALPHA = 1e-6. Every seed is fixed, so the outcome is deterministic. topk 8 of 12 tokens: most of the vocabulary
# is a sibling, and under top_k=6 the 7th and 8th siblings have no mass under q (drawn trees) or p.
DIST_REQ, DIST_TOKENS, DIST_ALPHA = 3000, 4, 1e-6
DIST_PROMPT = [5, 2, 9, 0, 11, 3, 7, 4]
FILTERED = dict(temperature=0.8, top_k=6, top_p=0.95, repetition_penalty=1.2)
DIST_CASES = {  # name: (sampling options, engine args but the drafter)
    "topk-children-4x8-n32": (dict(temperature=1.0), dict(tree("STANDALONE", 4, 8, 32), speculative_sampling="rejection",
                                                          speculative_use_rejection_sampling=False)),
    "drawn-children-5x8-n40-filtered": (FILTERED, dict(tree("STANDALONE", 5, 8, 40),
                                                       speculative_use_rejection_sampling=True)),
}


def _sample(llm, options, seed0):
    params = [SamplingParams(max_new_tokens=DIST_TOKENS, ignore_eos=True, seed=seed0 + i, **options)
              for i in range(DIST_REQ)]
    return np.array([o.token_ids for o in gen(llm, [DIST_PROMPT] * DIST_REQ, params)])


@pytest.mark.parametrize("case", list(DIST_CASES))
def test_rejection_sampled_wide_trees_keep_the_target_distribution(models, llm_factory, case):
    options, args = DIST_CASES[case]
    ref = _sample(llm_factory(models["sv_target"], skip_tokenizer_init=True), options, 0)
    llm = llm_factory(models["sv_target"], skip_tokenizer_init=True, speculative_draft_model_path=models["sv_noisy"], **args)
    got = _sample(llm, options, 10**6)
    state = spec_state(llm)
    assert 0 < state["spec_accepted_tokens"] < state["spec_draft_tokens"], state  # accepted and rejected nodes
    assert state["spec_acceptance_by_position"][2] > 0, state  # paths of 3 and more
    threshold = DIST_ALPHA / (len(DIST_CASES) * DIST_TOKENS)
    for j in range(DIST_TOKENS):
        pv = position_pvalue(ref[:, j], got[:, j])
        assert pv > threshold, f"{case}: position {j} differs from spec-off (p = {pv:.3g})"
