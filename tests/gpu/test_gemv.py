"""kernels/gemv.py (the few-row Triton GEMV the CUDA models use) against F.linear, its batch invariance, the
dispatch in cuda_linear, and programmatic dependent launch (kernels/pdl.py) inside a CUDA graph. Run on a GPU
machine: `python3 -m pytest tests/gpu/test_gemv.py`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hyperdraft.kernels.gemv as gemv_module
from hyperdraft.kernels import cuda_kernels, pdl
from hyperdraft.kernels.activation import silu_mul
from hyperdraft.kernels.gemv import MAX_ROWS, cuda_linear, gemv, gemv_reference
from hyperdraft.kernels.norm import rms_norm
from hyperdraft.options import RuntimeOptions, activated

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE = "cuda"
# bf16/fp16: one rounding of the fp32 result (2^-8 relative) plus another summation order; fp32: the order only.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=1e-2),
       torch.float16: dict(atol=4e-3, rtol=2e-3)}


def _inputs(m, n, k, dtype, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    return x, w, b


def _poisoned(fn, *args):
    """Run fn with the module's output allocation filled with NaN, so an element the kernel skips stays NaN."""
    real_empty = torch.empty
    try:
        gemv_module.torch.empty = lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan"))
        return fn(*args)
    finally:
        gemv_module.torch.empty = real_empty


@pytest.mark.parametrize("m", [1, 2, 3, 6, 8, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (77, 300), (8, 16), (1000, 2049), (576, 1536),
                                 (200, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(m, n, k, dtype, bias):
    """Ragged N (not a multiple of the 8-column block) and K (not a multiple of the K block, smaller than one
    prefetched line), every row count up to MAX_ROWS, with and without bias."""
    x, w, b = _inputs(m, n, k, dtype, seed=m * 7 + n, bias=bias)
    out = _poisoned(gemv, x, w, b)
    ref = gemv_reference(x.double(), w.double(), None if b is None else b.double())
    assert out.shape == (m, n) and out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("n,k", [(4096, 14336), (6144, 4096), (77, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_residual_equals_product_then_add(m, n, k, dtype):
    """The residual epilogue (an EAGLE-3 head's down projection + its residual stream) is bit-identical to the
    product followed by an eager add, in every dtype, on both kernels (1 row: vector; 6: tensor cores, swapped
    on the 6144-column weight), with bias; no element left unwritten."""
    x, w, b = _inputs(m, n, k, dtype, seed=n + m, bias=True)
    residual = torch.randn(m, n, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype) * 4
    fused = _poisoned(gemv, x, w, b, residual)
    assert not fused.isnan().any()
    assert torch.equal(fused, gemv(x, w, b) + residual)
    torch.testing.assert_close(cuda_linear(x, w, b, residual), fused, rtol=0, atol=0)


@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.parametrize("n", [1000, 1024])  # 1024 columns: gemv_mma.cu at six rows in bf16/fp16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemv_float32_output_equals_cast(m, n, dtype):
    """fp32 logits straight from the kernel: bit-identical to the product in the input dtype, then `.float()`."""
    x, w, _ = _inputs(m, n, 4096, dtype, seed=41 + m)
    logits = _poisoned(gemv, x, w, None, None, torch.float32)
    assert logits.dtype == torch.float32 and torch.equal(logits, gemv(x, w).float())
    assert torch.equal(cuda_linear(x, w, out_dtype=torch.float32), logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [4096, 6144])  # on an H100, 6144 columns take the wide tile (WIDE_BLOCK_N)
def test_gemv_rows_do_not_depend_on_the_batch(dtype, n):
    """From 2 to 16 rows (verify widths) a token's projection is bit-identical whatever rows share the call."""
    x, w, _ = _inputs(16, n, 4096, dtype, seed=5)
    full = gemv(x, w)
    for i in range(0, 16, 2):
        assert torch.equal(gemv(x[i:i + 2], w), full[i:i + 2])
    assert torch.equal(gemv(x[2:8], w), full[2:8])
    strided = torch.randn(3, 2 * 4096, device=DEVICE, dtype=dtype)[:, :4096]  # rows with a stride
    assert torch.equal(gemv(strided, w), gemv(strided.contiguous(), w))
    assert torch.equal(gemv(strided[:1], w), gemv(strided[:1].contiguous(), w))


MEASURED = torch.cuda.is_available() and torch.cuda.get_device_capability() in cuda_kernels.MEASURED_ARCHS


@pytest.mark.skipif(not MEASURED, reason="gemv_mma.cu runs only on the GPUs it was measured on (Triton elsewhere)")
def test_mma_kernel_serves_an_8b_layers_few_row_products():
    """On the measured GPUs (with nvcc) the CUDA kernel is the one that runs 2..16 rows of every 8B-layer and
    EAGLE-3-head shape, bf16 and fp16; fp32, ragged shapes and misaligned rows keep the Triton kernel."""
    assert cuda_kernels.module(torch.device(DEVICE)) is not None, "nvcc build or cubin load failed (see the log)"
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (6144, 8192),
                 (4096, 12288), (32000, 4096)]:
        w = torch.empty(n, k, device=DEVICE, dtype=torch.bfloat16)
        for m in (2, 6, 16):
            x = torch.empty(m, k, device=DEVICE, dtype=torch.bfloat16)
            assert gemv_module.mma_fits(x, w, None), (n, k, m)
    w = torch.empty(1000, 4096, device=DEVICE, dtype=torch.bfloat16)
    x = torch.empty(6, 4096, device=DEVICE, dtype=torch.bfloat16)
    assert not gemv_module.mma_fits(x, w, None)  # 1000 columns: not whole 16-column blocks
    w32 = torch.empty(4096, 4096, device=DEVICE)
    assert not gemv_module.mma_fits(x.float(), w32, None)
    misaligned = torch.empty(6, 4097, device=DEVICE, dtype=torch.bfloat16)[:, 1:]
    assert not gemv_module.mma_fits(misaligned, torch.empty(1024, 4096, device=DEVICE, dtype=torch.bfloat16), None)


@pytest.mark.skipif(not MEASURED, reason="gemv_mma.cu runs only on the GPUs it was measured on (Triton elsewhere)")
@pytest.mark.parametrize("m", [2, 6, 9, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mma_kernel_and_triton_fallback_agree(monkeypatch, m, dtype):
    """gemv_mma.cu (bias, residual, fp32 output) against the Triton tensor-core kernel it replaces and against
    float64: the same products up to the summation order; the residual epilogue rounds like the Triton one."""
    x, w, b = _inputs(m, 2048, 3072, dtype, seed=11 * m, bias=True)
    residual = torch.randn(m, 2048, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    fast = _poisoned(gemv, x, w, b, residual)
    fast_logits = _poisoned(gemv, x, w, b, None, torch.float32)
    with activated(RuntimeOptions.from_env(cuda_kernels=False)):  # the Triton fallback
        assert not gemv_module.mma_fits(x, w, b)
        slow = gemv(x, w, b, residual)
    ref = gemv_reference(x.double(), w.double(), b.double(), residual.double())
    assert not fast.isnan().any() and not fast_logits.isnan().any()
    torch.testing.assert_close(fast.double(), ref, **TOL[dtype])
    torch.testing.assert_close(fast.float(), slow.float(), **TOL[dtype])
    assert torch.equal(fast, (fast_logits.to(dtype) + residual))  # the product rounds to dtype before the residual


def test_cuda_linear_dispatch():
    """Up to MAX_ROWS rows go to the GEMV, more to cuBLAS; a 3-d input keeps its leading dims."""
    x, w, b = _inputs(MAX_ROWS + 1, 512, 256, torch.bfloat16, seed=9, bias=True)
    assert torch.equal(cuda_linear(x, w, b), F.linear(x, w, b))
    few = x[:MAX_ROWS]
    assert torch.equal(cuda_linear(few, w, b), gemv(few, w, b))
    assert cuda_linear(few.view(2, MAX_ROWS // 2, 256), w).shape == (2, MAX_ROWS // 2, 512)


def _layer_chain(h, weights):
    """RMSNorm -> GEMV -> SiLU*up -> GEMV -> RMSNorm(+residual), repeated: every PDL kernel reads what the one
    before it wrote, so a missing wait shows up as a stale read."""
    x, residual = rms_norm(h, weights[0][0], 1e-6)
    for norm_w, up_w, down_w in weights:
        gu = gemv(x, up_w)
        act = silu_mul(gu[:, : gu.shape[1] // 2], gu[:, gu.shape[1] // 2:])
        x, residual = rms_norm(gemv(act, down_w), norm_w, 1e-6, residual)
    return x


def test_pdl_chain_in_a_graph_equals_plain_launches(monkeypatch):
    """The same kernels captured in one CUDA graph with programmatic dependent launch give bit-identical results
    to plain eager launches (PDL changes when a kernel may start, never what it computes)."""
    if not pdl.pdl_enabled(torch.device(DEVICE)):
        pytest.skip("PDL needs a Hopper or newer GPU")  # the plain path is what runs there; nothing else to compare
    g = torch.Generator().manual_seed(3)
    dtype, hidden, inter = torch.bfloat16, 1024, 2816
    weights = [(torch.rand(hidden, generator=g).to(DEVICE, dtype) + 0.5,
                (torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).to(DEVICE, dtype),
                (torch.randn(hidden, inter, generator=g) / inter**0.5).to(DEVICE, dtype)) for _ in range(16)]
    h = torch.randn(2, hidden, generator=g).to(DEVICE, dtype)
    static_h = h.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _layer_chain(static_h, weights)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _layer_chain(static_h, weights)
    outs = []
    for seed in range(4):
        static_h.copy_(torch.randn(2, hidden, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype))
        graph.replay()
        outs.append((static_h.clone(), static_out.clone()))
    with activated(RuntimeOptions.from_env(pdl=False)):
        for inp, out in outs:
            assert torch.equal(_layer_chain(inp, weights), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,inter", [(4096, 12288), (96, 200), (64, 1000), (576, 1536), (64, 1100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_silu_mul_gemv_equals_the_activation_then_the_product(dtype, n, inter, with_residual):
    """The batch-1 MLP's down projection with SiLU(gate) * up computed in its prologue == silu_mul's output fed to
    gemv, bit for bit (gate and up are views into one gate/up output; ragged widths take the masked loads), and
    every output element written (poisoned allocation)."""
    from hyperdraft.kernels.gemv import silu_mul_gemv, silu_mul_gemv_fits

    g = torch.Generator().manual_seed(n + inter)
    gate_up = (torch.randn(1, 2 * inter, generator=g) * 3).to(DEVICE, dtype)
    gate, up = gate_up.split(inter, dim=-1)
    w = (torch.randn(n, inter, generator=g) / inter**0.5).to(DEVICE, dtype)
    bias = torch.randn(n, generator=g).to(DEVICE, dtype)
    residual = torch.randn(1, n, generator=g).to(DEVICE, dtype) if with_residual else None
    assert silu_mul_gemv_fits(gate, up, w)
    want = gemv(silu_mul(gate, up), w, bias, residual)
    got = _poisoned(silu_mul_gemv, gate, up, w, bias, residual)
    assert torch.equal(got, want), (got - want).abs().max()
    assert not silu_mul_gemv_fits(gate_up[:, :inter].expand(2, inter), up.expand(2, inter), w)  # one row only
