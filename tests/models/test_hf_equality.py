"""Greedy tokens and prefill logits identical to transformers, for every supported architecture variant."""

from __future__ import annotations

import pytest
import torch

from conftest import KINDS, generate_ids, greedy, hf_greedy, hf_logits, random_prompts
from hyperdraft.core.forward_batch import ForwardInput, ForwardMode, build_forward_batch

PROMPT_LENGTHS = [1, 2, 5, 17, 31, 64, 100, 137, 200]
NEW_TOKENS = 12


def _check_against_hf(llm, path, seed=0, lengths=PROMPT_LENGTHS, n=NEW_TOKENS):
    prompts = random_prompts(lengths, seed=seed)
    outs = generate_ids(llm, prompts, greedy(n))
    refs = hf_greedy(path, prompts, n)
    assert len(outs) == len(prompts)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.token_ids == ref, f"prompt {i} (length {lengths[i]}): engine {out.token_ids} != HF {ref}"
        assert out.finish_reason == "length"
        assert out.meta_info["prompt_tokens"] == lengths[i]
        assert out.meta_info["completion_tokens"] == n


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_hf(tiny_models, make_llm, kind, page_size):
    llm = make_llm(tiny_models[kind], page_size=page_size)
    _check_against_hf(llm, tiny_models[kind])


@pytest.mark.parametrize("chunk,page_size", [(16, 1), (37, 3), (16, 16), (-1, 3)])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_greedy_matches_hf_chunked_prefill(tiny_models, make_llm, kind, chunk, page_size):
    """Chunks smaller than the prompts (prompts split over several steps, mixed with decodes); -1 disables chunking."""
    llm = make_llm(tiny_models[kind], page_size=page_size, chunked_prefill_size=chunk)
    _check_against_hf(llm, tiny_models[kind], seed=1)


def test_greedy_matches_hf_reused_engine(tiny_models, make_llm):
    """A second batch on the same engine reuses freed pages and rows: stale K/V must never leak into it."""
    path = tiny_models["qwen2"]
    llm = make_llm(path, page_size=3, chunked_prefill_size=37, max_running_requests=4)
    _check_against_hf(llm, path, seed=2)
    _check_against_hf(llm, path, seed=3, lengths=[200, 3, 77, 1, 45, 150, 9, 128])


def test_greedy_matches_hf_long_generation(tiny_models, make_llm):
    """Decode far beyond the prompt, across many page boundaries (llama3 RoPE scaling's low/high bands)."""
    path = tiny_models["llama"]
    llm = make_llm(path, page_size=16)
    _check_against_hf(llm, path, seed=4, lengths=[3, 60, 150], n=120)


def _engine_logits(llm, chunks: list[list[int]]) -> torch.Tensor:
    """Run a prompt through the engine's ModelRunner as consecutive EXTEND forwards; all-position logits."""
    engine = llm.engine
    pt = engine.page_table
    row = pt.acquire_row()
    try:
        logits, prefix = [], 0
        for chunk in chunks:
            assert pt.reserve(row, prefix + len(chunk))
            fb = build_forward_batch(ForwardMode.EXTEND, [ForwardInput(row, prefix, chunk, num_logits=len(chunk))], pt,
                                     engine.device)
            logits.append(engine.runner.forward(fb).logits)
            prefix += len(chunk)
        return torch.cat(logits)
    finally:
        pt.release_row(row)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_match_hf(tiny_models, make_llm, kind):
    path = tiny_models[kind]
    llm = make_llm(path, page_size=3)
    for prompt in random_prompts([1, 9, 50, 200], seed=5):
        ref = hf_logits(path, prompt)
        ours = _engine_logits(llm, [prompt])
        assert ours.shape == ref.shape
        diff = (ours - ref).abs().max().item()
        assert diff < 1e-4, f"prompt length {len(prompt)}: max |logits - HF| = {diff}"


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mqa"])
def test_chunked_prefill_logits_match_hf(tiny_models, make_llm, kind):
    """Prefill split into chunks that attend to the paged prefix (chunk edges not aligned to pages)."""
    path = tiny_models[kind]
    llm = make_llm(path, page_size=4)
    prompt = random_prompts([150], seed=6)[0]
    ref = hf_logits(path, prompt)
    ours = _engine_logits(llm, [prompt[:7], prompt[7:8], prompt[8:61], prompt[61:]])
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-4, f"max |logits - HF| = {diff}"


def test_batched_prefill_logits_match_hf(tiny_models, make_llm):
    """Several requests of different lengths packed into one forward (padding must not leak between them)."""
    path = tiny_models["qwen2"]
    llm = make_llm(path, page_size=3)
    pt = llm.engine.page_table
    prompts = random_prompts([5, 130, 1, 64], seed=7)
    rows = [pt.acquire_row() for _ in prompts]
    try:
        for row, p in zip(rows, prompts):
            assert pt.reserve(row, len(p))
        inputs = [ForwardInput(row, 0, p, num_logits=len(p)) for row, p in zip(rows, prompts)]
        fb = build_forward_batch(ForwardMode.EXTEND, inputs, pt, llm.engine.device)
        logits = llm.engine.runner.forward(fb).logits
    finally:
        for row in rows:
            pt.release_row(row)
    start = 0
    for p in prompts:
        diff = (logits[start:start + len(p)] - hf_logits(path, p)).abs().max().item()
        assert diff < 1e-4, f"prompt length {len(p)}: max |logits - HF| = {diff}"
        start += len(p)


# ---- config variants the decoder supports through flags --------------------------------------------------------

VARIANTS = {
    "linear-rope": ("mqa", dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "attention-bias": ("llama", dict(attention_bias=True)),  # q/k/v and o biases
    "mlp-bias": ("llama", dict(mlp_bias=True)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "rope-theta": ("mistral", dict(rope_theta=1234.0)),
    "llama-head-dim": ("llama", dict(head_dim=32)),
    "qwen3-bias": ("qwen3", dict(attention_bias=True)),
    "mistral-window-covers-context": ("mistral", dict(sliding_window=512)),
    "qwen2-window-unused": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_hf(tmp_path_factory, make_llm, variant):
    from hyperdraft.testing.tiny import make_tiny_model

    kind, overrides = VARIANTS[variant]
    path = make_tiny_model(str(tmp_path_factory.mktemp(variant)), kind, seed=3, **overrides)
    llm = make_llm(path, page_size=3, chunked_prefill_size=40)
    _check_against_hf(llm, path, seed=8, lengths=[1, 30, 100], n=8)


@pytest.mark.parametrize("kind,overrides", [
    ("mistral", dict(sliding_window=16)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0)),
])
def test_sliding_window_attention_is_rejected_not_silently_wrong(tmp_path_factory, kind, overrides):
    """Every layer attends to the whole sequence; a model with a shorter attention window must be refused."""
    from hyperdraft import LLM
    from hyperdraft.testing.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp(f"{kind}-window")), kind, **overrides)
    with pytest.raises(ValueError, match="sliding_window"):
        LLM(path, device="cpu", dtype="float32")


def _edit_config(path: str, **fields) -> None:
    """Rewrite config.json's fields (None removes one), as a checkpoint from elsewhere would ship them."""
    import json
    import os

    name = os.path.join(path, "config.json")
    with open(name) as f:
        cfg = json.load(f)
    for key, value in fields.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    with open(name, "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("kind,act", [("llama", "gelu"), ("llama", "relu"), ("qwen2", "gelu_pytorch_tanh"),
                                      ("qwen3_5", "gelu")])
def test_mlp_activation_other_than_silu_is_refused_by_name(tmp_path_factory, kind, act):
    """Every MLP here is SwiGLU; a GELU or ReLU model ran as SiLU (logits off by 1-10 against transformers)."""
    from hyperdraft import LLM
    from hyperdraft.testing.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp(f"{kind}-{act}")), kind, hidden_act=act)
    with pytest.raises(ValueError, match=f"hidden_act='{act}'.*silu, swish"):
        LLM(path, device="cpu", dtype="float32")


def test_swish_is_silu(tmp_path_factory, make_llm):
    from hyperdraft.testing.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp("swish")), "llama", seed=4, hidden_act="swish")
    _check_against_hf(make_llm(path), path, seed=2, lengths=[5, 40], n=8)


def test_quantized_checkpoint_is_refused_by_name(tmp_path_factory):
    """A block-FP8 checkpoint (Qwen3-8B-FP8's layout) loaded its float8 codes unscaled and its weight_scale_inv
    tensors were skipped: a different model, with no error."""
    from hyperdraft import LLM
    from hyperdraft.testing.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp("fp8")), "qwen3")
    _edit_config(path, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="quantization_config \\(quant_method='fp8'\\) is not supported"):
        LLM(path, device="cpu", dtype="float32")


def test_old_qwen2_config_without_max_window_layers_uses_full_attention(tmp_path_factory, make_llm):
    """A config from before layer_types, with use_sliding_window on and no max_window_layers: transformers' default
    (28) leaves a 2-layer model's layers all full attention, so it runs (it was refused as sliding-window)."""
    from hyperdraft.testing.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path_factory.mktemp("qwen2-old")), "qwen2", seed=6, use_sliding_window=True,
                           sliding_window=16)
    _edit_config(path, layer_types=None, max_window_layers=None)
    _check_against_hf(make_llm(path), path, seed=3, lengths=[5, 40], n=8)


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_multimodal_checkpoint_quantization_is_refused_wherever_it_sits(where):
    """Qwen3.5's multimodal layout: the language model's config is text_config; a quantization_config at either
    level is refused (the text_config one was dropped when the top level had none)."""
    from hyperdraft.models.config import model_config_from_dict

    quant = {"quant_method": "fp8"}
    raw = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"hidden_size": 64}}
    if where == "top":
        raw["quantization_config"] = quant
    else:
        raw["text_config"]["quantization_config"] = quant
    with pytest.raises(ValueError, match="quantization_config"):
        model_config_from_dict(raw)
