"""The fused elementwise kernels (RMSNorm with the residual add, SiLU * up, x * sigmoid(gate), RoPE, partial too)
against their torch references, then a whole model (and a hybrid model's gated attention layer) with them against the
same on the references. Run on a GPU machine:
`python3 -m pytest tests/gpu/test_fused_kernels.py`. (With TRITON_INTERPRET=1 and triton installed they also run
on the CPU, slowly, without the allocator poisoning.)

The launchers allocate their outputs with torch.empty; each test first fills and frees a NaN block of the same
size, so the caching allocator hands that block back and an element the kernel leaves unwritten stays NaN.
"""

from __future__ import annotations

import os

import pytest
import torch

from hyperdraft.options import RuntimeOptions, activated
from hyperdraft.kernels.activation import (sigmoid_gate_mul, sigmoid_gate_mul_reference, silu_mul,
                                           silu_mul_reference)
from hyperdraft.kernels.norm import rms_norm, rms_norm_reference
from hyperdraft.kernels.rope import apply_rope, apply_rope_reference, rope_cos_sin, rope_cos_sin_reference
from hyperdraft.models.decoder import rotated

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPES = [torch.float32, torch.bfloat16]
# |out - ref| <= ATOL + RTOL * |ref|. fp32: another reduction order / rsqrt. bf16: up to three bf16 steps (2^-7
# relative each), which only the interpreter's truncating casts need; on a GPU the kernels round as torch does.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2.5e-2),
       torch.float16: dict(atol=3e-3, rtol=3e-3)}
# One rounding of one add is exact on a GPU; the interpreter truncates to bf16 instead of rounding to nearest.
EXACT = {torch.float32: dict(atol=0, rtol=0), torch.bfloat16: TOL[torch.bfloat16] if INTERPRET else dict(atol=0, rtol=0)}


def _poison(*shapes, dtype):
    if DEVICE == "cuda":
        for shape in shapes:
            torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)  # freed at once: its block is reused next


def _randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,dim", [(1, 4096), (7, 64), (300, 896), (5, 5120)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, num_tokens, dim, with_residual):
    x = _randn(num_tokens, dim, dtype=dtype, seed=1) * 3
    residual = _randn(num_tokens, dim, dtype=dtype, seed=2) if with_residual else None
    weight = _randn(dim, dtype=dtype, seed=3)
    _poison((num_tokens, dim), (num_tokens, dim), dtype=dtype)
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    ref, ref_residual = rms_norm_reference(x, weight, 1e-6, residual)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(new_residual, ref_residual, **EXACT[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_heads(dtype):
    """q heads viewed inside a fused q/k/v output (Qwen3's per-head q/k norm)."""
    t, heads, kv_heads, d = 9, 4, 2, 128
    qkv = _randn(t, (heads + 2 * kv_heads) * d, dtype=dtype, seed=4)
    q = qkv[:, : heads * d].view(t, heads, d)
    weight = _randn(d, dtype=dtype, seed=5)
    _poison((t, heads, d), dtype=dtype)
    out, _ = rms_norm(q, weight, 1e-6)
    torch.testing.assert_close(out, rms_norm_reference(q, weight, 1e-6)[0], **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,dim", [(1, 4096), (6, 64), (37, 896)])
def test_embed_hidden_norm(dtype, num_tokens, dim):
    """EAGLE-3's layer input (normed embeddings beside normed hidden states, one launch) against gather + two
    torch norms + cat; the hidden rows and the ids are strided views (every other row, a column of a grid)."""
    from hyperdraft.kernels.norm import embed_hidden_norm, embed_hidden_norm_reference

    table = _randn(500, dim, dtype=dtype, seed=14)
    hidden = (_randn(2 * num_tokens, dim, dtype=dtype, seed=15) * 3)[::2]
    ids = torch.randint(0, 500, (num_tokens, 3), generator=torch.Generator().manual_seed(16)).to(DEVICE)[:, 1]
    w_embed, w_hidden = _randn(dim, dtype=dtype, seed=17), _randn(dim, dtype=dtype, seed=18)
    _poison((num_tokens, 2 * dim), dtype=dtype)
    out = embed_hidden_norm(ids, table, hidden, w_embed, w_hidden, 1e-5)
    torch.testing.assert_close(out, embed_hidden_norm_reference(ids, table, hidden, w_embed, w_hidden, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,dim,head_dim", [(1, 4096, 128), (6, 4096, 128), (37, 896, 64)])
def test_embed_hidden_norm_with_rope_table(dtype, num_tokens, dim, head_dim):
    """The draft step's input launch that also builds the step's RoPE cos/sin: each output bit-identical to its own
    launch (embed_hidden_norm without rope, rope_cos_sin), every element written (poisoned first)."""
    from hyperdraft.kernels.norm import embed_hidden_norm

    table = _randn(500, dim, dtype=dtype, seed=24)
    hidden = _randn(num_tokens, dim, dtype=dtype, seed=25) * 3
    ids = torch.randint(0, 500, (num_tokens,), generator=torch.Generator().manual_seed(26)).to(DEVICE)
    positions = torch.randint(0, 100000, (num_tokens,), generator=torch.Generator().manual_seed(27)).to(DEVICE)
    inv_freq = (1.0 / 500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)).to(DEVICE)
    w_embed, w_hidden = _randn(dim, dtype=dtype, seed=28), _randn(dim, dtype=dtype, seed=29)
    _poison((num_tokens, 2 * dim), dtype=dtype)
    x, cos, sin = embed_hidden_norm(ids, table, hidden, w_embed, w_hidden, 1e-5, rope=(positions, inv_freq))
    assert not (x.isnan().any() or cos.isnan().any() or sin.isnan().any())
    assert torch.equal(x, embed_hidden_norm(ids, table, hidden, w_embed, w_hidden, 1e-5))
    ref_cos, ref_sin = rope_cos_sin(positions, inv_freq, dtype)
    assert cos.shape == ref_cos.shape and torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,width", [(1, 14336), (6, 64), (300, 4864)])
def test_silu_mul(dtype, num_tokens, width):
    gate_up = _randn(num_tokens, 2 * width, dtype=dtype, seed=6) * 4
    gate, up = gate_up.split(width, -1)
    _poison((num_tokens, width), dtype=dtype)
    torch.testing.assert_close(silu_mul(gate, up), silu_mul_reference(gate, up), **TOL[dtype])


# RoPE in a 16-bit dtype rounds each product, then the sum, as eager `x * cos + rotate_half(x) * sin` does: bit for bit
# on a GPU (bisected in tests/gpu/logs/session_2026-11-27b.md: from e4f4fd3; before it 12-62505 elements per shape
# differed). fp32 keeps a tolerance: the compiler contracts a product and the sum into one FMA.
_ROPE_TOL = {dtype: TOL[dtype] if INTERPRET or dtype == torch.float32 else dict(atol=0, rtol=0) for dtype in TOL}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim", [(1, 32, 8, 128), (5, 4, 1, 64), (300, 14, 2, 64)])
def test_rope(dtype, num_tokens, heads, kv_heads, head_dim):
    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=7)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    positions = torch.randint(0, 131072, (num_tokens,), generator=torch.Generator().manual_seed(8))
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), -1).to(DEVICE)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    ref_q, ref_k = apply_rope_reference(q.clone(), k.clone(), cos, sin)
    out_q, out_k = apply_rope(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place, into the q/k/v buffer
    torch.testing.assert_close(out_q, ref_q, **_ROPE_TOL[dtype])
    torch.testing.assert_close(out_k, ref_k, **_ROPE_TOL[dtype])
    torch.testing.assert_close(qkv[:, (heads + kv_heads) * head_dim:], v_before, atol=0, rtol=0)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim,rotary", [(1, 9, 3, 64, 64), (6, 32, 8, 128, 128),
                                                                     (300, 4, 1, 256, 64), (3, 2, 1, 80, 20)])
def test_rope_kv_store(dtype, num_tokens, heads, kv_heads, head_dim, rotary):
    """RoPE and the K/V store in one launch == apply_rope then kv_store, bit for bit: q rotated in place, the
    rotated k and v at their slots (a partial RoPE's tail unrotated), k itself and every other slot untouched; and
    within tolerance of the torch reference. q, k and v are views into one q/k/v projection output."""
    from hyperdraft.kernels.kv_store import kv_store, rope_kv_store, rope_kv_store_reference

    qkv = _randn(num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=30)
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
    positions = torch.randint(0, 131072, (num_tokens,), generator=torch.Generator().manual_seed(31)).to(DEVICE)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rotary, 2).float() / rotary))
    cos, sin = rope_cos_sin_reference(positions, inv_freq.to(DEVICE), dtype)  # [T, 1, rotary]
    num_slots = 2 * num_tokens + 5
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(32))[:num_tokens].to(DEVICE)
    caches = [torch.full((num_slots, kv_heads, head_dim), 7.0, dtype=dtype, device=DEVICE) for _ in range(6)]
    k_before, qkv_before = k.clone(), qkv.clone()

    q_two, k_two = apply_rope(q.clone(), k.clone(), cos, sin)  # the two launches this one replaces
    kv_store(caches[0], caches[1], slots, k_two, v)
    out_q = rope_kv_store(caches[2], caches[3], slots, q, k, v, cos, sin)
    assert out_q.data_ptr() == q.data_ptr()
    assert torch.equal(q, q_two) and torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert torch.equal(k, k_before)  # only the pool holds the rotated k
    ref_q = rope_kv_store_reference(caches[4], caches[5], slots, qkv_before[:, : heads * head_dim].view_as(q),
                                    k_before, v, cos, sin)
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(caches[2], caches[4], **TOL[dtype])
    assert torch.equal(caches[3], caches[5])  # v is copied, not computed
    untouched = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert (caches[2][untouched] == 7.0).all() and (caches[3][untouched] == 7.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim,rotary", [(1, 16, 4, 256, 64), (7, 8, 2, 128, 32),
                                                                     (300, 4, 1, 256, 64), (3, 2, 1, 80, 20)])
def test_partial_rope(dtype, num_tokens, heads, kv_heads, head_dim, rotary):
    """A partial RoPE (Qwen3.5: the first quarter of each head) in place == the reference's slice, rotate and
    concatenate, as exactly as the full RoPE (_ROPE_TOL). q is the strided first half of
    each head's q|gate slice of a q projection output and k a column block beside v: nothing outside the first
    `rotary` dims of q's and k's heads may change (q's own tail, the gate, k's tail, v)."""
    qg = _randn(num_tokens, heads * 2 * head_dim, dtype=dtype, seed=20)
    q = qg.view(num_tokens, heads, 2 * head_dim)[..., :head_dim]
    kv = _randn(num_tokens, 2 * kv_heads * head_dim, dtype=dtype, seed=21)
    k = kv[:, : kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
    qg_before, kv_before = qg.clone(), kv.clone()
    positions = torch.randint(0, 131072, (num_tokens,), generator=torch.Generator().manual_seed(22)).to(DEVICE)
    inv_freq = 1.0 / (10000000.0 ** (torch.arange(0, rotary, 2).float() / rotary))
    cos, sin = rope_cos_sin_reference(positions, inv_freq.to(DEVICE), dtype)  # [T, 1, rotary]
    ref_q, ref_k = apply_rope_reference(q, k, cos, sin)
    out_q, out_k = apply_rope(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(out_q, ref_q, **_ROPE_TOL[dtype])
    torch.testing.assert_close(out_k, ref_k, **_ROPE_TOL[dtype])
    q_heads, q_heads_before = (t.view(num_tokens, heads, 2 * head_dim) for t in (qg, qg_before))
    assert torch.equal(q_heads[..., rotary:], q_heads_before[..., rotary:])  # q's tail and the gate
    k_heads, k_heads_before = (t.view(num_tokens, 2 * kv_heads, head_dim) for t in (kv, kv_before))
    assert torch.equal(k_heads[:, :kv_heads, rotary:], k_heads_before[:, :kv_heads, rotary:])
    assert torch.equal(k_heads[:, kv_heads:], k_heads_before[:, kv_heads:])  # v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,heads,head_dim", [(1, 16, 256), (7, 4, 128), (300, 3, 64), (5, 2, 80)])
@pytest.mark.parametrize("strided_x", [False, True])
def test_sigmoid_gate_mul(dtype, num_tokens, heads, head_dim, strided_x):
    """The gated attention's output gate == eager `x * sigmoid(gate)`, bit for bit on a GPU in every dtype (the
    sigmoid in fp32 with the math library's expf and an IEEE division, rounded, then the product rounded). The gate
    is the second half of each head's q|gate slice of a q projection output; x the attention output, or every other
    row of a wider one; saturating gates (+-100: exp overflows to inf) included."""
    qg = _randn(num_tokens, heads * 2 * head_dim, dtype=dtype, seed=23) * 4
    gate = qg.view(num_tokens, heads, 2 * head_dim)[..., head_dim:]
    gate[0, 0, :4] = torch.tensor([-100.0, -20.0, 20.0, 100.0])
    x = _randn(2 * num_tokens if strided_x else num_tokens, heads, head_dim, dtype=dtype, seed=24)
    x = x[::2] if strided_x else x
    _poison((num_tokens, heads * head_dim), dtype=dtype)
    out = sigmoid_gate_mul(x, gate)
    assert out.shape == (num_tokens, heads * head_dim) and out.is_contiguous()
    exact = TOL[dtype] if INTERPRET else dict(atol=0, rtol=0)  # the interpreter: numpy's exp
    torch.testing.assert_close(out, sigmoid_gate_mul_reference(x, gate), **exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,head_dim", [(1, 128), (6, 64), (300, 80), (2, 256)])
def test_rope_cos_sin(dtype, num_tokens, head_dim):
    """The table kernel == the torch table bit for bit (same fp32 angles, the math library's cos/sin, one rounding
    to dtype), at positions from 0 up to 131071, with Llama-3 scaled frequencies (half = 40: a ragged block)."""
    from hyperdraft.models.config import model_config_from_dict
    from hyperdraft.models.decoder import rope_inv_freq

    cfg = model_config_from_dict(dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=head_dim * 4,
                                      intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=head_dim, vocab_size=64, rope_theta=500000.0,
                                      rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                        high_freq_factor=4.0, original_max_position_embeddings=8192)))
    inv_freq = rope_inv_freq(cfg).to(DEVICE)
    positions = torch.randint(0, 131072, (num_tokens,), generator=torch.Generator().manual_seed(9))
    positions[0] = 0
    positions[-1] = 131071
    positions = positions.to(DEVICE)
    _poison((num_tokens, 1, head_dim), (num_tokens, 1, head_dim), dtype=dtype)
    cos, sin = rope_cos_sin(positions, inv_freq, dtype)
    ref_cos, ref_sin = rope_cos_sin_reference(positions, inv_freq, dtype)
    exact = TOL.get(dtype, TOL[torch.bfloat16]) if INTERPRET else dict(atol=0, rtol=0)  # numpy: not CUDA cos
    torch.testing.assert_close(cos, ref_cos, **exact)
    torch.testing.assert_close(sin, ref_sin, **exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,draft_vocab,vocab", [(1, 32000, 128256), (6, 100, 5000), (16, 777, 777)])
def test_spread_logits(dtype, rows, draft_vocab, vocab):
    """Draft-vocabulary logits spread over the target vocabulary == the torch index_put, bit for bit, for a
    scrambled (non-monotone) draft-to-target map; target ids outside it are -inf."""
    from hyperdraft.kernels.vocab_map import spread_logits, spread_logits_reference

    g = torch.Generator().manual_seed(10)
    draft_to_target = torch.randperm(vocab, generator=g)[:draft_vocab].to(DEVICE)
    target_to_draft = torch.full((vocab,), -1, dtype=torch.int32, device=DEVICE)
    target_to_draft[draft_to_target] = torch.arange(draft_vocab, dtype=torch.int32, device=DEVICE)
    logits = _randn(rows, draft_vocab, dtype=dtype, seed=11) * 5
    _poison((rows, vocab), dtype=torch.float32)
    out = spread_logits(logits, target_to_draft)
    torch.testing.assert_close(out, spread_logits_reference(logits, draft_to_target, vocab), atol=0, rtol=0)
    assert int(torch.isinf(out).sum()) == rows * (vocab - draft_vocab)


@pytest.mark.parametrize("rows,vocab,with_rows", [(1, 128256, False), (6, 128256, True), (9, 5000, False),
                                                  (3, 4096, True)])
def test_token_logprobs(rows, vocab, with_rows):
    """Chosen tokens' log-probabilities == log_softmax + gather in fp64, on logits with a -inf stretch covering a
    whole chunk and more (logit bias / masked vocabulary) and tokens at both ends of the vocabulary."""
    from hyperdraft.kernels.logprob import token_logprobs_kernel

    logits = _randn(rows, vocab, dtype=torch.float32, seed=12) * 4
    logits[0, 100: 100 + 5000] = float("-inf")
    g = torch.Generator().manual_seed(13)
    count = 2 * rows if with_rows else rows
    picked = torch.randint(0, rows, (count,), generator=g) if with_rows else torch.arange(rows)
    tokens = torch.randint(0, vocab, (count,), generator=g)
    tokens[0], tokens[-1] = vocab - 1, 0
    picked, tokens = picked.to(DEVICE), tokens.to(DEVICE)
    _poison((count,), dtype=torch.float32)
    out = token_logprobs_kernel(logits, tokens, picked if with_rows else None)
    ref = torch.log_softmax(logits.double(), -1)[picked, tokens].float()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def _causal(_layer, q, k, v, rope=None):
    """Causal attention over the forward's own tokens in plain matmuls (SDPA's fp32 kernels may round through TF32)."""
    q, k = rotated(q, k, rope)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / q.shape[-1] ** 0.5  # [H, T, T]
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(3072, 576), (40, 2048), (100, 80)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_norm_gemv(dtype, n, k, with_residual, with_bias):
    """RMSNorm(x + residual) @ W^T in one launch == rms_norm then gemv (their kernels): the running sum bit for bit,
    the product within the norm's reduction-order tolerance; k = 2048 takes two chunks of the sum of squares, and
    80 / 100 leave ragged tiles. Both within tolerance of the torch reference."""
    from hyperdraft.kernels.gemv import gemv
    from hyperdraft.kernels.norm_gemv import norm_gemv, norm_gemv_reference

    x = _randn(1, k, dtype=dtype, seed=40) * 3
    residual = _randn(1, k, dtype=dtype, seed=41) if with_residual else None
    gain = _randn(k, dtype=dtype, seed=42)
    weight = _randn(n, k, dtype=dtype, seed=43) / k ** 0.5
    bias = _randn(n, dtype=dtype, seed=44) if with_bias else None
    _poison((1, n), (1, k), dtype=dtype)
    out, running = norm_gemv(x, residual, gain, 1e-5, weight, bias)
    if not INTERPRET:  # gemv's loops over K run only compiled
        normed, two_running = rms_norm(x, gain, 1e-5, residual)
        two_out = gemv(normed, weight, bias)
        assert torch.equal(running, two_running)
        torch.testing.assert_close(out, two_out, **TOL[dtype])
    ref_out, ref_running = norm_gemv_reference(x, residual, gain, 1e-5, weight, bias)
    torch.testing.assert_close(running, ref_running, **EXACT[dtype])
    torch.testing.assert_close(out, ref_out, **TOL[dtype])


@pytest.mark.skipif(INTERPRET, reason="the models take the kernels only on CUDA tensors")
def test_norm_gemv_serves_narrow_rows_only():
    """The fusion serves one row of at most NORM_GEMV_MAX_K (a loss at the 8B shape's 4096: kernels/norm_gemv.py)."""
    from hyperdraft.kernels.norm_gemv import NORM_GEMV_MAX_K, norm_gemv_fits

    with activated(RuntimeOptions.from_env(fused_norm_gemv=True)):
        for k, fits in [(576, True), (NORM_GEMV_MAX_K, True), (NORM_GEMV_MAX_K + 64, False), (4096, False)]:
            x, weight = _randn(1, k, dtype=torch.bfloat16, seed=1), _randn(256, k, dtype=torch.bfloat16, seed=2)
            assert norm_gemv_fits(x, weight) == fits, k


@pytest.mark.skipif(INTERPRET, reason="the models take the kernels only on CUDA tensors")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_with_the_norm_in_the_gate_up_product(tmp_path, dtype, monkeypatch):
    """RuntimeOptions.fused_norm_gemv: a one-token forward (a batch-1 decode) whose input and post-attention norms
    run inside the q/k/v and gate/up GEMVs == the same forward with separate norm launches (final hidden and a
    captured layer input); a 5-token forward never takes it, nor does a forward with the switch off (launches
    counted)."""
    import hyperdraft.models.decoder as decoder_module
    from hyperdraft.models.loader import load_model
    from hyperdraft.testing.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path / "llama"), "llama", with_tokenizer=False)
    model = load_model(path, {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype], torch.device(DEVICE))
    launches = []
    real = decoder_module.norm_gemv
    monkeypatch.setattr(decoder_module, "norm_gemv", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    for tokens in (1, 5):
        ids = torch.randint(0, model.config.vocab_size, (tokens,), device=DEVICE)
        pos = torch.arange(tokens, device=DEVICE)
        with torch.inference_mode():
            with activated(RuntimeOptions.from_env(fused_norm_gemv=True)):
                fused, fused_captured = model(ids, pos, _causal, (1,))
            fused_launches = len(launches)
            with activated(RuntimeOptions.from_env(fused_norm_gemv=False)):  # on by default since it was measured
                ref, ref_captured = model(ids, pos, _causal, (1,))
        # as test_model_fused_equals_reference: a norm's last-bit difference grows through the layers
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(fused, ref, **tol)
        torch.testing.assert_close(fused_captured[0], ref_captured[0], **tol)
        assert fused_launches == (2 * model.config.num_layers if tokens == 1 else 0)  # both norms of every layer
        assert len(launches) == fused_launches
        launches.clear()


@pytest.mark.skipif(INTERPRET, reason="a whole model under the interpreter is too slow")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_fused_equals_reference(tmp_path, arch, monkeypatch):
    """A tiny fp32 model's logits and captured states with the fused kernels == with the torch references."""
    from hyperdraft.models.loader import load_model
    from hyperdraft.testing.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path / arch), arch, with_tokenizer=False)
    model = load_model(path, "float32", torch.device(DEVICE))
    ids = torch.randint(0, model.config.vocab_size, (37,), device=DEVICE)
    pos = torch.arange(37, device=DEVICE)
    layers = (1, model.config.num_layers)
    with torch.inference_mode():
        hidden, captured = model(ids, pos, _causal, layers)
        with activated(RuntimeOptions.from_env(fused_kernels=False)):
            ref_hidden, ref_captured = model(ids, pos, _causal, layers)
    # fp32 kernels differ from torch in the last bits (1/sqrt vs rsqrt, summation order, FMA contraction); two
    # layers of a random model with large weights amplify that to ~1e-5.
    torch.testing.assert_close(hidden, ref_hidden, atol=1e-4, rtol=1e-4)
    for got, want in zip(captured, ref_captured):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(INTERPRET, reason="the models take the kernels only on CUDA tensors")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 37])
def test_gated_attention_fused_equals_reference(tmp_path, dtype, num_tokens):
    """A Qwen3.5-shaped gated attention layer (16 heads of 256, 4 KV heads, RoPE on the first 64 dims, q/k/v one
    packed product) with the fused kernels == with the torch references: the zero-centered q/k norms, the partial
    RoPE in place and the output gate. fp32 differs in the norms' last bits. In bf16 those flip some normed q/k
    elements by one step, which the o projection sums over 4096 inputs: 2% of the largest output (~3 bf16 steps)."""
    from hyperdraft.models.hybrid import GatedAttention
    from hyperdraft.models.loader import load_model
    from hyperdraft.testing.tiny import make_tiny_model

    path = make_tiny_model(str(tmp_path / "qwen3_5"), "qwen3_5", with_tokenizer=False, head_dim=256,
                           num_attention_heads=16, num_key_value_heads=4)
    model = load_model(path, {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype], torch.device(DEVICE))
    layer = next(m for m in model.modules() if isinstance(m, GatedAttention))
    x = _randn(num_tokens, model.config.hidden_size, dtype=dtype, seed=25)
    with torch.inference_mode():
        cos, sin = model.rope(torch.arange(40, 40 + num_tokens, device=DEVICE), dtype)
        assert cos.shape[-1] == 64
        out = layer(x, cos, sin, _causal)
        with activated(RuntimeOptions.from_env(fused_kernels=False)):
            ref = layer(x, cos, sin, _causal)
    scale = float(ref.abs().max())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2 * scale, rtol=2.5e-2)
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("width", [1, 7, 1024, 128256])
def test_uniform_bit_identical(width):
    """The kernel's counter-based uniforms == sample.rng.uniform's, bit for bit (seeds past 2^32 included)."""
    from hyperdraft.kernels.uniform import uniform
    from hyperdraft.sample.rng import DOMAIN_ACCEPT, DOMAIN_SAMPLE, uniform_reference

    g = torch.Generator().manual_seed(9)
    seeds = torch.cat([torch.randint(0, 2**62, (5,), generator=g), torch.tensor([0, 1, 2**32 - 1, 2**32, 2**63 - 1])])
    positions = torch.randint(0, 2**20, (seeds.shape[0],), generator=g)
    seeds, positions = seeds.to(DEVICE), positions.to(DEVICE)
    for domain in (DOMAIN_SAMPLE, DOMAIN_ACCEPT):
        _poison((seeds.shape[0], width), dtype=torch.float32)
        got = uniform(seeds, positions, domain, width)
        assert torch.equal(got, uniform_reference(seeds, positions, domain, width))


@pytest.mark.parametrize("rows,width", [(1, 128256), (6, 32000), (7, 4096), (3, 5), (64, 151936)])
def test_argmax_matches_torch(rows, width):
    """First maximal index, as torch.argmax: random rows, rows with planted ties across and inside chunks, an
    all -inf row."""
    from hyperdraft.kernels.argmax import argmax_kernel

    x = _randn(rows, width, dtype=torch.float32, seed=10)
    top = x.max().item() + 1.0
    if rows >= 3 and width > 1:
        x[0, width - 1] = top  # the last column, in a partial chunk
        x[1, [width // 2, width - 1]] = top  # a tie across chunks: the smaller index wins
        x[2, :] = float("-inf")
    if rows >= 3 and width > 2:
        x[1, 1] = top  # ... and an earlier one in the first chunk
    torch.testing.assert_close(argmax_kernel(x), x.argmax(-1), atol=0, rtol=0)
    strided = _randn(rows, width + 3, dtype=torch.float32, seed=11)[:, :width]  # rows with a stride
    torch.testing.assert_close(argmax_kernel(strided), strided.argmax(-1), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,draft_vocab,vocab", [(1, 32000, 128256), (6, 32000, 128256), (5, 100, 5000),
                                                    (3, 777, 777)])
def test_draft_vocab_argmax_matches_spread_argmax(dtype, rows, draft_vocab, vocab):
    """VocabMap.argmax over draft logits == torch.argmax over the spread target row, for a scrambled (non-monotone)
    map, with ties planted across and inside chunks whose draft order disagrees with their target order; written
    into a strided destination (a token grid's column), poisoned first."""
    from hyperdraft.kernels.vocab_map import VocabMap, spread_logits_reference

    g = torch.Generator().manual_seed(12)
    draft_to_target = torch.randperm(vocab, generator=g)[:draft_vocab].to(DEVICE)
    target_to_draft = torch.full((vocab,), -1, dtype=torch.int32, device=DEVICE)
    target_to_draft[draft_to_target] = torch.arange(draft_vocab, dtype=torch.int32, device=DEVICE)
    vocab_map = VocabMap(draft_to_target, target_to_draft)
    logits = (_randn(rows, draft_vocab, dtype=torch.float32, seed=13) * 3).to(dtype)
    top = logits.float().max().item() + 1.0
    order = draft_to_target.argsort(descending=True)  # draft ids from the largest target id down
    if rows >= 2:
        logits[0, order[:2]] = top  # a tie: the later draft id has the smaller target id
        logits[1, order[[0, draft_vocab // 2, draft_vocab - 1]]] = top  # a tie across chunks
    grid = torch.full((rows, 4), -7, dtype=torch.int64, device=DEVICE)
    vocab_map.argmax(logits, grid[:, 2])
    want = spread_logits_reference(logits, draft_to_target, vocab).argmax(-1)
    assert torch.equal(grid[:, 2], want)
    assert bool((grid[:, [0, 1, 3]] == -7).all())  # nothing written outside the column
    assert torch.equal(vocab_map.argmax(logits), want)
