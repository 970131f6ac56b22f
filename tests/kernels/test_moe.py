"""The stacked-expert reference (kernels/moe.py, the GPU kernels' oracle) equals SparseMoe's per-module loop after
pack_experts, and packing leaves every expert's parameters as views of the stacks (nothing stored twice)."""

from __future__ import annotations

import torch

from hyperdraft.kernels.moe import moe_experts_reference
from hyperdraft.models.loader import load_model
from helpers.hybrid_fixtures import hybrid_models  # noqa: F401


def test_stacked_reference_equals_the_module_loop(hybrid_models):
    model = load_model(hybrid_models["next"], "float32", torch.device("cpu"))
    moe = model.model.layers[0].mlp
    assert moe.stack is not None
    assert moe.experts[2].up_proj.weight.data_ptr() == moe.stack.gate_up[2, moe.stack.down.shape[2]:].data_ptr()
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    experts, weights = moe.route(x)
    want = moe(x) - torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    got = moe_experts_reference(x, experts, weights, moe.stack.gate_up, moe.stack.down)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(experts.unique()) > 1  # several experts chosen: the routing matters
