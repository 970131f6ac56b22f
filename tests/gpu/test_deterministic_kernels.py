"""Deterministic mode's kernels are batch-invariant: a row computed alone equals, bit for bit, the same row inside
batches of 2 to 64 rows, wherever it sits; attention gives a query the same bits in a decode, a chain verify, a
prefill chunk and a tree verify (through its branch's path). Run on a GPU machine:
`python3 -m pytest tests/gpu/test_deterministic_kernels.py -q`. Not part of CI. CUDA only: Triton's CPU
interpreter runs dots through numpy, whose BLAS sums a row differently by its position in the tile (measured: row 63
alone differs from row 63 of 64), so only the tensor cores' row independence can be tested.

Each product is also checked against its plain-torch reference (to rounding), so a kernel that is invariant but
wrong fails too.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from hyperdraft.kernels.attention import paged_attention, paged_attention_reference
from hyperdraft.kernels.attention_tiles import invariant_num_splits, invariant_tiles, tail_paths
from hyperdraft.kernels.gemv import invariant_linear

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA device (see the module doc)")
DTYPE = torch.bfloat16
REL_TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}
ROW_COUNTS = [1, 2, 3, 7, 16, 17, 33, 64]
# (N, K): SmolLM2's fused q|k|v; an 8B-like o_proj; a width whose column tiles make 1-2 waves (the swapped tiles)
SHAPES = [(960, 576), (1024, 2048), (6144, 512)]


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    err = (out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6)
    assert err < REL_TOL[out.dtype if out.dtype != torch.float32 else DTYPE], err


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("epilogue", ["plain", "bias_residual", "fp32_out"])
def test_invariant_linear_rows_alone_equal_rows_in_batches(n, k, epilogue):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(64, k, generator=g).to(DTYPE).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DTYPE).to(DEVICE)
    bias = torch.randn(n, generator=g).to(DTYPE).to(DEVICE) if epilogue == "bias_residual" else None
    res = torch.randn(64, n, generator=g).to(DTYPE).to(DEVICE) if epilogue == "bias_residual" else None
    out_dtype = torch.float32 if epilogue == "fp32_out" else None

    def run(rows: slice):
        return invariant_linear(x[rows], w, bias, None if res is None else res[rows], out_dtype)

    full = run(slice(0, 64))
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    _close(full, ref if res is None else ref + res.float())
    for m in ROW_COUNTS:
        assert torch.equal(run(slice(0, m)), full[:m]), f"the first {m} rows differ from the same rows among 64"
        start = 64 - m  # the same rows at other positions of their tiles
        assert torch.equal(run(slice(start, 64)), full[start:]), f"rows {start}.. differ"
    for i in (0, 5, 31, 63):
        assert torch.equal(run(slice(i, i + 1)), full[i:i + 1]), f"row {i} alone differs"


# ---- attention -------------------------------------------------------------------------------------------------
HKV, GROUP, HEAD_DIM, PAGE = 2, 3, 64, 4


def _pool(lengths: list[int], seed: int):
    """A paged pool holding one sequence per row, pages shuffled, unused slots NaN; returns (k, v, table)."""
    g = torch.Generator().manual_seed(seed)
    pages_per_row = max(-(-n // PAGE) for n in lengths) + 1
    num_pages = sum(-(-n // PAGE) for n in lengths) + 4
    perm = torch.randperm(num_pages, generator=g).tolist()
    table = torch.zeros(len(lengths), pages_per_row, dtype=torch.int64)
    for r, n in enumerate(lengths):
        table[r, : -(-n // PAGE)] = torch.tensor([perm.pop() for _ in range(-(-n // PAGE))])
    shape = (num_pages * PAGE, HKV, HEAD_DIM)
    k = torch.full(shape, float("nan"), dtype=DTYPE)
    v = torch.full(shape, float("nan"), dtype=DTYPE)
    return k, v, table, g


def _slots(table, row: int, n: int) -> torch.Tensor:
    idx = torch.arange(n)
    return table[row, idx // PAGE] * PAGE + idx % PAGE


def _attend(q, k, v, table, rows, seq_lens, ext_lens, tail_mask=None, deterministic_tree=False, bound=None):
    """Deterministic-mode attention; bound: the static key bound a CUDA graph would be captured with (it sets the
    number of parallel splits of a decode or verify; surplus ones find no keys)."""
    starts = torch.tensor([0] + ext_lens[:-1]).cumsum(0)
    args = [t.to(DEVICE) for t in (q, k, v, table)]
    meta = dict(req_rows=torch.tensor(rows, device=DEVICE), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                extend_starts=starts.to(torch.int32).to(DEVICE),
                extend_lens=torch.tensor(ext_lens, dtype=torch.int32, device=DEVICE))
    mask = None if tail_mask is None else tail_mask.to(DEVICE)
    splits = invariant_num_splits(max(ext_lens), bound or max(seq_lens))
    out = paged_attention(*args, **meta, page_size=PAGE, max_extend_len=max(ext_lens), tail_mask=mask,
                          tiles=invariant_tiles(GROUP, HEAD_DIM, DTYPE), num_splits=splits,
                          path=tail_paths(mask) if deterministic_tree else None, invariant=True)
    ref = paged_attention_reference(*args, **meta, page_size=PAGE, tail_mask=mask)
    _close(out, ref)
    return out.cpu()


def test_attention_decode_equals_chain_verify_prefill_and_batched():
    """One sequence of 300 keys (three fixed splits): query i decoded alone (seq_len i + 1) equals query i inside a
    6-query verify, a whole prefill (its splits walked by one program), under a larger graph bound, and in a batch
    beside other requests of other lengths."""
    length = 300
    k, v, table, g = _pool([length, 97, 211], seed=0)
    for r, n in enumerate([length, 97, 211]):
        s = _slots(table, r, n)
        k[s] = torch.randn(n, HKV, HEAD_DIM, generator=g).to(DTYPE)
        v[s] = torch.randn(n, HKV, HEAD_DIM, generator=g).to(DTYPE)
    q = torch.randn(length, HKV * GROUP, HEAD_DIM, generator=g).to(DTYPE)
    decoded = {i: _attend(q[i:i + 1], k, v, table, [0], [i + 1], [1]) for i in (0, 63, 64, 127, 128, 200, 299)}
    prefill = _attend(q, k, v, table, [0], [length], [length])
    chunked = _attend(q[100:], k, v, table, [0], [length], [length - 100])  # a later chunk over a cached prefix
    verify = _attend(q[294:300], k, v, table, [0], [length], [6])
    bounded = _attend(q[294:300], k, v, table, [0], [length], [6], bound=1024)
    other = torch.randn(5, HKV * GROUP, HEAD_DIM, generator=g).to(DTYPE)
    batched = _attend(torch.cat([other[:2], q[294:300], other[2:]]), k, v, table, [1, 0, 2], [97, length, 211], [2, 6, 3])
    for i, out in decoded.items():
        assert torch.equal(prefill[i], out[0]), f"query {i}: prefill differs from decode"
        if i >= 100:
            assert torch.equal(chunked[i - 100], out[0]), f"query {i}: a prefill chunk differs from decode"
    for j in range(6):
        assert torch.equal(verify[j], prefill[294 + j]), f"verify row {j} differs from prefill"
        assert torch.equal(bounded[j], verify[j]), f"verify row {j} differs under a larger graph bound"
        assert torch.equal(batched[2 + j], verify[j]), f"verify row {j} differs when batched"


def test_attention_tree_branch_equals_its_chain():
    """A 7-node tree over a 90-key prefix (root, two children, grandchildren): each node's output through its path
    equals the same query decoded over a sequence holding just its branch, contiguous."""
    prefix = 250  # the tree's keys straddle the split at 256
    parents = [-1, 0, 0, 1, 1, 2, 5]  # node -> parent (a node after its ancestors)
    branches = []
    for node in range(len(parents)):
        path, p = [], node
        while p >= 0:
            path.insert(0, p)
            p = parents[p]
        branches.append(path)
    w = len(parents)
    lengths = [prefix + w] + [prefix + len(b) for b in branches]
    k, v, table, g = _pool(lengths, seed=1)
    ctx_k = torch.randn(prefix, HKV, HEAD_DIM, generator=g).to(DTYPE)
    ctx_v = torch.randn(prefix, HKV, HEAD_DIM, generator=g).to(DTYPE)
    node_k = torch.randn(w, HKV, HEAD_DIM, generator=g).to(DTYPE)
    node_v = torch.randn(w, HKV, HEAD_DIM, generator=g).to(DTYPE)
    q = torch.randn(w, HKV * GROUP, HEAD_DIM, generator=g).to(DTYPE)
    s = _slots(table, 0, prefix + w)
    k[s], v[s] = torch.cat([ctx_k, node_k]), torch.cat([ctx_v, node_v])
    mask = torch.zeros(1, w, w, dtype=torch.bool)
    for node, branch in enumerate(branches):
        mask[0, node, branch] = True
        s = _slots(table, 1 + node, prefix + len(branch))
        k[s], v[s] = torch.cat([ctx_k, node_k[branch]]), torch.cat([ctx_v, node_v[branch]])
    tree = _attend(q, k, v, table, [0], [prefix + w], [w], tail_mask=mask, deterministic_tree=True)
    for node, branch in enumerate(branches):
        chain = _attend(q[node:node + 1], k, v, table, [1 + node], [prefix + len(branch)], [1])
        assert torch.equal(tree[node], chain[0]), f"tree node {node} differs from its branch decoded as a chain"


# ---- the per-row kernels ------------------------------------------------------------------------------------------
def _rows_alone_equal_rows_in_batches(fn, *tensors):
    """fn over all 64 rows, over the first m and the last m (m = 2..64, so rows move within their tiles), and
    over single rows: each row's result the same bits. fn takes row-sliced tensors and returns a tensor or a tuple."""
    def as_tuple(out):
        return out if isinstance(out, tuple) else (out,)

    full = as_tuple(fn(*tensors))
    for rows in [slice(0, m) for m in ROW_COUNTS[1:]] + [slice(64 - m, 64) for m in ROW_COUNTS[1:]] + \
            [slice(i, i + 1) for i in (0, 17, 63)]:
        part = as_tuple(fn(*(t[rows] for t in tensors)))
        for p, f in zip(part, full):
            assert torch.equal(p, f[rows]), f"rows {rows} differ from the same rows among 64"


def test_norm_rope_activation_logprob_argmax_are_row_invariant():
    from hyperdraft.kernels.activation import silu_mul
    from hyperdraft.kernels.argmax import argmax_kernel
    from hyperdraft.kernels.logprob import token_logprobs_kernel
    from hyperdraft.kernels.norm import rms_norm
    from hyperdraft.kernels.rope import apply_rope, rope_cos_sin

    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 576, generator=g).to(DTYPE).to(DEVICE)
    res = torch.randn(64, 576, generator=g).to(DTYPE).to(DEVICE)
    w = torch.randn(576, generator=g).to(DTYPE).to(DEVICE)
    _rows_alone_equal_rows_in_batches(lambda a, r: rms_norm(a, w, 1e-5, r), x, res)
    _rows_alone_equal_rows_in_batches(lambda a: rms_norm(a, w, 1e-5)[0], x)
    _rows_alone_equal_rows_in_batches(silu_mul, x, res)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)).to(DEVICE)
    positions = torch.randint(0, 4000, (64,), generator=g).to(DEVICE)
    q = torch.randn(64, 9, 64, generator=g).to(DTYPE).to(DEVICE)
    k = torch.randn(64, 3, 64, generator=g).to(DTYPE).to(DEVICE)
    _rows_alone_equal_rows_in_batches(lambda p: rope_cos_sin(p, inv_freq, DTYPE), positions)
    cos, sin = rope_cos_sin(positions, inv_freq, DTYPE)
    _rows_alone_equal_rows_in_batches(lambda a, b, c, s: apply_rope(a.clone(), b.clone(), c, s), q, k, cos, sin)
    logits = torch.randn(64, 49152, generator=g).to(DEVICE) * 4
    tokens = torch.randint(0, 49152, (64,), generator=g).to(DEVICE)
    _rows_alone_equal_rows_in_batches(token_logprobs_kernel, logits, tokens)
    _rows_alone_equal_rows_in_batches(argmax_kernel, logits)


# ---- the Gated DeltaNet walk (hybrid models) ----------------------------------------------------------------------
HK, HV, DK, DV, CONV_K, SLOTS, WIDTH = 2, 4, 128, 128, 4, 8, 6


def _gdn_inputs(tokens: int, seed: int):
    from hyperdraft.kernels.gated_delta import GdnGates

    g = torch.Generator().manual_seed(seed)
    channels = 2 * HK * DK + HV * DV

    def rand(*shape, scale=1.0, dt=DTYPE):
        return (torch.randn(*shape, generator=g) * scale).to(dt).to(DEVICE)

    mixed, ab = rand(tokens, channels), rand(tokens, 2 * HV, scale=3.0)
    weight, a_log, dt_bias = rand(channels, CONV_K, scale=0.5), rand(HV, scale=0.5), rand(HV)
    pools = [rand(SLOTS, channels, CONV_K - 1), rand(SLOTS, WIDTH, channels, CONV_K - 1),
             rand(SLOTS, HV, DK, DV, scale=0.3, dt=torch.float32),
             rand(SLOTS, WIDTH, HV, DK, DV, scale=0.3, dt=torch.float32)]
    return mixed, ab, weight, a_log, dt_bias, pools, lambda rows: GdnGates(ab[rows, :HV], ab[rows, HV:], a_log, dt_bias)


def _walk_requests(requests, mixed, weight, gates_of, pools):
    """requests: (slot, fresh, parents, targets, token rows) -> (output [T, HV, DV], pools after the walk)."""
    from hyperdraft.kernels.gated_delta_walk import Walk, conv_walk, delta_walk

    rows = torch.tensor([t for r in requests for t in r[4]])
    lens = [len(r[2]) for r in requests]
    i32 = dict(dtype=torch.int32, device=DEVICE)
    walk = Walk(len(requests), torch.tensor([sum(lens[:i]) for i in range(len(lens))], **i32),
                torch.tensor(lens, **i32), torch.tensor([r[0] for r in requests], device=DEVICE),
                torch.tensor([r[1] for r in requests], **i32), torch.tensor([p for r in requests for p in r[2]], **i32),
                torch.tensor([t for r in requests for t in r[3]], **i32))
    mine = [p.clone() for p in pools]
    qkv = conv_walk(mixed[rows].contiguous(), weight, mine[0], mine[1], walk)
    return delta_walk(qkv, gates_of(rows.to(DEVICE)), mine[2], mine[3], walk, HK * DK, DTYPE), mine


def test_gdn_walk_requests_alone_equal_requests_in_a_packed_batch():
    """Each request of a packed batch (chain verify, tree verify, fresh prefill, continued chunk, decode) walked
    alone gives the same bits: its outputs and its slot's states and scratch."""
    specs = [(4, 0, [-1, 0, 1, 2], [0, 1, 2, 3]), (5, 0, [-1, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]),
             (1, 1, [-1] + [-2] * 8, [-1] * 9), (2, 0, [-1, -2, -2], [-1] * 3), (3, 0, [-1], [-1])]
    requests, start = [], 0
    for slot, fresh, parents, targets in specs:
        requests.append((slot, fresh, parents, targets, list(range(start, start + len(parents)))))
        start += len(parents)
    mixed, _, weight, _, _, pools, gates_of = _gdn_inputs(start, seed=3)
    packed_out, packed_pools = _walk_requests(requests, mixed, weight, gates_of, pools)
    for req in requests:
        out, alone = _walk_requests([req], mixed, weight, gates_of, pools)
        assert torch.equal(out, packed_out[req[4]]), f"slot {req[0]}: outputs differ alone"
        for name, a, b in zip(("conv", "conv_scratch", "recurrent", "recurrent_scratch"), alone, packed_pools):
            assert torch.equal(a[req[0]], b[req[0]]), f"slot {req[0]}: {name} differs alone"


def test_gdn_walk_prefill_equals_chunks_and_decodes():
    """Twelve tokens into slot 1: one fresh prefill, a 5-token chunk then a 7-token one, and twelve decodes give the
    same outputs and the same committed state, bit for bit."""
    mixed, _, weight, _, _, pools, gates_of = _gdn_inputs(12, seed=4)
    whole, whole_pools = _walk_requests([(1, 1, [-1] + [-2] * 11, [-1] * 12, list(range(12)))], mixed, weight,
                                        gates_of, pools)
    first, mid = _walk_requests([(1, 1, [-1] + [-2] * 4, [-1] * 5, list(range(5)))], mixed, weight, gates_of, pools)
    second, chunked = _walk_requests([(1, 0, [-1] + [-2] * 6, [-1] * 7, list(range(5, 12)))], mixed, weight, gates_of,
                                     mid)
    assert torch.equal(torch.cat([first, second]), whole), "chunked prefill differs from one chunk"
    state, decoded = pools, []
    for t in range(12):
        out, state = _walk_requests([(1, int(t == 0), [-1], [-1], [t])], mixed, weight, gates_of, state)
        decoded.append(out)
    assert torch.equal(torch.cat(decoded), whole), "decodes differ from the prefill"
    for a, b, c in zip(whole_pools, chunked, state):
        assert torch.equal(a[1], b[1]) and torch.equal(a[1], c[1]), "the committed state differs"
