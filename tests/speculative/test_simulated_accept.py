"""Benchmark-only modes: simulated acceptance (lossy, marked) and load_format="dummy".

Simulated acceptance replaces only the accept decision, so:
  alpha = 0  accepts nothing; the one emitted token per step is drawn from the target's p at row 0, so greedy output
             equals spec-off output (a check that the verify forward still runs and is read correctly)
  alpha = 1  accepts every draft: each round commits steps + 1 tokens whatever the draft is
  0 < alpha  the first draft of a round is accepted with probability alpha (binomial test below)
"""

from __future__ import annotations

import math

import pytest
import torch

from hyperdraft import LLM
from hyperdraft.speculative.verify.simulated import simulate_chain
from helpers.spec_fixtures import (_single_torch_thread, gen, greedy, llm_factory, mixed_prompts, spec_models,  # noqa: F401
                           spec_off_reference, spec_state)

_REF: dict = {}
CHAIN = dict(speculative_algorithm="STANDALONE", speculative_num_steps=3)
TREE = dict(speculative_algorithm="STANDALONE", speculative_num_steps=3, speculative_eagle_topk=2,
            speculative_num_draft_tokens=6)


def _args(spec_models, shape: dict, alpha: float) -> dict:
    return dict(shape, speculative_draft_model_path=spec_models["draft_small"], speculative_simulate_accept_rate=alpha)


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_alpha_zero_keeps_spec_off_output(spec_models, llm_factory, shape):
    prompts, params = mixed_prompts(4, seed=5), [greedy(n) for n in (9, 3, 14, 6)]
    refs = spec_off_reference(_REF, spec_models, prompts, params, "plain")
    llm = llm_factory(spec_models["target"], **_args(spec_models, shape, 0.0))
    outs = gen(llm, prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert all(o.meta_info["simulated_accept_rate"] == 0.0 for o in outs)  # outputs of this mode are marked
    assert spec_state(llm)["speculative_simulate_accept_rate"] == 0.0


def test_alpha_one_accepts_every_draft(spec_models, llm_factory):
    # draft_small is unrelated to the target (real verification rejects nearly everything), yet every chain round
    # commits steps + 1 = 4 tokens: the prefill gives 1 token, then 3 rounds give 4 + 4 + 3.
    llm = llm_factory(spec_models["target"], **_args(spec_models, CHAIN, 1.0))
    outs = gen(llm, mixed_prompts(3, seed=8, min_len=5), greedy(12))
    for out in outs:
        assert out.meta_info["completion_tokens"] == 12
        assert out.meta_info["spec_verify_ct"] == 3
        assert out.meta_info["spec_accepted_tokens"] == 9  # counted as verified, even past max_new_tokens


def test_alpha_one_tree_follows_first_children(spec_models, llm_factory):
    # A tree walk at alpha = 1 descends the first-child chain as deep as it goes (the root always has a first child,
    # so every round accepts at least one draft, and chains of depth 2+ exist in a 6-node, 3-step tree).
    llm = llm_factory(spec_models["target"], **_args(spec_models, TREE, 1.0))
    outs = gen(llm, mixed_prompts(3, seed=8, min_len=5), greedy(24))
    for out in outs:
        verify, accepted = out.meta_info["spec_verify_ct"], out.meta_info["spec_accepted_tokens"]
        assert accepted >= verify and accepted > 1.5 * verify, (verify, accepted)


def test_sibling_rate_lets_trees_accept_more(spec_models, llm_factory):
    """speculative_simulate_sibling_rate = 1: at every node the second child matches whenever the first does not, so
    each round of a 2-wide tree accepts at least one draft even at alpha 0; the engine reports the rate."""
    llm = llm_factory(spec_models["target"], **_args(spec_models, TREE, 0.0), speculative_simulate_sibling_rate=1.0)
    outs = gen(llm, mixed_prompts(3, seed=8, min_len=5), greedy(24))
    for out in outs:
        verify, accepted = out.meta_info["spec_verify_ct"], out.meta_info["spec_accepted_tokens"]
        assert accepted >= verify, (verify, accepted)
    assert spec_state(llm)["speculative_simulate_sibling_rate"] == 1.0


def test_first_draft_acceptance_is_binomial():
    # n rows, 4 one-hot drafts each; draft 0 passes with probability alpha. Under H0 the count is Binomial(n, alpha);
    # |z| > 5.0 happens with probability < 6e-7 (normal tail; n*alpha*(1-alpha) = 4800 makes the approximation tight).
    n, k, alpha, vocab = 20000, 4, 0.6, 16
    p = torch.softmax(torch.randn(n, k + 1, vocab, generator=torch.Generator().manual_seed(0)), -1)
    draft = torch.randint(0, vocab, (n, k), generator=torch.Generator().manual_seed(1))
    num_accepted, tokens = simulate_chain(p, draft, torch.full((n,), k), alpha, torch.arange(n), torch.full((n,), 50))
    passed = (num_accepted >= 1).sum().item()
    z = (passed - n * alpha) / math.sqrt(n * alpha * (1 - alpha))
    assert abs(z) < 5.0, z
    # accepted drafts are emitted as drafted, whatever the target thinks of them
    rows = num_accepted >= 2
    assert torch.equal(tokens[rows, :2], draft[rows, :2])


def test_bad_simulate_values(spec_models, monkeypatch):
    with pytest.raises(ValueError, match="speculative_simulate_accept_rate"):
        LLM(spec_models["target"], device="cpu", **_args(spec_models, CHAIN, 1.5))
    with pytest.raises(ValueError, match="speculative_simulate_accept_rate needs speculative_algorithm"):
        LLM(spec_models["target"], device="cpu", speculative_simulate_accept_rate=0.5)
    with pytest.raises(ValueError, match="speculative_simulate_sibling_rate must be a probability"):
        LLM(spec_models["target"], device="cpu", **_args(spec_models, TREE, 0.5), speculative_simulate_sibling_rate=2.0)
    with pytest.raises(ValueError, match="speculative_simulate_sibling_rate needs speculative_simulate_accept_rate"):
        LLM(spec_models["target"], device="cpu", speculative_algorithm="NGRAM", speculative_simulate_sibling_rate=0.2)
    monkeypatch.setenv("HYPERDRAFT_SIMULATE_ACCEPT_RATE", "often")
    with pytest.raises(ValueError, match="HYPERDRAFT_SIMULATE_ACCEPT_RATE"):
        LLM(spec_models["target"], device="cpu", speculative_algorithm="NGRAM")


def test_dummy_load_format(spec_models, llm_factory):
    real = llm_factory(spec_models["target"])
    dummy = llm_factory(spec_models["target"], load_format="dummy")
    w_real = real.engine.runner.model.model.layers[0].self_attn.q_proj.weight
    w_dummy = dummy.engine.runner.model.model.layers[0].self_attn.q_proj.weight
    assert w_real.shape == w_dummy.shape and not torch.equal(w_real, w_dummy)
    assert abs(w_dummy.std().item() - 0.02) < 0.005
    out = gen(dummy, [[1, 2, 3]], greedy(5))[0]
    assert len(out.token_ids) == 5
    with pytest.raises(ValueError, match="load_format must be one of"):
        LLM(spec_models["target"], device="cpu", load_format="fast")
