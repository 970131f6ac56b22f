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
from hyperdraft.models.tensor_parallel import rank_config
from hyperdraft.testing.tensor_parallel import split_logits, whole_logits
from hyperdraft.testing.tiny import make_tiny_model


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (1, 9, 40)]


@pytest.mark.parametrize("kind,overrides", [("llama", {}), ("qwen2", {}), ("qwen3", {}),
                                            ("qwen3", dict(vocab_size=301, with_tokenizer=False))],
                         ids=["llama", "qwen2", "qwen3", "qwen3-vocab301"])
def test_two_ranks_compute_the_whole_models_logits(tmp_path, kind, overrides):
    path = make_tiny_model(str(tmp_path / kind), kind, seed=3, **overrides)
    vocab = overrides.get("vocab_size", 384)
    prompts = _prompts(vocab)
    want = whole_logits(path, prompts)
    got = split_logits(path, prompts, tp_size=2)
    for w, g in zip(want, got):
        assert g.shape == w.shape == (w.shape[0], vocab)
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_a_model_that_cannot_split_is_refused(tmp_path):
    cfg = load_model_config(make_tiny_model(str(tmp_path / "q3"), "qwen3", seed=1))  # 8 heads, 2 K/V heads
    with pytest.raises(ValueError, match="tp_size=3 must divide the model's num_attention_heads=8"):
        rank_config(cfg, TensorParallel(0, 3))
    part = rank_config(cfg, TensorParallel(1, 4))
    assert (part.num_heads, part.num_kv_heads, part.intermediate_size) == (2, 1, cfg.intermediate_size // 4)
    hybrid = load_model_config(make_tiny_model(str(tmp_path / "h"), "qwen3_5", seed=1))
    with pytest.raises(ValueError, match="tp_size=2: .* cannot be split yet"):
        rank_config(hybrid, TensorParallel(0, 2))
    with pytest.raises(ValueError, match="rank 2 must lie in"):
        TensorParallel(2, 2)
