"""The walk the CUDA backend runs, on CPU: plan_walk's device-built parents and targets, fed to walk_reference (the
token-by-token oracle the Triton kernels are tested against on GPU), give the same greedy output as speculation off
in the engine. Oracle chains and trees accept every length, so every verify token's parent and scratch entry
matters; a hybrid self-draft's steps start from scratch entries of earlier forwards (state_targets). So the kernels'
oracle and the engine agree on what every state is."""

from __future__ import annotations

import pytest

from hyperdraft.attention.linear_backend import TritonLinearBackend
from hyperdraft.kernels.gated_delta_walk import walk_reference
from hyperdraft.speculative.proposers import PROPOSERS
from helpers.hybrid_fixtures import Oracle, OracleChain, OracleTree, hybrid_models  # noqa: F401
from helpers.spec_fixtures import _single_torch_thread, gen, greedy, llm_factory, mixed_prompts, spec_state  # noqa: F401

NEW_TOKENS = [14, 5, 18, 9, 11, 3]


class WalkReferenceBackend(TritonLinearBackend):
    def forward(self, layer, mixed, gates, conv_weight, walk):
        pool, cfg = self.pool, self.cfg
        return walk_reference(mixed, conv_weight, *gates.decay_and_beta(), pool.conv[layer], pool.conv_scratch[layer],
                              pool.recurrent[layer], pool.recurrent_scratch[layer], walk, cfg.key_dim, cfg.k_head_dim)


def _use_walk_reference(runner) -> None:
    runner.linear_backend = WalkReferenceBackend(runner.state_pool)


@pytest.mark.parametrize("shape", ["plain-chunked", "oracle-chain", "oracle-tree", "self-draft-tree"])
def test_the_walk_reference_equals_speculation_off(hybrid_models, llm_factory, monkeypatch, shape):
    path = hybrid_models["target"]
    prompts = mixed_prompts(len(NEW_TOKENS), seed=12, max_len=30)
    params = [greedy(n) for n in NEW_TOKENS]
    outs = gen(llm_factory(path, max_running_requests=8), prompts, params)
    reference = {tuple(p): o.token_ids for p, o in zip(prompts, outs)}
    extra = dict(chunked_prefill_size=8)
    if shape == "oracle-chain":
        monkeypatch.setitem(PROPOSERS, "NGRAM", OracleChain)
        extra = dict(speculative_algorithm="NGRAM", speculative_num_steps=4)
    elif shape == "oracle-tree":
        monkeypatch.setitem(PROPOSERS, "STANDALONE", OracleTree)
        extra = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=path, speculative_num_steps=3,
                     speculative_eagle_topk=2, speculative_num_draft_tokens=7)
    elif shape == "self-draft-tree":
        extra = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=path, speculative_num_steps=3,
                     speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    Oracle.reset(reference, seed=3)
    llm = llm_factory(path, max_running_requests=8, **extra)
    _use_walk_reference(llm.engine.runner)
    if shape == "self-draft-tree":
        _use_walk_reference(llm.engine.worker.proposer.runner)
    assert [o.token_ids for o in gen(llm, prompts, params)] == [reference[tuple(p)] for p in prompts]
    if shape != "plain-chunked":
        hist = spec_state(llm)["spec_accept_length_histogram"]
        assert sum(hist[2:]) > 0, hist  # verify tokens past the root were accepted: their states were used
