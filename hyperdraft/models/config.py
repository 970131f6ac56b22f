"""ModelConfig: the frozen, architecture-neutral view of a Hugging Face config.

Every model instance owns its own ModelConfig. It is built once from the HF
config and is immutable afterwards, so a draft model can never rewrite the
target's view of itself (a class of bug SGLang shipped with shared hf_config).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3NextForCausalLM",
)
HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3NextForCausalLM")
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"

_DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The Gated DeltaNet layers of a hybrid model: per layer a causal depthwise conv over q|k|v and a recurrent state
    [num_v_heads, k_head_dim, v_head_dim]."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    state_dtype: str  # the recurrent state's dtype name ("float32" unless the checkpoint says otherwise)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MLP (Qwen3-Next): a router over num_experts, the top_k experts' weighted sum, plus one shared expert
    gated by a sigmoid."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    shared_intermediate_size: int
    norm_topk_prob: bool
    sparse_step: int  # layer i is sparse when (i + 1) % sparse_step == 0 ...
    dense_layers: tuple[int, ...]  # ... and i is not one of these (mlp_only_layers)

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...]  # frozen items of the HF rope dict, () for plain RoPE
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    dtype: str  # the checkpoint's own dtype name, used by dtype="auto"
    # ---- hybrid models (Qwen3.5): the defaults describe a plain decoder ----
    layer_types: tuple[str, ...] = ()  # per layer FULL_ATTENTION or LINEAR_ATTENTION; () = every layer full attention
    linear_attention: LinearAttentionConfig | None = None
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims of each head
    attn_output_gate: bool = False  # q_proj is twice as wide; attention output * sigmoid(gate)
    zero_centered_norm: bool = False  # RMSNorm weights w scale by (1 + w)
    moe: MoeConfig | None = None  # sparse MLPs (Qwen3-Next)
    fused_gdn_projections: bool = False  # the checkpoint packs q|k|v|z and b|a per key head (Qwen3-Next)

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @property
    def is_hybrid(self) -> bool:
        return self.linear_attention is not None

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.layer_types or (FULL_ATTENTION,) * self.num_layers

    @property
    def num_kv_layers(self) -> int:
        """Layers with a paged K/V cache (the full-attention ones)."""
        return self.kinds.count(FULL_ATTENTION)

    @property
    def num_linear_layers(self) -> int:
        return self.kinds.count(LINEAR_ATTENTION)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_bytes_per_token_per_dtype_byte(self) -> int:
        return 2 * self.num_kv_layers * self.num_kv_heads * self.head_dim


def _eos_ids(raw: Any) -> tuple[int, ...]:
    if raw is None:
        return ()
    if isinstance(raw, int):
        return (raw,)
    return tuple(int(x) for x in raw)


def _rope(raw: dict) -> tuple[float, tuple[tuple[str, Any], ...]]:
    # transformers >= 5 stores everything in rope_parameters; older configs use rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)  # a model field (hybrid models), not a scaling of the frequencies
    params.pop("mrope_section", None)  # text positions are equal in every section: plain RoPE
    params.pop("mrope_interleaved", None)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, ()
    params["rope_type"] = kind
    params.pop("type", None)
    return theta, tuple(sorted(params.items()))


def _sliding_window(raw: dict, arch: str) -> int | None:
    """The attention window some layers use, or None when every layer attends to the whole sequence."""
    window = raw.get("sliding_window")
    if not window:
        return None
    if raw.get("layer_types") is not None:  # transformers >= 4.56 spells out each layer's attention
        return window if "sliding_attention" in raw["layer_types"] else None
    if arch == "MistralForCausalLM":
        return window
    # Qwen2/Qwen3 ship a sliding_window value but use it only with use_sliding_window, from layer max_window_layers
    # (28 when the config leaves it out, as transformers' Qwen2Config and Qwen3Config default it).
    uses = raw.get("use_sliding_window") and raw.get("max_window_layers", 28) < raw.get("num_hidden_layers", 0)
    return window if uses else None


SILU_NAMES = ("silu", "swish")  # transformers' ACT2FN names for x * sigmoid(x), the only MLP activation built here


def _refuse_unsupported(raw: dict, arch: str) -> None:
    """Config fields that change the model's arithmetic and are not implemented: refused by name, since running them
    as the plain model would silently give another model's outputs."""
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(f"quantization_config (quant_method={method!r}) is not supported: hyperdraft loads "
                         "unquantized float32/float16/bfloat16 checkpoints and GGUF files")
    act = raw.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"hidden_act={act!r} is not supported; allowed: {', '.join(SILU_NAMES)} (a SwiGLU MLP)")
    window = _sliding_window(raw, arch)
    if window is not None and window < int(raw.get("max_position_embeddings", 4096)):
        # Every layer here attends to the whole sequence; past the window that silently differs from the model.
        raise ValueError(f"sliding_window={window} (sliding-window attention) is not supported; "
                         "only models whose layers all use full attention are")


def model_config_from_dict(raw: dict) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        # An EAGLE head's config reads like a model's: given as the model or a STANDALONE draft, say where it goes.
        head = (f" ({arch} is an EAGLE draft head: give it as speculative_draft_model_path with speculative_algorithm "
                "EAGLE or EAGLE3)") if str(arch).startswith("LlamaForCausalLMEagle") else ""
        raise ValueError(f"model architecture {arch!r} is not supported; supported architectures: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}{head}")
    if arch == "Qwen3_5ForConditionalGeneration":  # the language model of a multimodal checkpoint
        raw = {**raw.get("text_config", {}), "architectures": [arch], "eos_token_id": raw.get("eos_token_id")
               or raw.get("text_config", {}).get("eos_token_id"), "tie_word_embeddings": raw.get("tie_word_embeddings",
               raw.get("text_config", {}).get("tie_word_embeddings", False)),
               "quantization_config": raw.get("quantization_config")
               or raw.get("text_config", {}).get("quantization_config")}
    _refuse_unsupported(raw, arch)
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    theta, scaling = _rope(raw)
    is_qwen2 = arch == "Qwen2ForCausalLM"
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        qkv_bias=True if is_qwen2 else bool(raw.get("attention_bias", False)),
        o_bias=False if is_qwen2 else bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", *HYBRID_ARCHITECTURES),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        dtype=_DTYPE_NAMES.get(str(dtype), "float32"),
        **(_hybrid_fields(raw) if arch in HYBRID_ARCHITECTURES else {}),
    )


def _hybrid_fields(raw: dict) -> dict[str, Any]:
    """Qwen3.5's layer layout, Gated DeltaNet sizes, partial RoPE, output gate and (1 + w) norms."""
    num_layers = int(raw["num_hidden_layers"])
    interval = int(raw.get("full_attention_interval", 4))
    kinds = tuple(raw.get("layer_types") or
                  [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers)])
    if len(kinds) != num_layers or set(kinds) - {FULL_ATTENTION, LINEAR_ATTENTION}:
        raise ValueError(f"layer_types must list {num_layers} entries, each {FULL_ATTENTION!r} or "
                         f"{LINEAR_ATTENTION!r}, got {list(kinds)}")
    rope = raw.get("rope_parameters") or {}
    state_dtype = _DTYPE_NAMES.get(str(raw.get("mamba_ssm_dtype", "float32")), "float32")
    linear = LinearAttentionConfig(int(raw.get("linear_num_key_heads", 16)), int(raw.get("linear_num_value_heads", 32)),
                                   int(raw.get("linear_key_head_dim", 128)), int(raw.get("linear_value_head_dim", 128)),
                                   int(raw.get("linear_conv_kernel_dim", 4)), state_dtype)
    if linear.num_v_heads % linear.num_k_heads:
        raise ValueError(f"linear_num_value_heads={linear.num_v_heads} must be a multiple of "
                         f"linear_num_key_heads={linear.num_k_heads}")
    moe = None
    if int(raw.get("num_experts", 0) or 0) > 0:
        moe = MoeConfig(int(raw["num_experts"]), int(raw.get("num_experts_per_tok", 10)),
                        int(raw.get("moe_intermediate_size", 512)), int(raw.get("shared_expert_intermediate_size", 512)),
                        bool(raw.get("norm_topk_prob", True)), int(raw.get("decoder_sparse_step", 1)),
                        tuple(raw.get("mlp_only_layers") or ()))
    return dict(layer_types=kinds, linear_attention=linear,
                partial_rotary_factor=float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))),
                attn_output_gate=bool(raw.get("attn_output_gate", True)), zero_centered_norm=True, moe=moe,
                fused_gdn_projections=raw.get("architectures", [None])[0] == "Qwen3NextForCausalLM")


def load_model_config(model_path: str) -> ModelConfig:
    from hyperdraft.models.gguf import gguf_config_dict, is_gguf

    if is_gguf(model_path):
        return model_config_from_dict(gguf_config_dict(model_path))
    if os.path.isfile(model_path):  # "does not exist" would mislead here
        raise ValueError(f"model path {model_path!r} is a file, not a model: give a Hugging Face model directory "
                         "or a file whose name ends in .gguf")
    if not os.path.isdir(model_path):
        raise ValueError(f"model path {model_path!r} does not exist")
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model path {model_path!r} has no config.json")
    with open(path) as f:
        return model_config_from_dict(json.load(f))
