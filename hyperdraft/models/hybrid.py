"""HybridLM: the hybrid decoder of Qwen3.5 and Qwen3-Next. Three of every four layers mix tokens with a Gated DeltaNet (a linear-attention
recurrence with a fixed-size state per request); the rest with gated full attention over the paged K/V cache.

What differs from the dense decoder (decoder.py):
  full attention  q_proj is twice as wide: its second half is an output gate, attention output * sigmoid(gate);
                  RoPE rotates only the first rotary_dim dims of each head (partial_rotary_factor); q/k RMSNorm
  Gated DeltaNet  q|k|v, z, b, a projections; a causal depthwise conv over q|k|v, then the gated delta rule
                  (kernels/gated_delta.py) with g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b); a
                  per-head RMSNorm gated by SiLU(z); out_proj
  every RMSNorm   but the gated one scales by (1 + w) (its weights start at zero)
  Qwen3-Next      sparse MoE MLPs (moe.py) where its config says; its checkpoint packs each key head's q|k|v|z rows
                  (and b|a rows) together, unpacked at load into Qwen3.5's separate projections
                  (unpack_gdn_projections), so one GatedDeltaNet serves both

A layer's kind is its module's type (FullAttentionLayer, LinearAttentionLayer), never a list of layer ids: each layer
knows which mixer it calls, and each mixer its own index into the K/V pool or the state pool, taken from the model's
own frozen config when the layer is built. The stateful parts of a Gated DeltaNet (conv and recurrent state, per
request, including the per-token states a speculative verify keeps) live behind `linear`, the state backend
(attention/linear_backend.py), as the K/V cache lives behind `attn`. Module names mirror Hugging Face's.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel
from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels.activation import sigmoid_gate_mul, sigmoid_gate_mul_reference
from hyperdraft.kernels.gated_delta import GdnGates
from hyperdraft.kernels.norm import gated_rms_norm, gated_rms_norm_reference, rms_norm
from hyperdraft.models.config import FULL_ATTENTION, ModelConfig
from hyperdraft.models.cpu_linear import Linear, project
from hyperdraft.models.decoder import MLP, AttentionFn, DecoderLM
from hyperdraft.models.moe import SparseMoe
from hyperdraft.models.tensor_parallel import embedding, row_linear

# (state layer id, q|k|v before the conv [T, C], the gates, conv weight [C, K]) -> [T, HV, dv]
LinearFn = Callable[[int, torch.Tensor, GdnGates, torch.Tensor], torch.Tensor]


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + w), normalised and scaled in fp32, then cast (Qwen3.5's order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused(x):  # q/k norms: [T, heads, D] views inside the projection output
            return rms_norm(x, self.weight, self.eps, zero_centered=True)[0]
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).type_as(x)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (norm(x + residual), x + residual), the dense decoder's interface; on CUDA one launch for both
        (kernels/norm.py; the ~8 torch ops per norm measured ~1 ms of a 9B hybrid's 7.8 ms batch-1 step)."""
        if self._fused(x) and x.dim() == 2:
            return rms_norm(x, self.weight, self.eps, residual, zero_centered=True)
        total = x if residual is None else x + residual
        return self(total), total

    @staticmethod
    def _fused(x: torch.Tensor) -> bool:
        return use_fused_kernels(x) and x.dim() in (2, 3) and x.stride(-1) == 1


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the recurrence's output, then times SiLU(z): normalised in fp32, cast, weighted, gated."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x [T, HV, dv], z [T, HV * dv] (any row stride) -> [T, HV * dv]; on CUDA one launch (kernels/norm.py) for
        the ~10 torch ops below."""
        norm = gated_rms_norm if use_fused_kernels(x) else gated_rms_norm_reference
        return norm(x, z, self.weight, self.eps)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.kv_layer_id = kv_layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim * 2, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = row_linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp)
        self.q_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn: AttentionFn):
        t = x.shape[0]
        qg, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q, gate = qg.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        # q_norm and k_norm return new tensors, not views of the projection output: RoPE may rotate them in place
        q = self.q_norm(q)
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        out = attn(self.kv_layer_id, q.contiguous(), k, v.view(t, self.num_kv_heads, self.head_dim), (cos, sin))
        gated = sigmoid_gate_mul if use_fused_kernels(out) else sigmoid_gate_mul_reference
        return self.o_proj(gated(out, gate))


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, state_layer_id: int, tp: TensorParallel = SINGLE):
        """cfg: the rank's own under tensor parallelism (its key heads and their value heads); out_proj sums over tp."""
        super().__init__()
        lin = cfg.linear_attention
        self.state_layer_id = state_layer_id
        self.num_v_heads, self.v_head_dim = lin.num_v_heads, lin.v_head_dim
        self.in_proj_qkv = Linear(cfg.hidden_size, lin.conv_dim, bias=False)
        self.in_proj_z = Linear(cfg.hidden_size, lin.value_dim, bias=False)
        self.in_proj_b = Linear(cfg.hidden_size, lin.num_v_heads, bias=False)
        self.in_proj_a = Linear(cfg.hidden_size, lin.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(lin.conv_dim, lin.conv_dim, lin.conv_kernel, groups=lin.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(lin.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(lin.num_v_heads))
        self.norm = GatedRMSNorm(lin.v_head_dim, cfg.rms_norm_eps)
        self.out_proj = row_linear(lin.value_dim, cfg.hidden_size, False, tp)

    def forward(self, x: torch.Tensor, linear: LinearFn) -> torch.Tensor:
        mixed, z, b, a = project(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        gates = GdnGates(a, b, self.A_log, self.dt_bias)
        core = linear(self.state_layer_id, mixed, gates, self.conv1d.weight[:, 0, :])  # [T, HV, dv]
        return self.out_proj(self.norm(core, z))


def is_packed_gdn_projection(name: str, cfg: ModelConfig) -> bool:
    return cfg.fused_gdn_projections and name.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight"))


def unpack_gdn_projections(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """A packed checkpoint tensor as GatedDeltaNet's parameters: Qwen3-Next's in_proj_qkvz rows run per key head as
    [q dk | k dk | v g*dv | z g*dv] and in_proj_ba's as [b g | a g] (g = value heads per key head); Qwen3.5 keeps
    all q, then all k, then all v in in_proj_qkv, with z, b and a apart."""
    lin = cfg.linear_attention
    prefix, group = name.rsplit(".", 2)[0], lin.num_v_heads // lin.num_k_heads
    per_head = tensor.reshape(lin.num_k_heads, -1, tensor.shape[-1])  # [HK, rows of one key head, H]
    if name.endswith("in_proj_ba.weight"):
        b, a = per_head.split([group, group], dim=1)
        return [(f"{prefix}.in_proj_b.weight", b.flatten(0, 1)), (f"{prefix}.in_proj_a.weight", a.flatten(0, 1))]
    q, k, v, z = per_head.split([lin.k_head_dim, lin.k_head_dim, group * lin.v_head_dim, group * lin.v_head_dim], dim=1)
    qkv = torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)])
    return [(f"{prefix}.in_proj_qkv.weight", qkv), (f"{prefix}.in_proj_z.weight", z.flatten(0, 1))]


class HybridLayer(nn.Module):
    """The parts both kinds of layer share: norms, MLP, the residual stream (as decoder.DecoderLayer)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.mlp = SparseMoe(cfg, tp) if cfg.moe is not None and cfg.moe.is_sparse(layer_index) else MLP(cfg, tp)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin, attn: AttentionFn, linear: LinearFn):
        """-> (this layer's MLP output, the running sum before it), as DecoderLayer.forward."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        return self.forward_normed(h, residual, cos, sin, attn, linear)

    def forward_from(self, x, residual, cos, sin, attn: AttentionFn, linear: LinearFn):
        """forward, plus the layer's input (the running sum its input norm formed), as DecoderLayer.forward_from."""
        h, layer_input = self.input_layernorm.add_norm(x, residual)
        return (*self.forward_normed(h, layer_input, cos, sin, attn, linear), layer_input)

    def forward_normed(self, h, residual, cos, sin, attn: AttentionFn, linear: LinearFn):
        h = self.mix(h, cos, sin, attn, linear)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(h), residual

    def mix(self, h, cos, sin, attn: AttentionFn, linear: LinearFn) -> torch.Tensor:
        raise NotImplementedError


class FullAttentionLayer(HybridLayer):
    def __init__(self, cfg: ModelConfig, layer_index: int, kv_layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__(cfg, layer_index, tp)
        self.self_attn = GatedAttention(cfg, kv_layer_id, tp)

    def fused_projection_groups(self) -> list[tuple[Linear, ...]]:
        attn = self.self_attn
        return [(attn.q_proj, attn.k_proj, attn.v_proj), *self.mlp.fused_projection_groups()]

    def mix(self, h, cos, sin, attn: AttentionFn, linear: LinearFn) -> torch.Tensor:
        return self.self_attn(h, cos, sin, attn)


class LinearAttentionLayer(HybridLayer):
    def __init__(self, cfg: ModelConfig, layer_index: int, state_layer_id: int, tp: TensorParallel = SINGLE):
        super().__init__(cfg, layer_index, tp)
        self.linear_attn = GatedDeltaNet(cfg, state_layer_id, tp)

    def fused_projection_groups(self) -> list[tuple[Linear, ...]]:
        gdn = self.linear_attn
        return [(gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a), *self.mlp.fused_projection_groups()]

    def mix(self, h, cos, sin, attn: AttentionFn, linear: LinearFn) -> torch.Tensor:
        return self.linear_attn(h, linear)


def build_layers(cfg: ModelConfig, tp: TensorParallel = SINGLE) -> nn.ModuleList:
    """Each layer's module from the model's own config; full-attention layers number the K/V pool's layers, linear
    ones the state pool's."""
    layers, kv_id, state_id = [], 0, 0
    for index, kind in enumerate(cfg.kinds):
        if kind == FULL_ATTENTION:
            layers.append(FullAttentionLayer(cfg, index, kv_id, tp))
            kv_id += 1
        else:
            layers.append(LinearAttentionLayer(cfg, index, state_id, tp))
            state_id += 1
    return nn.ModuleList(layers)


class HybridBody(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = build_layers(cfg, tp)
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridLM(DecoderLM):
    """The dense decoder's forward and logits over a hybrid body; forward's `linear` is the state backend."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__(cfg, HybridBody(cfg, tp), tp)
