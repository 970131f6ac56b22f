"""MTP: a hybrid checkpoint's own multi-token-prediction module drafts (NEXTN, MTP, or EAGLE without a draft path).
Chains, trees and adaptive tiers equal speculation off; a bigram target with a pass-through MTP module is drafted
perfectly (the head's alignment: position i reads token i+1 and predicts token i+2); sampled MTP chains and trees
keep the target's distribution; the head owns its config and cannot change the target's routing."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hyperdraft import SamplingParams
from hyperdraft.models.hybrid import FullAttentionLayer, LinearAttentionLayer
from hyperdraft.models.mtp import MtpHead
from hyperdraft.testing.tiny import make_tiny_model
from helpers.hybrid_fixtures import hybrid_models, with_mtp_weights  # noqa: F401
from helpers.spec_fixtures import (_single_torch_thread, assert_same_position_distributions, gen, greedy,  # noqa: F401
                                   llm_factory, mixed_prompts, spec_state)

NEW_TOKENS = [18, 7, 25, 12, 3, 20, 9, 14, 16]


def _run(llm, prompts):
    return [o.token_ids for o in gen(llm, prompts, [greedy(n) for n in NEW_TOKENS])]


@pytest.mark.parametrize("name,extra", [
    ("NEXTN-chain", dict(speculative_algorithm="NEXTN")),
    ("MTP-chain-5", dict(speculative_algorithm="MTP", speculative_num_steps=5)),
    ("EAGLE-tree", dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_eagle_topk=2,
                        speculative_num_draft_tokens=6)),
    ("NEXTN-adaptive", dict(speculative_algorithm="NEXTN", speculative_adaptive=True)),
])
@pytest.mark.parametrize("model,page_size", [("with_mtp", 1), ("with_mtp", 4), ("accepting_mtp", 4)],
                         ids=["random-1", "random-4", "accepting-4"])
def test_mtp_equals_spec_off(hybrid_models, llm_factory, name, extra, model, page_size):
    """The random head's drafts are (almost) all rejected; the near-bigram checkpoint's are accepted often: the
    recurrent states advanced over accepted drafts, and the K/V of accepted tree paths compacted."""
    prompts = mixed_prompts(len(NEW_TOKENS), seed=31, max_len=40)
    ref = _run(llm_factory(hybrid_models[model], max_running_requests=16), prompts)
    llm = llm_factory(hybrid_models[model], max_running_requests=16, page_size=page_size, **extra)
    assert isinstance(llm.engine.worker.proposer.head, MtpHead)
    assert _run(llm, prompts) == ref
    assert spec_state(llm)["spec_draft_tokens"] > 0
    if model == "accepting_mtp":
        assert_drafts_accepted(spec_state(llm))


def assert_drafts_accepted(state: dict) -> None:
    """A good share of the drafts accepted, paths of two and more among them: acceptance cannot silently stop."""
    assert state["spec_accepted_tokens"] >= 0.05 * state["spec_draft_tokens"], state
    assert state["spec_acceptance_by_position"][1] > 0, state


@pytest.mark.parametrize("extra", [
    dict(speculative_algorithm="MTP", speculative_num_steps=3),
    dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=2,
         speculative_num_draft_tokens=6),
    dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4),
], ids=["MTP-chain", "NEXTN-tree", "NGRAM"])
@pytest.mark.parametrize("model", ["next_with_mtp", "next_accepting_mtp"], ids=["random", "accepting"])
def test_qwen3_next_speculation_equals_spec_off(hybrid_models, llm_factory, extra, model):
    """Qwen3-Next: sparse MoE MLPs in the target and in its MTP layer (layer 0 is sparse at decoder_sparse_step 1).
    On the near-bigram checkpoint MTP drafts are accepted often (asserted)."""
    from hyperdraft.models.moe import SparseMoe

    prompts = mixed_prompts(len(NEW_TOKENS), seed=33, max_len=40)
    ref = _run(llm_factory(hybrid_models[model], max_running_requests=16), prompts)
    llm = llm_factory(hybrid_models[model], max_running_requests=16, page_size=4, **extra)
    if extra["speculative_algorithm"] != "NGRAM":
        assert isinstance(llm.engine.worker.proposer.head.layers[0].mlp, SparseMoe)
    assert _run(llm, prompts) == ref
    assert spec_state(llm)["spec_draft_tokens"] > 0
    if model == "next_accepting_mtp" and extra["speculative_algorithm"] != "NGRAM":
        assert_drafts_accepted(spec_state(llm))


def test_a_checkpoint_without_mtp_weights_is_a_clear_error(hybrid_models):
    from hyperdraft import LLM

    with pytest.raises(ValueError, match="no mtp.* weights.*NEXTN"):
        LLM(hybrid_models["target"], device="cpu", speculative_algorithm="NEXTN", max_running_requests=4)


def test_the_head_owns_its_config_and_cannot_reroute_the_target(hybrid_models, llm_factory):
    """Seed 000's first bug: an MTP draft rewrote a config it shared with the target, and layer routing read that
    config. Here the head's config is a frozen copy, routing is by module type, and drafting changes neither."""
    llm = llm_factory(hybrid_models["with_mtp"], speculative_algorithm="NEXTN", max_running_requests=4)
    target, head = llm.engine.runner.model, llm.engine.worker.proposer.head
    kinds_before = [type(layer) for layer in target.model.layers]
    assert head.config.layer is not target.config and head.config.layer.kinds == ("full_attention",)
    assert target.config.kinds.count("linear_attention") == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        head.config.layer.layer_types = ()
    gen(llm, mixed_prompts(3, seed=2, max_len=20), [greedy(8)] * 3)
    assert [type(layer) for layer in target.model.layers] == kinds_before
    assert kinds_before.count(LinearAttentionLayer) == 3 and kinds_before.count(FullAttentionLayer) == 1


def _bigram_with_passthrough_mtp(root: str) -> str:
    """A target whose every layer adds nothing (output projections zero): logits depend on the current token only.
    Its MTP module passes the embedding through (fc = [I | 0], zero layer outputs, the final norm's weights), so it
    predicts exactly what the target will."""
    path = make_tiny_model(os.path.join(root, "bigram"), "qwen3_5", seed=7)
    weights = load_file(os.path.join(path, "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, os.path.join(path, "model.safetensors"))
    mtp = with_mtp_weights(path, os.path.join(root, "bigram_mtp"))
    weights = load_file(os.path.join(mtp, "model.safetensors"))
    hidden = weights["model.norm.weight"].shape[0]
    weights["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    weights["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)  # (1 + 0): plain RMS normalisation
    weights["mtp.norm.weight"] = weights["model.norm.weight"].clone()
    for name in ("mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.down_proj.weight"):
        weights[name] = torch.zeros_like(weights[name])
    save_file(weights, os.path.join(mtp, "model.safetensors"))
    return mtp


def test_a_passthrough_mtp_drafts_a_bigram_target_perfectly(llm_factory, tmp_path):
    path = _bigram_with_passthrough_mtp(str(tmp_path))
    llm = llm_factory(path, speculative_algorithm="NEXTN", speculative_num_steps=4, max_running_requests=8)
    prompts = mixed_prompts(4, seed=6, max_len=20)
    ref = gen(llm_factory(path, max_running_requests=8), prompts, [greedy(24)] * 4)
    assert [o.token_ids for o in gen(llm, prompts, [greedy(24)] * 4)] == [o.token_ids for o in ref]
    state = spec_state(llm)
    assert state["spec_acceptance_rate"] > 0.95, state  # a drop means the head reads the wrong token or position


# ---- sampled MTP keeps the target's distribution ---------------------------------------------------------------------
# A 12-token target continues one prompt by 4 tokens 3000 times, spec off (seeds 0..2999) and with MTP (seeds
# 10^6 + i: independent samples); per position a two-sample chi-square test at 1e-6 / 4 (Bonferroni): each test's
# false-failure probability is at most 1e-6, and the seeds are fixed.
VOCAB, N_REQ, STEPS_OUT, ALPHA = 12, 3000, 4, 1e-6
PROMPT = [5, 2, 9, 0, 11, 3, 7, 4]


@pytest.fixture(scope="module")
def small_vocab_mtp(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("sv_hybrid")
    target = make_tiny_model(str(root / "t"), "qwen3_5", seed=9, vocab_size=VOCAB, eos_token_id=None,
                             with_tokenizer=False)
    return with_mtp_weights(target, str(root / "m"), seed=10)


def _sample(llm, offset: int) -> np.ndarray:
    params = [SamplingParams(temperature=1.0, max_new_tokens=STEPS_OUT, ignore_eos=True, seed=offset + i)
              for i in range(N_REQ)]
    return np.array([o.token_ids for o in llm.generate(input_ids=[PROMPT] * N_REQ, sampling_params=params,
                                                       use_tqdm=False)])


@pytest.mark.parametrize("extra", [dict(speculative_num_steps=3, speculative_use_rejection_sampling=True),
                                   dict(speculative_num_steps=3, speculative_eagle_topk=3,
                                        speculative_num_draft_tokens=7, speculative_use_rejection_sampling=True)],
                         ids=["chain", "tree"])
def test_sampled_mtp_keeps_the_target_distribution(small_vocab_mtp, llm_factory, extra):
    base = dict(skip_tokenizer_init=True, max_running_requests=256)
    ref = _sample(llm_factory(small_vocab_mtp, **base), 0)
    llm = llm_factory(small_vocab_mtp, speculative_algorithm="NEXTN", **base, **extra)
    got = _sample(llm, 10**6)
    state = spec_state(llm)
    assert 0 < state["spec_accepted_tokens"] < state["spec_draft_tokens"], state
    assert_same_position_distributions(got=got, ref=ref, vocab=VOCAB, alpha=ALPHA)


@pytest.mark.parametrize("extra", [dict(speculative_num_steps=3),
                                   dict(speculative_num_steps=3, speculative_eagle_topk=3, speculative_num_draft_tokens=7)],
                         ids=["chain", "tree"])
def test_coupled_mtp_equals_plain_decoding(small_vocab_mtp, llm_factory, extra):
    """The default coupled verification: sampled MTP speculation emits plain decoding's tokens, seed for seed."""
    base = dict(skip_tokenizer_init=True)
    params = [SamplingParams(temperature=1.0, max_new_tokens=STEPS_OUT, ignore_eos=True, seed=i) for i in range(16)]
    want = [o.token_ids for o in gen(llm_factory(small_vocab_mtp, **base), [PROMPT] * 16, params)]
    llm = llm_factory(small_vocab_mtp, speculative_algorithm="NEXTN", **base, **extra)
    assert [o.token_ids for o in gen(llm, [PROMPT] * 16, params)] == want
    state = spec_state(llm)
    assert 0 < state["spec_accepted_tokens"] < state["spec_draft_tokens"], state
