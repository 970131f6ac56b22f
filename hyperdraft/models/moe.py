"""SparseMoe: Qwen3-Next's sparse MLP. A router picks each token's top_k of num_experts SwiGLU experts and weights
them by their softmax probabilities (renormalised over the top_k when norm_topk_prob), and one shared expert, gated
per token by a sigmoid, always adds its output. Module names mirror Hugging Face's checkpoints (mlp.gate,
mlp.experts.{i}.{gate,up,down}_proj, mlp.shared_expert.*, mlp.shared_expert_gate).

The expert loop here is the reference (and the CPU path): a Python loop over the experts that tokens chose, each a
gather of its tokens, its SwiGLU, and a weighted scatter-add. Precision follows transformers: router logits in the
model dtype, softmax and top-k in fp32, weights cast back. On CUDA the routed experts run as two grouped Triton
launches (kernels/moe.py) over the experts' weights stacked at load (pack_experts: the per-expert parameters become
views of the stacks, so nothing is stored twice); they read the routing on the device, so CUDA graphs can hold them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel
from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels.moe import moe_experts
from hyperdraft.models.config import ModelConfig, MoeConfig
from hyperdraft.models.cpu_linear import Linear
from hyperdraft.models.decoder import SwiGLU


@dataclass(frozen=True)
class ExpertStack:
    gate_up: torch.Tensor  # [E, 2I, H]: each expert's gate rows, then its up rows
    down: torch.Tensor  # [E, H, I]


class SparseMoe(nn.Module):
    """Under tensor parallelism (cfg: the rank's config) each rank keeps a slice of every expert's intermediate
    columns and of the shared expert's, and the router and the shared expert's gate whole: every rank routes alike,
    its experts add partial outputs, and one all-reduce per layer sums them (not one per expert)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        moe: MoeConfig = cfg.moe
        self.tp = tp
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden_size, moe.intermediate_size) for _ in range(moe.num_experts))
        self.shared_expert = SwiGLU(cfg.hidden_size, moe.shared_intermediate_size)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        self.stack: ExpertStack | None = None  # pack_experts, after the weights are loaded and cast

    def pack_experts(self) -> None:
        """Stack the routed experts' weights into two buffers and re-point each expert's parameters at its slices."""
        first = self.experts[0]
        inter, hidden = first.gate_proj.weight.shape
        like = dict(dtype=first.gate_proj.weight.dtype, device=first.gate_proj.weight.device)
        gate_up = torch.empty(len(self.experts), 2 * inter, hidden, **like)
        down = torch.empty(len(self.experts), hidden, inter, **like)
        with torch.no_grad():
            for e, expert in enumerate(self.experts):
                gate_up[e, :inter].copy_(expert.gate_proj.weight)
                gate_up[e, inter:].copy_(expert.up_proj.weight)
                down[e].copy_(expert.down_proj.weight)
                expert.gate_proj.weight = nn.Parameter(gate_up[e, :inter], requires_grad=False)
                expert.up_proj.weight = nn.Parameter(gate_up[e, inter:], requires_grad=False)
                expert.down_proj.weight = nn.Parameter(down[e], requires_grad=False)
        self.stack = ExpertStack(gate_up, down)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (the top_k experts of each token [T, top_k], their weights [T, top_k] in x's dtype)."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        experts, weights = self.route(x)
        if self.stack is not None and use_fused_kernels(x):
            out = moe_experts(x, experts, weights, self.stack.gate_up, self.stack.down)
        else:
            out = torch.zeros_like(x)
            for e in experts.unique().tolist():  # the reference: one expert at a time
                token, slot = (experts == e).nonzero(as_tuple=True)
                out.index_add_(0, token, (self.experts[e](x[token]) * weights[token, slot, None]).to(out.dtype))
        out = self.tp.all_reduce(out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x))
        return out if residual is None else out + residual

    def fused_projection_groups(self) -> list[tuple[Linear, ...]]:
        """The shared expert's gate/up; the routed experts' weights live in the stacks (pack_experts)."""
        return self.shared_expert.fused_projection_groups()


def pack_experts(layers) -> None:
    """pack_experts of every sparse MLP among the layers (after loading and the dtype cast)."""
    for layer in layers:
        if isinstance(layer.mlp, SparseMoe):
            layer.mlp.pack_experts()
