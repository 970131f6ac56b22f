"""cpu_linear: the CPU fp32 linear that reorients few-row products must equal F.linear up to float32 rounding,
for every row count, layout and leading shape, and must leave every other case to F.linear itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hyperdraft.models import cpu_linear
from hyperdraft.models.cpu_linear import Linear, skinny_linear, uses_skinny_path

SHAPES = [(96, 64), (33, 130), (5, 7)]  # (out, in): square-ish, wide input, tiny and odd
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 11, 12, 16, 64]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("out_f,in_f", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_for_every_row_count(out_f, in_f, bias):
    gen = torch.Generator().manual_seed(out_f * 1000 + in_f)
    w = torch.randn(out_f, in_f, generator=gen)
    b = torch.randn(out_f, generator=gen) if bias else None
    for m in ROWS:
        x = torch.randn(m, in_f, generator=gen)
        with torch.inference_mode():
            got = skinny_linear(x, w, b)
        assert got.is_contiguous()
        _close(got, F.linear(x, w, b))


def test_transposed_equals_torchs_transposed_copy():
    """The copy that turns [n, m] product columns into rows (stacked columns from 1024 outputs, torch's copy below):
    the same bits as torch's, contiguous, for a one-row product's column slice and strided columns too."""
    gen = torch.Generator().manual_seed(4)
    for columns in (torch.randn(3000, 4, generator=gen), torch.randn(300, 4, generator=gen),
                    torch.randn(7, 11, generator=gen), torch.randn(2048, 2, generator=gen)[:, :1],
                    torch.randn(1100, 6, generator=gen)[:, ::2]):
        got = cpu_linear.transposed(columns)
        assert got.is_contiguous() and got.shape == (columns.shape[1], columns.shape[0])
        assert torch.equal(got, columns.t().contiguous())


def test_fast_path_covers_few_rows_only():
    w = torch.randn(16, 8)
    with torch.inference_mode():
        # decode (1 row) and chain verifies of up to 10 drafts (11 rows) are the widths the fast kernel is for
        assert all(uses_skinny_path(torch.randn(m, 8), w) for m in range(1, 12))
        assert not uses_skinny_path(torch.randn(cpu_linear.SKINNY_MAX_ROWS + 1, 8), w)
        assert not uses_skinny_path(torch.randn(0, 8), w)
        assert not uses_skinny_path(torch.randn(2, 8, dtype=torch.bfloat16), w.bfloat16())


def test_non_contiguous_and_3d_inputs():
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    cases = [
        torch.randn(24, 3, generator=gen).t(),  # transposed rows
        torch.randn(6, 48, generator=gen)[::2, ::2],  # strided in both dimensions
        torch.randn(1, 3, 24, generator=gen),  # [B, T, in]
        torch.randn(2, 2, 24, generator=gen).transpose(0, 1),  # non-contiguous 3-D
        torch.randn(24, generator=gen),  # a single 1-D vector
    ]
    for x in cases:
        with torch.inference_mode():
            _close(skinny_linear(x, w, b), F.linear(x, w, b))


def test_module_keeps_nn_linear_names_and_autograd():
    lin = Linear(12, 10)
    assert set(lin.state_dict()) == {"weight", "bias"}
    x = torch.randn(3, 12, requires_grad=True)
    lin(x).sum().backward()  # training callers fall back to F.linear, so gradients flow
    assert x.grad is not None and lin.weight.grad is not None
    with torch.inference_mode():
        _close(lin(x.detach()), F.linear(x.detach(), lin.weight, lin.bias))


def test_decoder_projections_use_it(tiny_models):
    from hyperdraft.models.loader import load_model

    model = load_model(tiny_models["qwen2"], "float32", torch.device("cpu"))  # qwen2: q/k/v carry biases
    layer = model.model.layers[0]
    projections = [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                   layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj, model.lm_head]
    assert all(isinstance(p, Linear) for p in projections)
    attn, mlp = layer.self_attn, layer.mlp  # a CPU model runs q/k/v and gate/up as one product each
    assert cpu_linear._pointers([attn.q_proj, attn.k_proj, attn.v_proj]) == attn.q_proj.fused_rows.ptrs
    assert cpu_linear._pointers([mlp.gate_proj, mlp.up_proj]) == mlp.gate_proj.fused_rows.ptrs


def _linears(gen, sizes, in_f, bias):
    lins = [Linear(in_f, n, bias=bias) for n in sizes]
    with torch.no_grad():
        for lin in lins:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen))
            if bias:
                lin.bias.copy_(torch.randn(lin.bias.shape, generator=gen))
    return lins


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projection_equals_separate_products(bias):
    gen = torch.Generator().manual_seed(2)
    lins = _linears(gen, [48, 16, 16], 32, bias)
    x = torch.randn(3, 32, generator=gen)
    with torch.inference_mode():
        separate = [F.linear(x, lin.weight, lin.bias) for lin in lins]
    cpu_linear.fuse_rows(*lins)
    assert lins[0].fused_rows is not None
    assert set(lins[1].state_dict()) == ({"weight", "bias"} if bias else {"weight"})
    with torch.inference_mode():
        for m in [1, 3, 8, 20]:  # the fused product, and F.linear per projection past the skinny widths
            xm = torch.randn(m, 32, generator=gen)
            for got, lin in zip(cpu_linear.project(xm, *lins), lins):
                _close(got, F.linear(xm, lin.weight, lin.bias))
        for got, want in zip(cpu_linear.project(x, *lins), separate):
            _close(got, want)


def test_fused_buffer_tracks_loads_and_notices_swaps():
    gen = torch.Generator().manual_seed(3)
    lins = _linears(gen, [8, 8], 16, True)
    cpu_linear.fuse_rows(*lins)
    x = torch.randn(2, 16, generator=gen)
    with torch.no_grad():  # an in-place load (load_state_dict, the loaders) writes through to the buffer
        lins[1].weight.copy_(torch.randn(8, 16, generator=gen))
        lins[1].bias.copy_(torch.randn(8, generator=gen))
    with torch.inference_mode():
        _close(cpu_linear.project(x, *lins)[1], F.linear(x, lins[1].weight, lins[1].bias))
    lins[1].weight = torch.nn.Parameter(torch.randn(8, 16, generator=gen))  # a swapped parameter leaves the buffer
    with torch.inference_mode():
        _close(cpu_linear.project(x, *lins)[1], F.linear(x, lins[1].weight, lins[1].bias))
