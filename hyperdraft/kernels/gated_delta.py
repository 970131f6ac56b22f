"""The Gated DeltaNet token mixer's two stateful pieces, in plain torch: the causal depthwise conv over q|k|v with its
state, and the gated delta rule with its recurrent state. These are the references (and the CPU path); GPU kernels
that replace them are checked against them.

Terms, for one request feeding n tokens:
  conv state      [C, K-1]: the last K-1 conv inputs before the tokens (C = 2 * key_dim + value_dim, K the kernel)
  recurrent state h [HV, dk, dv] fp32: per value head, the map from keys to values the recurrence keeps
  per token t     q_t, k_t [Hk, dk] (L2-normalised, q scaled by dk^-1/2, repeated to HV heads), v_t [HV, dv],
                  g_t [HV] (log decay, <= 0), beta_t [HV] (write strength)
  the rule        h <- h * exp(g_t);  u = beta_t * (v_t - h^T k_t);  h <- h + k_t u^T;  o_t = h^T q_t
This is the form of transformers' torch_recurrent_gated_delta_rule, which the equality tests compare with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GdnGates:
    """A Gated DeltaNet layer's gate inputs for the packed tokens, before their nonlinearities: the log decay
    g = -exp(A_log) * softplus(a + dt_bias), in fp32 (exp(A_log) overflows fp16), and the write strength
    beta = sigmoid(b), in b's dtype. The Triton delta walk computes both inside its token loop, which saves the seven
    elementwise launches per layer that decay_and_beta (the reference, and the CPU path) runs."""

    a: torch.Tensor  # [T, HV], any row stride (a column block of the fused input projection)
    b: torch.Tensor  # [T, HV], any row stride
    A_log: torch.Tensor  # [HV]
    dt_bias: torch.Tensor  # [HV]

    def decay_and_beta(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (g [T, HV] fp32, beta [T, HV] in b's dtype)."""
        g = -self.A_log.float().exp() * F.softplus(self.a.float() + self.dt_bias)
        return g, self.b.sigmoid()


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, C] new inputs, conv_state [C, K-1], weight [C, K] -> (SiLU(conv) [n, C] in x's dtype, the new conv state
    [C, K-1]: the last K-1 inputs)."""
    k = weight.shape[1]
    window = torch.cat([conv_state.to(weight.dtype), x.t().to(weight.dtype)], dim=1)  # [C, K-1+n]
    out = F.conv1d(window[None], weight[:, None, :], groups=weight.shape[0])[0]  # [C, n]
    return F.silu(out).t().to(x.dtype), window[:, window.shape[1] - (k - 1):]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qkv(mixed: torch.Tensor, key_dim: int, k_head_dim: int, num_v_heads: int, v_head_dim: int):
    """The conv output [n, C] -> (q, k [n, HV, dk] fp32, L2-normalised, q scaled; v [n, HV, dv] fp32): q and k of each
    key head serve num_v_heads / num_k_heads consecutive value heads."""
    n = mixed.shape[0]
    q, k, v = mixed.float().split([key_dim, key_dim, num_v_heads * v_head_dim], dim=-1)
    q, k = q.view(n, -1, k_head_dim), k.view(n, -1, k_head_dim)
    group = num_v_heads // q.shape[1]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    q = l2norm(q) * k_head_dim ** -0.5
    return q, l2norm(k), v.view(n, num_v_heads, v_head_dim)


def delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: state [..., HV, dk, dv] fp32; q, k [..., HV, dk]; v [..., HV, dv]; g, beta [..., HV] -> (o [..., HV,
    dv], the new state). Leading dims batch independent requests; each one's arithmetic is the same either way."""
    state = state * g.float().exp()[..., None, None]
    u = beta.float()[..., None] * (v - (state * k[..., :, None]).sum(dim=-2))
    state = state + k[..., :, None] * u[..., None, :]
    return (state * q[..., :, None]).sum(dim=-2), state


def causal_conv_step(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B requests: x [B, C], conv_state [B, C, K-1] -> (SiLU(conv) [B, C], new states), the
    same conv as causal_conv's, as one grouped conv1d over every request's channels."""
    bsz, channels = x.shape
    window = torch.cat([conv_state.to(weight.dtype), x[:, :, None].to(weight.dtype)], dim=2)  # [B, C, K]
    out = F.conv1d(window.reshape(1, bsz * channels, -1), weight.repeat(bsz, 1)[:, None, :], groups=bsz * channels)
    return F.silu(out.view(bsz, channels)).to(x.dtype), window[:, :, 1:]


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """n tokens in order from `state` -> (o [n, HV, dv] fp32, the state after the last token)."""
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        out[t], state = delta_step(state, q[t], k[t], v[t], g[t], beta[t])
    return out, state
