"""Tiny random Hugging Face models with a real byte-level BPE tokenizer.

Used by the tests and the CPU benchmarks. Each model is a genuine transformers
checkpoint (config.json + safetensors + tokenizer files), so transformers itself
serves as the reference implementation.
"""

from __future__ import annotations

import os

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Speculative decoding drafts several tokens and verifies them in one forward pass.",
    "Paged attention stores keys and values in fixed-size pages of a shared pool.",
    "Hello, world! How are you today? I am fine, thank you very much.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "你好，世界。今天天气很好。 🙂🚀 naïve café",
]

EOS = "<|endoftext|>"


def make_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=None, unk_token=None)


def _config(kind: str, vocab_size: int, eos_id: int, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    base = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        eos_token_id=eos_id,
        bos_token_id=None,
        pad_token_id=None,
        initializer_range=0.2,  # decisive logits: random-weight argmax ties would make equality tests flaky
    )
    if kind == "llama":  # llama3 RoPE scaling, tied embeddings, GQA 2:1
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64, "rope_theta": 500000.0}
        return LlamaConfig(**{**base, "rope_scaling": rope, "tie_word_embeddings": True, **overrides})
    if kind == "mqa":  # one KV head
        return LlamaConfig(**{**base, "num_key_value_heads": 1, **overrides})
    if kind == "qwen2":  # qkv bias
        return Qwen2Config(**{**base, "tie_word_embeddings": False, **overrides})
    if kind == "qwen3":  # q/k norm, GQA 4:1, head_dim != hidden / heads
        return Qwen3Config(**{**base, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, **overrides})
    if kind == "mistral":
        return MistralConfig(**{**base, "sliding_window": None, **overrides})
    if kind == "qwen3_5":  # hybrid: 3 Gated DeltaNet layers then gated full attention, partial RoPE, GQA 2:1
        from transformers import Qwen3_5TextConfig

        hybrid = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                      tie_word_embeddings=False)
        return Qwen3_5TextConfig(**{**base, **hybrid, **overrides})
    if kind == "qwen3_next":  # qwen3_5's layout, with sparse MoE MLPs (4 experts, top 2, a shared one) but in layer 1
        from transformers import Qwen3NextConfig

        hybrid = dict(num_hidden_layers=4, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                      tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1])
        return Qwen3NextConfig(**{**base, **hybrid, **overrides})
    raise ValueError(f"unknown tiny model kind {kind!r}")


HYBRID_CLASSES = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}


def make_tiny_model(path: str, kind: str = "llama", seed: int = 0, with_tokenizer: bool = True, **overrides) -> str:
    """Write a random-weight checkpoint of the given kind to path and return path."""
    from transformers import AutoModelForCausalLM

    tokenizer = make_tokenizer()
    # vocab_size and eos_token_id may be overridden like any other config field (e.g. a small-vocabulary model
    # run with skip_tokenizer_init); passing them through **overrides too would name them twice.
    vocab_size = overrides.pop("vocab_size", len(tokenizer))
    eos_id = overrides.pop("eos_token_id", tokenizer.eos_token_id)
    cfg = _config(kind, vocab_size, eos_id, **overrides)
    torch.manual_seed(seed)
    if kind in HYBRID_CLASSES:
        import transformers

        model = getattr(transformers, HYBRID_CLASSES[kind])(cfg).to(torch.float32)
        with torch.no_grad():  # zero-initialised norms, A_log and dt_bias would hide a swapped or ignored parameter
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.1)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    if with_tokenizer:
        tokenizer.save_pretrained(path)
    return path
