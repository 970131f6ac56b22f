"""DecoderLM: the dense decoder shared by Llama, Mistral, Qwen2 and Qwen3.

The architectures differ only in flags carried by ModelConfig: qkv bias
(Qwen2), per-head q/k RMSNorm before RoPE (Qwen3), head_dim != hidden/heads
(Qwen3), tied embeddings, and the RoPE variant (plain, linear, llama3).
Module names mirror Hugging Face's, so checkpoints load without renaming.

Tokens are packed: activations are [T, hidden] for T tokens of all requests.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels.norm import rms_norm, rms_norm_reference
from hyperdraft.kernels.norm_gemv import norm_gemv, norm_gemv_fits, norm_gemv_wanted
from hyperdraft.kernels.rope import apply_rope, apply_rope_reference, rope_table
from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel
from hyperdraft.models.config import ModelConfig
from hyperdraft.models.cpu_linear import Linear, packed, project
from hyperdraft.models.tensor_parallel import embedding, row_linear

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, 1, R] in the activation dtype
# (layer_id, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], rope) -> [T, Hq, D]. With rope (cos, sin), q and k come
# unrotated and the callee rotates them first (`rotated`): an attention backend does it in its K/V store's launch
# (kernels/kv_store.py rope_kv_store). rope None: q and k are already rotated (or the model has no RoPE there).
AttentionFn = Callable[..., torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_norm(x, None)[0]

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (RMSNorm(x + residual), x + residual); residual None means x alone. Normalised in fp32 and cast back
        before the weight, as the HF reference does; on CUDA one fused kernel (kernels/norm.py)."""
        if use_fused_kernels(x):
            return rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_reference(x, self.weight, self.eps, residual)

    def gain(self) -> torch.Tensor | None:
        """The weight a kernel that normalises by itself applies (normed_project)."""
        return self.weight


class IdentityNorm(nn.Module):
    """No normalisation (EAGLE-1's first layer), with RMSNorm's add_norm interface."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        total = x if residual is None else x + residual
        return total, total

    def gain(self) -> torch.Tensor | None:
        return None  # nothing to normalise: no kernel takes it over


def apply_partial_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RoPE on the first cos.shape[-1] dims of each head (all of them for most models); the rest pass through. On
    CUDA in place (one launch), so q and k must be tensors the caller needs only rotated."""
    return (apply_rope if use_fused_kernels(q) else apply_rope_reference)(q, k, cos, sin)


def normed_project(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm | IdentityNorm, *linears: Linear):
    """norm.add_norm(x, residual) and then the linears' products of it, in one launch where kernels/norm_gemv.py
    serves them (RuntimeOptions.fused_norm_gemv, one row on CUDA, the projections packed into one weight)
    -> (the products, the running sum), else None."""
    if not norm_gemv_wanted(x):  # first: the default path pays one option read per layer, nothing more
        return None
    weights, gain = packed(*linears), norm.gain()
    if weights is None or gain is None or not norm_gemv_fits(x, weights.weight):
        return None
    out, running = norm_gemv(x, residual, gain, norm.eps, weights.weight, weights.bias)
    return out.split(weights.sizes, -1), running


def rotated(q: torch.Tensor, k: torch.Tensor, rope: Rope | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An AttentionFn's first step where no backend fuses it: q and k rotated by rope (None: as they are)."""
    return (q, k) if rope is None else apply_partial_rope(q, k, *rope)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling_dict
    kind = scaling.get("rope_type")
    if kind is None:
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    if kind == "freq_factors":  # per-frequency divisors, as llama.cpp's rope_freqs tensor stores Llama 3 scaling
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; allowed values: default, linear, llama3, freq_factors")


class RotaryFrequencies(nn.Module):
    """RoPE's inverse frequencies as a buffer that stays fp32 and exact: `.to(bfloat16)` would round a plain buffer,
    and `to_empty` (a model built on the meta device) would leave it uninitialised. Moves follow the module."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        with torch.device("cpu"):  # the exact values, even while the model is built on the meta device
            self.exact = rope_inv_freq(cfg).float()
        self.register_buffer("inv_freq", self.exact.clone(), persistent=False)

    def _apply(self, fn, recurse=True):
        self.inv_freq = self.exact.to(fn(torch.empty(0, device=self.inv_freq.device)).device)  # only where fn moves
        return self


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel = SINGLE):
        """cfg: the rank's own config under tensor parallelism (its share of the heads); o_proj then sums over tp."""
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = row_linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn: AttentionFn):
        return self.attend(*project(x, self.q_proj, self.k_proj, self.v_proj), cos, sin, attn)

    def attend(self, q, k, v, cos, sin, attn: AttentionFn):
        """The layer from its q/k/v projections on: [T, Hq*D], [T, Hkv*D] x 2 -> [T, H]."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = attn(self.layer_id, q, k, v, (cos, sin))
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = row_linear(intermediate_size, hidden_size, bias, tp)

    def forward(self, x, residual=None):
        """-> down(SiLU(gate) * up), plus residual when given (on CUDA inside the down projection's launch)."""
        return self.down(*project(x, self.gate_proj, self.up_proj), residual)

    def down(self, gate, up, residual=None):
        return self.down_proj.forward_silu_mul(gate, up, residual, fused=use_fused_kernels(gate))

    def fused_projection_groups(self) -> list[tuple[Linear, ...]]:
        return [(self.gate_proj, self.up_proj)]


class MLP(SwiGLU):
    """A dense decoder layer's MLP, shaped by its model's config."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, tp)


def attention_and_mlp_groups(layer: nn.Module) -> list[tuple[Linear, ...]]:
    """q/k/v, and gate/up, of a layer with self_attn and mlp."""
    attn, mlp = layer.self_attn, layer.mlp
    return [(attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, tp)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, attn: AttentionFn):
        """x: the previous layer's MLP output (the embeddings at layer 0); residual: the running sum before it
        (None at layer 0). -> (this layer's MLP output, running sum before it): the layer's output is their sum,
        left unformed so that the next norm adds it in the same kernel."""
        x, residual, _ = self.forward_from(x, residual, cos, sin, attn)
        return x, residual

    def forward_from(self, x, residual, cos, sin, attn: AttentionFn):
        """forward, plus the layer's input (the running sum its input norm formed: what EAGLE-3 captures). One row
        on CUDA with RuntimeOptions.fused_norm_gemv: the input norm inside the q/k/v product's launch."""
        att = self.self_attn
        normed_qkv = normed_project(x, residual, self.input_layernorm, att.q_proj, att.k_proj, att.v_proj)
        if normed_qkv is None:
            h, layer_input = self.input_layernorm.add_norm(x, residual)
            return (*self.forward_normed(h, layer_input, cos, sin, attn), layer_input)
        qkv, layer_input = normed_qkv
        return (*self._after_attention(att.attend(*qkv, cos, sin, attn), layer_input), layer_input)

    def fused_projection_groups(self) -> list[tuple[Linear, ...]]:
        """Projections of one input, packed into one weight at load (cpu_linear.fuse_projections)."""
        return attention_and_mlp_groups(self)

    def forward_normed(self, h, residual, cos, sin, attn: AttentionFn):
        """The layer after its input norm: h = input_layernorm(layer input), residual = the layer input."""
        return self._after_attention(self.self_attn(h, cos, sin, attn), residual)

    def _after_attention(self, h, residual):
        """The post-attention norm (inside the gate/up product's launch where normed_project serves it) and the MLP
        -> (its output, the running sum before it)."""
        normed_up = normed_project(h, residual, self.post_attention_layernorm, self.mlp.gate_proj, self.mlp.up_proj)
        if normed_up is not None:  # one row on CUDA: the norm inside the gate/up product's launch
            (gate, up), residual = normed_up
            return self.mlp.down(gate, up), residual
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(h), residual


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig, body: nn.Module | None = None, tp: TensorParallel = SINGLE):
        """body: embed_tokens, layers, norm (models/hybrid.py passes its own); default DecoderBody. tp: the group the
        model is split over (models/tensor_parallel.py; cfg is then the rank's config): its lm_head keeps the rank's
        vocabulary rows and compute_logits gathers them."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = body if body is not None else DecoderBody(cfg, tp)
        start, stop = tp.padded_split(cfg.vocab_size)
        self.lm_head = Linear(cfg.hidden_size, stop - start, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryFrequencies(cfg)

    inv_freq = property(lambda self: self.rotary.inv_freq)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (cos, sin), each [T, 1, D] in dtype, from fp32 angles as HF computes them."""
        return rope_table(positions, self.inv_freq, dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn, capture_layers: tuple[int, ...] = (),
        after_layer: Callable[[int], None] | None = None, linear: Callable | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions: [T] -> (final normed hidden [T, H], captured hidden states).
        capture_layers lists layer INPUTS to capture (c = the output of layer c - 1); c = num_layers captures
        the last layer's output, before the final norm. after_layer, when given, is called with the number of layers
        done after each layer: CUDA-graph capture cuts the forward into segments there (runner/graph_runner.py).
        linear: a hybrid model's state backend, which its Gated DeltaNet layers call (models/hybrid.py)."""
        mixers = () if linear is None else (linear,)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        captured, residual = [], None
        for i, layer in enumerate(self.model.layers):
            # the input norm forms the layer's input (the running sum) anyway: a captured state costs no add
            x, residual, layer_input = layer.forward_from(x, residual, cos, sin, attn, *mixers)
            if i in capture_layers:
                captured.append(layer_input)
            if after_layer is not None:
                after_layer(i + 1)
        normed, total = self.model.norm.add_norm(x, residual)
        if len(self.model.layers) in capture_layers:
            captured.append(total)
        return normed, captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the lm_head's product in the model's dtype (as HF's `.float()`; on CUDA in one launch),
        gathered over the vocabulary's shards under tensor parallelism."""
        logits = self.lm_head(hidden, out_dtype=torch.float32)
        return logits if self.tp.size == 1 else self.tp.gather_last_dim(logits)[..., : self.config.vocab_size]
