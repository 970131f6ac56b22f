"""Routed experts of a sparse MoE MLP (Qwen3-Next), grouped by (token, choice) pair, beside the torch reference.

Terms: x [T, H]; experts, weights [T, K] (each token's top-K choices and their routing weights); the experts'
weights stacked, gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I]. Output [T, H]:
  out[t] = sum_k weights[t, k] * down[e] @ (SiLU(gate[e] @ x[t]) * (up[e] @ x[t])),   e = experts[t, k]

The kernels read the routing from the device, so nothing syncs and a CUDA graph can hold them (the reference loops
over the experts that occur, which needs their list on the host). Two launches: one program per (pair, block of I)
computes the SwiGLU activation, one per (pair, block of H) the weighted down projection; the K partial outputs of a
token are summed in fp32 afterwards. Each pair streams its expert's rows once: the decode and verify regime (a few
tokens, each expert read by about T*K/E pairs). A prefill of thousands of tokens reads an expert once per pair that
chose it; a sorted, tensor-core grouped GEMM is the better form there (not written yet).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyperdraft.kernels._triton import jit, tl, triton


@jit
def _gate_up(X, W, Experts, Act, s_xt, s_we, s_wn, inter, hidden, TOPK: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr):
    pair = tl.program_id(0)
    t = pair // TOPK
    e = tl.load(Experts + pair).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < inter
    gate = tl.zeros([BN], dtype=tl.float32)
    up = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, hidden, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < hidden
        x = tl.load(X + t * s_xt + k, mask=kmask, other=0.0).to(tl.float32)
        rows = W + e * s_we + n[:, None] * s_wn + k[None, :]
        wmask = nmask[:, None] & kmask[None, :]
        gate += tl.sum(tl.load(rows, mask=wmask, other=0.0).to(tl.float32) * x[None, :], axis=1)
        up += tl.sum(tl.load(rows + inter * s_wn, mask=wmask, other=0.0).to(tl.float32) * x[None, :], axis=1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Act + pair * inter + n, act, mask=nmask)


@jit
def _down(Act, W, Experts, Weights, Out, s_we, s_wn, inter, hidden, BN: tl.constexpr, BK: tl.constexpr):
    pair = tl.program_id(0)
    e = tl.load(Experts + pair).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < hidden
    acc = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, inter, BK):
        k = k0 + tl.arange(0, BK)
        kmask = k < inter
        a = tl.load(Act + pair * inter + k, mask=kmask, other=0.0)
        w = tl.load(W + e * s_we + n[:, None] * s_wn + k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    weight = tl.load(Weights + pair).to(tl.float32)
    tl.store(Out + pair * hidden + n, acc * weight, mask=nmask)


def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """x [T, H] (last dim contiguous), experts / weights [T, K], gate_up [E, 2I, H], down [E, H, I] -> [T, H] in x's
    dtype (both stacks contiguous in their last dim)."""
    tokens, topk = experts.shape
    inter, hidden = down.shape[2], down.shape[1]
    pairs = tokens * topk
    experts, weights = experts.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
    act = torch.empty(pairs, inter, dtype=torch.float32, device=x.device)
    partial = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    if pairs:
        _gate_up[(pairs, triton.cdiv(inter, 32))](x, gate_up, experts, act, x.stride(0), gate_up.stride(0),
                                                 gate_up.stride(1), inter, hidden, TOPK=topk, BN=32, BK=128,
                                                 num_warps=4)
        _down[(pairs, triton.cdiv(hidden, 64))](act, down, experts, weights, partial, down.stride(0), down.stride(1),
                                               inter, hidden, BN=64, BK=64, num_warps=4)
    return partial.view(tokens, topk, hidden).sum(dim=1).to(x.dtype)


def moe_experts_reference(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor) -> torch.Tensor:
    """The same sum, one expert at a time over the tokens that chose it (transformers' order)."""
    out = torch.zeros_like(x)
    inter = down.shape[2]
    for e in experts.unique().tolist():
        token, slot = (experts == e).nonzero(as_tuple=True)
        h = x[token] @ gate_up[e].t()
        act = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, token, ((act @ down[e].t()) * weights[token, slot, None]).to(out.dtype))
    return out
