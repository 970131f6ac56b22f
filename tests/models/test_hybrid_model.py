"""Qwen3.5 hybrid models: the forward equals transformers' (its torch path: fla is not installed), greedy generation
equals transformers', in one prefill or in chunks, at page sizes 1 and 4; the multimodal checkpoint's language model
loads; the recurrent state counts against the memory budget; and no model can change another's layer routing."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyperdraft import LLM, SamplingParams
from hyperdraft.models.config import FULL_ATTENTION, LINEAR_ATTENTION, load_model_config
from hyperdraft.models.hybrid import FullAttentionLayer, LinearAttentionLayer
from tests.conftest import hf_greedy
from helpers.hybrid_fixtures import hybrid_models  # noqa: F401
from helpers.spec_fixtures import _single_torch_thread, llm_factory, mixed_prompts  # noqa: F401


def test_config_and_layer_kinds(hybrid_models):
    cfg = load_model_config(hybrid_models["target8"])
    assert cfg.is_hybrid and cfg.kinds == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,) + (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert (cfg.num_kv_layers, cfg.num_linear_layers, cfg.rotary_dim) == (2, 6, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.layer_types = ()  # a model's config is its own and frozen


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("chunk", [-1, 7])
def test_greedy_equals_transformers(hybrid_models, llm_factory, page_size, chunk):
    llm = _assert_greedy_equals_transformers(hybrid_models["target"], llm_factory, 3, page_size, chunk)
    runner = llm.engine.runner
    assert runner.pool.k.shape[0] == 1 and runner.state_pool.recurrent.shape[0] == 3  # K/V for 1 layer, state for 3
    assert all(isinstance(layer, FullAttentionLayer if k == FULL_ATTENTION else LinearAttentionLayer)
               for layer, k in zip(runner.model.model.layers, runner.config.kinds))


def test_a_retracted_request_recomputes_its_state(hybrid_models, llm_factory):
    """A pool too small for every request: retractions free rows (and their state slots); a request that comes back
    recomputes its state from zeros, in a slot another request used meanwhile."""
    prompts = mixed_prompts(8, seed=5, min_len=20, max_len=40)
    refs = hf_greedy(hybrid_models["target"], prompts, 16)
    llm = llm_factory(hybrid_models["target"], max_running_requests=8, max_total_tokens=680, page_size=4,
                      disable_radix_cache=True)  # (with the cache, its state comes back from a snapshot instead)
    outs = llm.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=16,
                                                                          ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [list(r) for r in refs]
    assert sum(o.meta_info["num_retractions"] for o in outs) > 0


def test_the_state_counts_against_the_budget(hybrid_models):
    """max_total_tokens holds the K/V and the recurrent state alike: more rows leave fewer K/V tokens, and a budget
    the state alone exceeds is refused, naming both fields."""
    few = LLM(hybrid_models["target"], device="cpu", max_running_requests=2, max_total_tokens=4096)
    many = LLM(hybrid_models["target"], device="cpu", max_running_requests=16, max_total_tokens=4096)
    assert few.engine.kv_capacity_slots > many.engine.kv_capacity_slots
    with pytest.raises(ValueError, match="max_total_tokens.*max_running_requests"):
        LLM(hybrid_models["target"], device="cpu", max_running_requests=64, max_total_tokens=64)


def test_the_multimodal_checkpoints_language_model_loads(hybrid_models, tmp_path, llm_factory):
    """A Qwen3_5ForConditionalGeneration checkpoint: the text config nested, weights under model.language_model,
    a vision tower and MTP weights beside them, which the language model does not load."""
    src, dst = hybrid_models["target"], str(tmp_path / "vl")
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(src, "config.json")))
    json.dump({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config":
               {**cfg, "model_type": "qwen3_5_text"}, "eos_token_id": cfg["eos_token_id"]},
              open(os.path.join(dst, "config.json"), "w"))
    weights = load_file(os.path.join(src, "model.safetensors"))
    renamed = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t for n, t in weights.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(renamed, os.path.join(dst, "model.safetensors"))
    prompts = mixed_prompts(3, seed=9, max_len=20)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    same = [o.token_ids for o in llm_factory(dst).generate(input_ids=prompts, sampling_params=params, use_tqdm=False)]
    assert same == [o.token_ids for o in llm_factory(src).generate(input_ids=prompts, sampling_params=params,
                                                                   use_tqdm=False)]


def test_unset_max_running_requests_fits_the_states_in_half_the_budget(hybrid_models):
    """Left unset, max_running_requests (256) shrinks until the recurrent states take at most half the budget;
    given, it is kept or refused."""
    llm = LLM(hybrid_models["target"], device="cpu", speculative_algorithm="NGRAM", max_total_tokens=8192)
    runner, rows = llm.engine.runner, llm.engine.max_rows
    state_bytes = runner.state_pool.conv.nbytes + runner.state_pool.recurrent.nbytes
    state_bytes += runner.state_pool.conv_scratch.nbytes + runner.state_pool.recurrent_scratch.nbytes
    snapshots = llm.engine.prefix_cache.snapshots  # one per row, charged like the row's slot
    state_bytes += sum(t.nbytes for t in snapshots.conv + snapshots.recurrent) * (rows + 1) // rows
    budget = 8192 * (runner.pool.k.nbytes + runner.pool.v.nbytes) // runner.pool.num_slots
    assert 1 <= rows < 256 and state_bytes <= budget // 2 < state_bytes * (rows + 2) / (rows + 1)
    assert llm.engine.page_table.max_rows == rows and llm.engine.scheduler.max_running == rows
    assert LLM(hybrid_models["target"], device="cpu", max_running_requests=3, max_total_tokens=8192).engine.max_rows == 3


def test_qwen3_next_config_routes_sparse_and_dense_mlps(hybrid_models):
    """decoder_sparse_step 1 with mlp_only_layers [1]: every layer but 1 has a sparse MoE MLP."""
    from hyperdraft.models.decoder import MLP
    from hyperdraft.models.loader import load_model
    from hyperdraft.models.moe import SparseMoe

    cfg = load_model_config(hybrid_models["next"])
    assert cfg.fused_gdn_projections and (cfg.moe.num_experts, cfg.moe.top_k) == (4, 2)
    model = load_model(hybrid_models["next"], "float32", torch.device("cpu"))
    assert [type(layer.mlp) for layer in model.model.layers] == [SparseMoe, MLP, SparseMoe, SparseMoe]


@pytest.mark.parametrize("page_size,chunk", [(1, -1), (4, 7)])
def test_qwen3_next_greedy_equals_transformers(hybrid_models, llm_factory, page_size, chunk):
    """Qwen3-Next's packed q|k|v|z and b|a projections, unpacked at load, and its MoE MLPs: greedy output equals
    transformers' Qwen3NextForCausalLM, with several requests batched and prefilled in chunks."""
    _assert_greedy_equals_transformers(hybrid_models["next"], llm_factory, 4, page_size, chunk)


def _assert_greedy_equals_transformers(path: str, llm_factory, seed: int, page_size: int, chunk: int):
    """Six prompts (one a single token), batched and prefilled in chunks: 12 greedy tokens each equal transformers'.
    -> the LLM, for further checks."""
    prompts = mixed_prompts(5, seed=seed, max_len=40) + [[11]]
    refs = hf_greedy(path, prompts, 12)
    llm = llm_factory(path, page_size=page_size, chunked_prefill_size=chunk, max_running_requests=8)
    outs = llm.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=12,
                                                                          ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [list(r) for r in refs]
    return llm


def test_qwen3_next_logprobs_equal_transformers(hybrid_models, llm_factory):
    """Values, not only argmaxes (a near tie hides drift from a greedy comparison): each generated token's
    log-probability equals the one transformers gives that token, within fp32 rounding."""
    from transformers import AutoModelForCausalLM

    prompt = mixed_prompts(1, seed=9, min_len=30, max_len=31)[0]
    llm = llm_factory(hybrid_models["next"], max_running_requests=2, chunked_prefill_size=8)
    out = llm.generate(input_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_new_tokens=10, ignore_eos=True, return_logprob=True), use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(hybrid_models["next"], dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.meta_info["output_token_logprobs"], dtype=torch.float64), ref,
                               atol=2e-4, rtol=0)


def test_every_pool_fits_the_budget_with_a_hybrid_draft_drafting_trees(hybrid_models):
    """A hybrid STANDALONE draft keeps scratch states out to a tree's farthest node (1 + (steps - 1) * topk = 17
    entries here), more than the target's verify width (8): the budget counts each model's own width, so both models'
    K/V and states stay within max_total_tokens' bytes (the draft's extra scratch used to go past it, 1.17x)."""
    total = 20000
    llm = LLM(hybrid_models["target"], device="cpu", max_total_tokens=total, disable_radix_cache=True,
              speculative_algorithm="STANDALONE", speculative_draft_model_path=hybrid_models["target"],
              speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    target, draft = llm.engine.runner, llm.engine.worker.proposer.runner
    assert draft.state_pool.verify_width > target.state_pool.verify_width
    kv = sum(r.pool.k.nbytes + r.pool.v.nbytes for r in (target, draft))
    states = sum(t.nbytes for r in (target, draft) for t in (r.state_pool.conv, r.state_pool.recurrent,
                                                                 r.state_pool.conv_scratch, r.state_pool.recurrent_scratch))
    per_token = sum((r.pool.k.nbytes + r.pool.v.nbytes) // r.pool.num_slots for r in (target, draft))
    assert kv + states <= (total + llm.engine.page_table.page_size) * per_token  # and the padding page


def test_a_budget_the_states_nearly_fill_is_named_at_start_up_and_per_prompt(hybrid_models, caplog):
    """max_total_tokens=464 on this hybrid leaves the K/V cache a few tokens after one row's states: the engine says
    so when it starts, and a prompt it cannot hold is refused with the cache's own size, not as max_total_tokens."""
    with caplog.at_level("WARNING", logger="hyperdraft"):
        llm = LLM(hybrid_models["target"], device="cpu", max_total_tokens=464, speculative_algorithm="NGRAM",
                  speculative_num_steps=4)
    capacity = llm.engine.kv_capacity_slots
    assert capacity < 48 and f"leaves the K/V cache {capacity} tokens, fewer than context_length" in caplog.text
    with pytest.raises(ValueError, match=f"more than the K/V cache's {capacity} "):
        llm.generate(input_ids=[list(range(1, 49))], sampling_params=SamplingParams(max_new_tokens=4), use_tqdm=False)
