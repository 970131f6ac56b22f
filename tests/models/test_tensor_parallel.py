"""A dense decoder split over 2 gloo processes on the CPU (models/tensor_parallel.py) computes the unsplit model's
logits (fp32; the row-parallel sums add in another order, so up to rounding), for Llama (1 K/V head: replicated on
both ranks, tied embeddings), Qwen2 (q/k/v bias), Qwen3 (q/k norms, head_dim apart from hidden / heads) and a
vocabulary that does not split evenly (the last rank's rows padded). Models that cannot split are refused."""

from __future__ import annotations

import random

import pytest
import torch

from hyperdraft.distributed.tensor_parallel import TensorParallel
from hyperdraft.models.config import load_model_config
from hyperdraft.models.loader import load_model, split_model
from hyperdraft.models.tensor_parallel import rank_config
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tensor_parallel import split_head_logits, split_logits, whole_head_logits, whole_logits
from hyperdraft.testing.tiny import make_tiny_model


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (1, 9, 40)]


CASES = {"llama": ("llama", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {}),
         "qwen3-vocab301": ("qwen3", dict(vocab_size=301, with_tokenizer=False))}


def test_two_ranks_compute_the_whole_models_logits(tmp_path):
    """All four models in one pair of processes (a spawn costs seconds)."""
    paths = [make_tiny_model(str(tmp_path / name), kind, seed=3, **overrides) for name, (kind, overrides) in CASES.items()]
    prompts = _prompts(301)
    got = split_logits(paths, prompts, tp_size=2)
    for name, path, split in zip(CASES, paths, got):
        vocab = CASES[name][1].get("vocab_size", 384)
        for w, g in zip(whole_logits(path, prompts), split):
            assert g.shape == w.shape == (w.shape[0], vocab), name
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=name)
            assert torch.equal(g.argmax(-1), w.argmax(-1)), name


def test_a_split_draft_head_computes_the_whole_heads_logits(tmp_path):
    """EAGLE-3 and EAGLE-1 heads whose layers split over 2 ranks like their target's (RuntimeOptions.split_draft_head)
    give the whole head's draft logits (the engine's output cannot show it: a random head's drafts are rejected
    whatever they are)."""
    target = make_tiny_model(str(tmp_path / "llama"), "llama", seed=2, num_hidden_layers=6)
    heads = [write_random_eagle_checkpoint(str(tmp_path / "e3"), target, kind="eagle3", draft_vocab_size=200),
             write_random_eagle_checkpoint(str(tmp_path / "e1"), target, kind="eagle")]
    hidden = load_model_config(target).hidden_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 384, (23,), generator=g).tolist()
    aux = [torch.randn(23, 3 * hidden, generator=g), torch.randn(23, hidden, generator=g)]
    for name, w, s in zip(("eagle3", "eagle"), whole_head_logits(target, heads, ids, aux),
                          split_head_logits(target, heads, ids, aux, tp_size=2)):
        assert s.shape == w.shape, name
        torch.testing.assert_close(s, w, atol=1e-4, rtol=1e-4, msg=name)


def test_a_model_that_cannot_split_is_refused(tmp_path):
    cfg = load_model_config(make_tiny_model(str(tmp_path / "q3"), "qwen3", seed=1))  # 8 heads, 2 K/V heads
    with pytest.raises(ValueError, match="tp_size=3 must divide the model's num_attention_heads=8"):
        rank_config(cfg, TensorParallel(0, 3))
    part = rank_config(cfg, TensorParallel(1, 4))
    assert (part.num_heads, part.num_kv_heads, part.intermediate_size) == (2, 1, cfg.intermediate_size // 4)
    moe = load_model_config(make_tiny_model(str(tmp_path / "n"), "qwen3_next", seed=1))
    split = rank_config(moe, TensorParallel(1, 2)).moe  # each expert's columns, and the shared expert's, halved
    assert (split.intermediate_size, split.shared_intermediate_size) == (
        moe.moe.intermediate_size // 2, moe.moe.shared_intermediate_size // 2)
    assert split.num_experts == moe.moe.num_experts and split.top_k == moe.moe.top_k
    with pytest.raises(ValueError, match="tp_size=3 must divide"):
        rank_config(moe, TensorParallel(0, 3))
    hybrid = load_model_config(make_tiny_model(str(tmp_path / "h"), "qwen3_5", seed=1))  # 2 key heads, 4 value heads
    lin = rank_config(hybrid, TensorParallel(1, 2)).linear_attention
    assert (lin.num_k_heads, lin.num_v_heads) == (1, 2)
    with pytest.raises(ValueError, match="tp_size=4 must divide the model's linear_num_key_heads=2"):
        rank_config(hybrid, TensorParallel(0, 4))
    with pytest.raises(ValueError, match="rank 2 must lie in"):
        TensorParallel(2, 2)


def test_random_weights_are_drawn_for_the_ranks_part_alone(tmp_path):
    """load_format "dummy" builds the rank's part directly (a model too big for one device can be benchmarked split):
    its weights have the split shapes, and nothing of the whole model is allocated."""
    path = make_tiny_model(str(tmp_path / "q3"), "qwen3", seed=1)  # 8 heads, 2 K/V heads
    whole = load_model(path, "float32", torch.device("cpu"), load_format="dummy")
    part = load_model(path, "float32", torch.device("cpu"), load_format="dummy", tp=TensorParallel(1, 2))
    assert part.config == rank_config(whole.config, TensorParallel(1, 2))
    want = {name: p.shape for name, p in split_model(whole, TensorParallel(1, 2)).named_parameters()}
    assert {name: p.shape for name, p in part.named_parameters()} == want
    assert want["model.embed_tokens.weight"][0] < whole.config.vocab_size


def test_a_split_sparse_model_packs_its_own_expert_stacks(tmp_path):
    """The routed experts run from two stacked buffers (moe.pack_experts); a split part must stack its own slices, or
    its forward takes the torch reference, whose data-dependent loop cannot be captured in a CUDA graph (it aborted
    TP 2 Qwen3-Next engines on GPUs)."""
    from hyperdraft.models.moe import SparseMoe

    path = make_tiny_model(str(tmp_path / "qn"), "qwen3_next", seed=4)
    part = split_model(load_model(path, "float32", torch.device("cpu")), TensorParallel(1, 2))
    sparse = [layer.mlp for layer in part.model.layers if isinstance(layer.mlp, SparseMoe)]
    assert sparse
    for mlp in sparse:
        assert mlp.stack is not None
        for e, expert in enumerate(mlp.experts):
            inter = expert.gate_proj.weight.shape[0]
            assert mlp.stack.gate_up.shape[1] == 2 * inter
            assert expert.gate_proj.weight.data_ptr() == mlp.stack.gate_up[e, :inter].data_ptr()
            assert torch.equal(mlp.stack.down[e], expert.down_proj.weight)
