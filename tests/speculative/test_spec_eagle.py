"""EAGLE / EAGLE-3 speculative decoding (CPU, fp32): spec on == spec off, the head's incremental state against a
from-scratch recomputation, defaults and start-up errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hyperdraft.speculative.proposers.eagle as eagle_proposer
from hyperdraft import LLM, SamplingParams
from hyperdraft.models.decoder import rotated
from hyperdraft.models.eagle import target_capture_layers
from hyperdraft.models.eagle_loader import load_eagle_head
from hyperdraft.models.loader import load_model
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model
from tests.conftest import assert_engine_clean

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    target = make_tiny_model(str(root / "target"), "llama", num_hidden_layers=6)
    small = make_tiny_model(str(root / "small"), "llama", num_hidden_layers=6, vocab_size=16, with_tokenizer=False)
    return {
        "target": target,
        "eagle3": write_random_eagle_checkpoint(str(root / "e3"), target, kind="eagle3", draft_vocab_size=200),
        "eagle": write_random_eagle_checkpoint(str(root / "e1"), target, kind="eagle"),
        # A head narrower than the target (hidden 32 vs 64): every head buffer must follow the head's size.
        "eagle3_narrow": write_random_eagle_checkpoint(str(root / "e3n"), target, kind="eagle3", hidden_size=32, target_hidden_size=64, with_embed=True,
                                                       intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                                                       head_dim=16),
        "small": small,
        "small_eagle3": write_random_eagle_checkpoint(str(root / "se3"), small, kind="eagle3", draft_vocab_size=12, seed=3),
        "small_eagle": write_random_eagle_checkpoint(str(root / "se1"), small, kind="eagle", seed=4),
    }


def _prompts(vocab: int, n: int = 10) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    out = [torch.randint(0, vocab, (length,), generator=g).tolist() for length in (1, 5, 17, 33, 64, 90, 2, 40)]
    out += [[3, 4, 5] * 6, [7, 8] * 9]
    return out[:n]


def _generate(path, prompts, params, **engine_args):
    llm = LLM(path, device="cpu", dtype="float32", **engine_args)
    outs = llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    state = llm.get_server_info()["internal_states"][0]
    assert_engine_clean(llm)
    return [o.token_ids for o in outs], state


TREE = dict(speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)
TREE_SMALL = dict(speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=4)
TREE_WIDE = dict(speculative_num_steps=4, speculative_eagle_topk=4, speculative_num_draft_tokens=16)
CHAIN = dict(speculative_num_steps=3, speculative_eagle_topk=1)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("shape", [CHAIN, TREE_SMALL, TREE, TREE_WIDE, {}],
                         ids=["chain", "tree-topk2-n4", "tree-topk2-n6", "tree-topk4-n16", "default-topk4-n8"])
@pytest.mark.parametrize("algo,head", [("EAGLE3", "eagle3"), ("EAGLE", "eagle"), ("EAGLE3", "eagle3_narrow")])
def test_spec_on_equals_spec_off(models, algo, head, shape, page_size):
    prompts = _prompts(384)
    params = [SamplingParams(temperature=0, max_new_tokens=12 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    base, _ = _generate(models["target"], prompts, params, page_size=page_size)
    spec, state = _generate(models["target"], prompts, params, page_size=page_size, chunked_prefill_size=32,
                            speculative_algorithm=algo, speculative_draft_model_path=models[head], **shape)
    assert spec == base
    assert state["spec_verifies"] > 0


@pytest.mark.parametrize("algo,head", [("EAGLE3", "small_eagle3"), ("EAGLE", "small_eagle")])
@pytest.mark.parametrize("shape", [CHAIN, dict(speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8)],
                         ids=["chain", "tree"])
def test_head_state_matches_recomputation_from_scratch(models, monkeypatch, algo, head, shape):
    """At every round the head's root logits (from its paged K/V, its hidden buffer and the catch-up) must equal
    the head run from scratch over the whole sequence with the target's hidden states. A 16-token vocabulary
    makes random heads accept often, so multi-token catch-ups and tree compaction are exercised."""
    target_path, head_path = models["small"], models[head]
    seen = []
    original = eagle_proposer.EagleProposer.catch_up

    def spy(self, reqs, tokens_in=None):
        seqs = [r.prompt_ids + r.output_ids for r in reqs]
        counts = [r.num_computed - r.draft_num_computed for r in reqs]
        fb, out = original(self, reqs, tokens_in)
        seen.extend((s, c, row) for s, c, row in zip(seqs, counts, out.target_logits()))
        return fb, out

    monkeypatch.setattr(eagle_proposer.EagleProposer, "catch_up", spy)
    prompts = _prompts(16, 6)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    _, state = _generate(target_path, prompts, params, page_size=4, chunked_prefill_size=16, skip_tokenizer_init=True,
                         speculative_algorithm=algo, speculative_draft_model_path=head_path, **shape)
    assert state["spec_accepted_tokens"] >= 5, "the small vocabulary should make random drafts accepted"
    assert max(c for _, c, _ in seen) >= 2, "no multi-position catch-up happened"

    target = load_model(target_path, "float32", torch.device("cpu"))
    head_model = load_eagle_head(head_path, target)
    for seq, _, logits in seen:
        ref = _reference_root_logits(target, head_model, seq)
        # fp32 summation order differs (paged, chunked vs one pass): ~1e-5 relative; a bookkeeping error is O(1).
        assert torch.allclose(logits, ref, atol=2e-3, rtol=1e-4), (len(seq), (logits - ref).abs().max())


def _causal(layer_id, q, k, v, rope=None):
    q, k = rotated(q, k, rope)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True)
    return out.transpose(0, 1)


@torch.inference_mode()
def _reference_root_logits(target, head, seq: list[int]) -> torch.Tensor:
    """The head's logits for the token after seq[-1], from scratch: target hidden h_0..h_{n-1} over seq[:-1],
    head positions 0..n-1 fed (h_i, seq[i+1])."""
    n = len(seq) - 1
    ids = torch.tensor(seq[:-1])
    final, captured = target(ids, torch.arange(n), _causal, target_capture_layers(head))
    hidden = head.project_target_hidden(torch.cat(captured, -1)) if captured else final
    g = head(torch.tensor(seq[1:]), torch.arange(n), hidden, _causal)
    return head.compute_logits(g[-1:])[0]


def test_sglang_defaults_depend_on_the_target(models):
    llm = LLM(models["target"], device="cpu", speculative_algorithm="EAGLE3", speculative_draft_model_path=models["eagle3"])
    state = llm.get_server_info()["internal_states"][0]
    assert (state["speculative_num_steps"], state["speculative_eagle_topk"], state["speculative_num_draft_tokens"]) == (5, 4, 8)
    from hyperdraft.config import EngineArgs
    from hyperdraft.speculative.config import resolve_spec_config

    cfg = resolve_spec_config(EngineArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x"), "Qwen2ForCausalLM")
    assert (cfg.num_steps, cfg.topk, cfg.num_draft_tokens) == (3, 1, 4)
    cfg = resolve_spec_config(EngineArgs(speculative_algorithm="NEXTN", speculative_draft_model_path="/x"), "LlamaForCausalLM")
    assert cfg.algorithm == "EAGLE"


def test_head_kind_must_match_the_algorithm(models):
    with pytest.raises(ValueError, match="speculative_algorithm"):
        LLM(models["target"], device="cpu", speculative_algorithm="EAGLE", speculative_draft_model_path=models["eagle3"])


def test_head_that_does_not_fit_the_target_is_a_startup_error(models, tmp_path):
    bad = write_random_eagle_checkpoint(str(tmp_path / "bad"), models["target"], kind="eagle3", target_hidden_size=48)
    with pytest.raises(ValueError, match="target_hidden_size"):
        LLM(models["target"], device="cpu", speculative_algorithm="EAGLE3", speculative_draft_model_path=bad)
    bad_ids = write_random_eagle_checkpoint(str(tmp_path / "ids"), models["target"], kind="eagle3",
                                            eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]})
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        LLM(models["target"], device="cpu", speculative_algorithm="EAGLE3", speculative_draft_model_path=bad_ids)


def test_head_buffers_are_sized_from_the_head(models):
    llm = LLM(models["target"], device="cpu", speculative_algorithm="EAGLE3", speculative_draft_model_path=models["eagle3_narrow"],
              **CHAIN)
    proposer = llm.engine.worker.proposer
    assert proposer.hidden_buf.shape[-1] == 32 != llm.engine.model_config.hidden_size
    assert proposer.pool.k.shape[1:] == (llm.engine.runner.pool.num_slots, 1, 16)
    assert proposer.hidden_buf.shape[1] >= llm.engine.spec.max_verify_tokens + 1


def test_engine_steps_record_no_autograd(models):
    """Weights are frozen at load and a step runs without grad mode, including the products outside the runners'
    inference mode (EAGLE-3's fc over the verify rows): autograd there would build graphs every step, and on CUDA
    would send the product to cuBLAS instead of the few-row GEMV (kernels/gemv.gemv_fits)."""
    llm = LLM(models["target"], device="cpu", dtype="float32", speculative_algorithm="EAGLE3",
              speculative_draft_model_path=models["eagle3"], **CHAIN)
    head = llm.engine.worker.proposer.head
    for module in (llm.engine.runner.model, head):
        assert not any(p.requires_grad for p in module.parameters())
    grad_modes = []
    head.fc.register_forward_hook(lambda mod, inputs, out: grad_modes.append((torch.is_grad_enabled(), out.requires_grad)))
    llm.generate(input_ids=[[5, 6, 7, 8]], sampling_params=SamplingParams(temperature=0.0, max_new_tokens=12),
                 use_tqdm=False)
    assert grad_modes and not any(enabled or requires for enabled, requires in grad_modes)
    assert_engine_clean(llm)
