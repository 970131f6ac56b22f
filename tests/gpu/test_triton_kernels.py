"""Each Triton kernel against its plain-torch reference, on fresh random inputs; then the triton backend against
the torch backend end to end. Run on a GPU machine: `python3 -m pytest tests/gpu/test_triton_kernels.py -q`.
Not part of CI. (With TRITON_INTERPRET=1 and triton installed, the fp32 kernel tests also run on the CPU, slowly:
`-k "fp32 and not end_to_end"` passed 34 of 37 in 13 minutes, the other three, ratio-8 extends, running past the
120 s test limit. tests/gpu/conftest.py lets Triton 3.6's interpreter take the attention kernel's runtime loop bounds.
Its bf16 arithmetic differs from the GPU's, so the bf16 cases fail there.)

Outputs (and split workspaces) are poisoned with NaN first, so an unwritten element fails; pool pages no request
owns hold NaN too, so a read outside a request's keys fails. Every batch carries CUDA-graph padding entries
(seq_len 0 or 1 on a dummy row whose pages are all the padding page 0, and an entry with no tokens).
"""

from __future__ import annotations

import os

import pytest
import torch

from hyperdraft.kernels.attention import paged_attention, paged_attention_reference
from hyperdraft.kernels.attention_tiles import attention_workspace, num_kv_splits, num_row_tiles, tile_config

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs a CUDA device")
HKV = 2
LONG = 8200 if not INTERPRET else 700  # > 8192: many key splits
DTYPES = [torch.float32, torch.bfloat16]
# Every kernel variant is a separate compile (~1 s): decode crosses everything, the others pair head_dim with dtype.
HEAD_DTYPE_PAIRS = [(64, torch.float32), (128, torch.bfloat16)]
REL_TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}  # |out - ref| / |ref|: fp32 math vs bf16 operands


def _num_sms() -> int:
    return 132 if INTERPRET else torch.cuda.get_device_properties(0).multi_processor_count


def _batch(page_size, ratio, head_dim, dtype, specs, seed):
    """specs: (prefix, extend) per real request. Appends padding entries. Returns the kernel's arguments."""
    g = torch.Generator().manual_seed(seed)
    lens = [p + e for p, e in specs]
    pages_per_row = max(-(-n // page_size) for n in lens) + 1
    num_pages = sum(-(-n // page_size) for n in lens) + 8
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # page 0 is the padding page
    table = torch.zeros(len(specs) + 1, pages_per_row, dtype=torch.int64)
    for b, n in enumerate(lens):
        need = -(-n // page_size)
        table[b, :need] = torch.tensor([perm.pop() for _ in range(need)])
    dummy = len(specs)  # its row stays all zeros: every index maps into page 0
    shape = (num_pages * page_size, HKV, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for b, n in enumerate(lens):
        idx = torch.arange(n)
        slots = table[b, idx // page_size] * page_size + idx % page_size
        k_cache[slots] = torch.randn(n, HKV, head_dim, generator=g).to(dtype)
        v_cache[slots] = torch.randn(n, HKV, head_dim, generator=g).to(dtype)
    k_cache[:page_size] = torch.randn(page_size, HKV, head_dim, generator=g).to(dtype)  # padding tokens wrote here
    v_cache[:page_size] = torch.randn(page_size, HKV, head_dim, generator=g).to(dtype)
    rows = list(range(len(specs))) + [dummy, dummy, dummy]
    seq = lens + [0, 1, 0]
    ext = [e for _, e in specs] + [1, 1, 0]
    starts = torch.tensor([0] + ext[:-1]).cumsum(0).tolist()
    q = torch.randn(sum(ext), HKV * ratio, head_dim, generator=g).to(dtype)
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    i32 = lambda xs: dev(torch.tensor(xs, dtype=torch.int32))  # noqa: E731
    return dict(q=dev(q), k_cache=dev(k_cache), v_cache=dev(v_cache), page_table=dev(table),
                req_rows=dev(torch.tensor(rows)), seq_lens=i32(seq), extend_starts=i32(starts), extend_lens=i32(ext),
                page_size=page_size, max_extend_len=max(ext))


def _tree_masks(specs, width_extra, seed):
    """Per request a random tree over its extend nodes (parent before child): row i sees its ancestors and itself.
    The tail is width_extra earlier nodes (visible to all, like a drafting step's root and earlier frontier) + nodes."""
    g = torch.Generator().manual_seed(seed)
    q = max(e for _, e in specs)
    w = q + width_extra
    mask = torch.zeros(len(specs) + 3, q, w, dtype=torch.bool)
    for b, (_, ext) in enumerate(specs):
        anc = torch.zeros(ext, ext, dtype=torch.bool)
        for i in range(ext):
            parent = int(torch.randint(0, i, (1,), generator=g)) if i > 0 and torch.rand(1, generator=g) < 0.8 else -1
            if parent >= 0:
                anc[i] = anc[parent]
            anc[i, i] = True
        mask[b, :ext, : w - ext] = True
        mask[b, :ext, w - ext :] = anc
    mask[len(specs):, :1, -1] = True  # padding entries: themselves
    return mask.to(DEVICE)


def _check(args, num_splits, tail_mask=None):
    q = args["q"]
    out = torch.full_like(q, float("nan"))
    workspace = attention_workspace(q.shape[0], q.shape[1], q.shape[2], num_splits, q.device)
    if workspace is not None:
        for t in workspace:
            t.fill_(float("nan"))
    paged_attention(**args, tail_mask=tail_mask, num_splits=num_splits, out=out, workspace=workspace)
    ref = paged_attention_reference(**args, tail_mask=tail_mask).float()
    assert torch.isfinite(out).all(), "unwritten or NaN output rows"
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < REL_TOL[q.dtype], err
    return out


def _auto_splits(args):
    q = args["q"]
    group = q.shape[1] // HKV
    tiles = num_row_tiles(group, args["max_extend_len"], tile_config(group, args["max_extend_len"], q.shape[2], q.dtype).m)
    return num_kv_splits(args["req_rows"].shape[0], HKV, tiles, int(args["seq_lens"].max()), _num_sms())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_decode(page_size, ratio, head_dim, dtype):
    args = _batch(page_size, ratio, head_dim, dtype, [(0, 1), (6, 1), (299, 1), (LONG - 1, 1)], seed=page_size + ratio)
    splits = _auto_splits(args)
    assert splits > 1  # the long request is cut into key splits (one split: the extend tests)
    _check(args, splits)


@pytest.mark.parametrize("head_dim,dtype", HEAD_DTYPE_PAIRS, ids=["64-fp32", "128-bf16"])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_extend_over_cached_prefix(page_size, ratio, head_dim, dtype):
    # fresh prefill, chunk over a prefix, a decode riding along, a long chunk over a long prefix
    specs = [(0, 7), (293, 7), (5, 1), (0, 300), (40, 300)]
    args = _batch(page_size, ratio, head_dim, dtype, specs, seed=7 * page_size + ratio)
    _check(args, _auto_splits(args))
    _check(args, 3)  # key splits under causal row tiles


@pytest.mark.parametrize("head_dim,dtype", HEAD_DTYPE_PAIRS, ids=["64-fp32", "128-bf16"])
@pytest.mark.parametrize("ratio", [1, 8])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_tree_and_chain_verify(page_size, ratio, head_dim, dtype):
    specs = [(1, 8), (7, 8), (300, 8), (LONG, 8), (20, 5)]
    args = _batch(page_size, ratio, head_dim, dtype, specs, seed=3 * page_size + ratio)
    splits = _auto_splits(args)
    assert splits > 1
    tree = _check(args, splits, tail_mask=_tree_masks(specs, 0, seed=ratio))
    chain = _check(args, splits)  # chains: plain causal
    assert not torch.allclose(tree.float(), chain.float(), atol=1e-2)  # the masks mattered
    _check(args, 1, tail_mask=_tree_masks(specs, 0, seed=ratio))
    # A drafting step: the tail also covers earlier nodes (root + previous frontier), W > extend.
    _check(args, splits, tail_mask=_tree_masks(specs, 5, seed=ratio + 1))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,head_dim", [(1, 64), (8, 128), (2, 16)])
def test_kv_store(heads, head_dim, dtype):
    from hyperdraft.kernels.kv_store import kv_store, kv_store_reference

    g = torch.Generator().manual_seed(heads)
    cache = [torch.randn(200, heads, head_dim, generator=g).to(dtype).to(DEVICE) for _ in range(2)]
    slots = torch.cat([torch.randperm(199, generator=g)[:37] + 1, torch.zeros(3, dtype=torch.int64)]).to(DEVICE)
    k = torch.randn(40, heads, head_dim, generator=g).to(DEVICE)  # fp32 activations: the store casts
    v = torch.randn(40, heads, 2 * head_dim, generator=g).to(DEVICE)[:, :, :head_dim]  # strided
    ref = [c.clone() for c in cache]
    kv_store(*cache, slots, k, v)
    kv_store_reference(*ref, slots, k, v)
    # Slot 0 takes three padding tokens: which one lands is unspecified in both, so it is left out.
    assert torch.equal(cache[0][1:], ref[0][1:]) and torch.equal(cache[1][1:], ref[1][1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_kv_move_with_overlapping_slots(dtype):
    from hyperdraft.kernels.kv_move import kv_move, kv_move_reference

    g = torch.Generator().manual_seed(5)
    pools = [torch.randn(3, 300, 2, 64, generator=g).to(dtype).to(DEVICE) for _ in range(2)]
    # Two requests' accepted paths compacted (sources overlap destinations), plus identity entries.
    dst = torch.tensor([100, 101, 102, 103, 200, 201, 202, 150])
    src = torch.tensor([100, 102, 105, 107, 203, 204, 209, 150])
    ref = [p.clone() for p in pools]
    kv_move(*pools, dst.to(DEVICE), src.to(DEVICE))
    kv_move_reference(*ref, dst.to(DEVICE), src.to(DEVICE))
    assert torch.equal(pools[0], ref[0]) and torch.equal(pools[1], ref[1])


# ---- end to end: the triton backend gives the torch backend's greedy tokens --------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hyperdraft.testing.tiny import make_tiny_model

    from helpers.hybrid_fixtures import with_mtp_weights

    root = tmp_path_factory.mktemp("triton_models")
    models = {kind: make_tiny_model(str(root / kind), kind, seed=1) for kind in ("llama", "qwen3", "qwen3_next")}
    models["qwen3_5"] = with_mtp_weights(make_tiny_model(str(root / "qwen3_5"), "qwen3_5", seed=1),
                                         str(root / "qwen3_5_mtp"))
    return models


E2E_CASES = {
    "plain": dict(page_size=16),
    "plain-qwen3": dict(page_size=64, target="qwen3"),  # GQA 4:1, head_dim 32, q/k norm
    "ngram": dict(page_size=1, speculative_algorithm="NGRAM", speculative_num_steps=4),
    "standalone-tree": dict(page_size=4, speculative_algorithm="STANDALONE", speculative_draft_model="llama",
                            speculative_num_steps=4, speculative_eagle_topk=2, speculative_num_draft_tokens=6),
}


@pytest.mark.skipif(INTERPRET, reason="end to end runs on CUDA only")
@pytest.mark.parametrize("case", list(E2E_CASES))
def test_triton_backend_matches_torch_backend_end_to_end(tiny, case):
    from hyperdraft import LLM, SamplingParams
    from hyperdraft.attention.triton_backend import TritonAttentionBackend

    opts = {k: (tiny[v] if k == "speculative_draft_model" else v) for k, v in E2E_CASES[case].items()}
    target = tiny[opts.pop("target", "llama")]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 7, 33, 100, 200, 5, 64, 150)]
    prompts += [p[: len(p) // 2] * 2 for p in prompts[2:5]]  # repeats, so NGRAM finds matches
    sp = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    outs = {}
    for backend in ("torch", None):  # None: the CUDA default, triton
        llm = LLM(target, device="cuda", dtype="float32", max_total_tokens=1 << 15, attention_backend=backend,
                  chunked_prefill_size=64, **opts)
        if backend is None:
            assert isinstance(llm.engine.runner.backend, TritonAttentionBackend)
        outs[backend] = [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=sp, use_tqdm=False)]
        assert llm.engine.flush_cache(), "prefix cache not flushable"  # cached pages are not leaked ones
        assert llm.engine.kv_free_slots == llm.engine.kv_capacity_slots
        llm.shutdown()
    assert outs[None] == outs["torch"]


def _new_tokens(args, rotary: int | None, seed: int):
    """A forward's new k/v (request b's extend_lens[b] tokens at its last positions), the slots its page-table row
    gives those positions (padding entries of no keys: the padding page's slot 0), and their RoPE table."""
    from hyperdraft.kernels.kv_store import NewTokens
    from hyperdraft.kernels.rope import rope_cos_sin_reference

    g = torch.Generator().manual_seed(seed)
    q, table, page_size = args["q"], args["page_table"].cpu(), args["page_size"]
    seqs, exts, rows = (args[k].cpu().tolist() for k in ("seq_lens", "extend_lens", "req_rows"))
    positions = torch.tensor([max(p, 0) for s, e in zip(seqs, exts) for p in range(s - e, s)])
    token_rows = torch.tensor([r for r, e in zip(rows, exts) for _ in range(e)])
    slots = table[token_rows, positions // page_size] * page_size + positions % page_size
    k, v = (torch.randn(q.shape[0], HKV, q.shape[2], generator=g).to(q.dtype).to(DEVICE) for _ in range(2))
    rope = None
    if rotary is not None:
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2).float() / rotary))
        rope = rope_cos_sin_reference(positions.to(DEVICE), inv_freq.to(DEVICE), q.dtype)
    return NewTokens(k, v, slots.to(DEVICE), rope)


STORE_CASES = [(kind, page_size, splits, rotary) for kind, page_sizes, rotaries in
               [("decode", (1, 16), (None, 64, 16)), ("chain", (16,), (64,)), ("tree", (16,), (64,))]
               for page_size in page_sizes for splits in ("auto", "one", "invariant", "invariant-inline")
               for rotary in rotaries]
STORE_SPECS = {"decode": [(0, 1), (6, 1), (299, 1), (LONG - 1, 1)],
               "chain": [(0, 3), (6, 5), (299, 2), (LONG - 5, 5)], "tree": [(1, 4), (6, 5), (299, 2), (LONG - 5, 5)]}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,page_size,splits,rotary", STORE_CASES, ids=lambda c: str(c))
def test_attention_storing_its_new_tokens(kind, page_size, splits, rotary, dtype):
    """An attention launch that stores the new tokens itself (NewTokens) gives the bits of rope_kv_store (or
    kv_store) and then paged_attention: the same output and the same pool (the padding page aside: padding entries of
    no keys store nothing there), for decodes, chain verifies and tree verifies (tail masks), whatever the split
    layout, deterministic mode's included. Every new key is read by some program, so every one lands."""
    from hyperdraft.kernels.attention_tiles import invariant_num_splits, invariant_tiles
    from hyperdraft.kernels.kv_store import kv_store, rope_kv_store

    specs = STORE_SPECS[kind]
    args = _batch(page_size, 4, 64, dtype, specs, seed=40 + page_size)
    new = _new_tokens(args, rotary, seed=41)
    if kind == "tree":
        args["tail_mask"] = _tree_masks(specs, width_extra=2, seed=42)
    q = args.pop("q")
    mode = dict(num_splits=_auto_splits({**args, "q": q}) if splits == "auto" else 1)
    if splits.startswith("invariant"):
        max_seq = int(args["seq_lens"].max())
        mode = dict(invariant=True, tiles=invariant_tiles(4, 64, dtype),
                    num_splits=invariant_num_splits(args["max_extend_len"], max_seq) if splits == "invariant" else 1)
    rest = {k: a for k, a in args.items() if k not in ("k_cache", "v_cache")}
    pools = [(args["k_cache"].clone(), args["v_cache"].clone()) for _ in range(2)]
    two_q = q.clone()
    if rotary is None:
        kv_store(*pools[0], new.slots, new.k, new.v)
    else:
        rope_kv_store(*pools[0], new.slots, two_q, new.k, new.v, *new.rope)
    two = paged_attention(two_q, *pools[0], **rest, **mode)
    one_q = q.clone()
    one = paged_attention(one_q, *pools[1], **rest, **mode, new_tokens=new)
    assert torch.equal(one_q, q)  # q is rotated on its way in, not in place
    # Real requests' rows only: the padding entries' two new keys both map to the padding page's slot 0, where the
    # separate store's two programs race (on a GPU either key may land last), while here only the entry that reads
    # a key stores it; a padding row's output is thrown away anyway.
    tokens = slice(0, sum(e for _, e in specs))
    assert torch.isfinite(one).all() and torch.equal(one[tokens], two[tokens])
    real = slice(page_size, None)  # past the padding page; unused slots hold NaN
    for got, want in zip(pools[1], pools[0]):
        torch.testing.assert_close(got[real], want[real], atol=0, rtol=0, equal_nan=True)
    news = new.slots[new.slots >= page_size]
    assert torch.equal(pools[1][0][news], pools[0][0][news]) and not torch.equal(pools[1][0][news],
                                                                                 args["k_cache"][news])


KV_IN_ATTENTION_CASES = {
    **E2E_CASES,
    # hybrids: full-attention layers between linear ones; MTP chains and trees; a sparse MoE model
    "hybrid-qwen3.5-mtp-tree": dict(page_size=16, target="qwen3_5", speculative_algorithm="NEXTN",
                                    speculative_num_steps=3, speculative_eagle_topk=2,
                                    speculative_num_draft_tokens=5),
    "hybrid-qwen3-next-moe": dict(page_size=16, target="qwen3_next"),
}


@pytest.mark.skipif(INTERPRET, reason="end to end runs on CUDA only")
@pytest.mark.parametrize("case", list(KV_IN_ATTENTION_CASES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_in_attention_end_to_end(tiny, case, dtype):
    """RuntimeOptions.kv_in_attention (decodes, verifies and draft steps store their K/V inside the attention
    launch, CUDA graphs included; the default) gives the separate store launch's tokens, bit for bit in bf16 too,
    and every slot back free."""
    from hyperdraft import LLM, SamplingParams
    from hyperdraft.options import RuntimeOptions

    opts = {k: (tiny[v] if k == "speculative_draft_model" else v) for k, v in KV_IN_ATTENTION_CASES[case].items()}
    target = tiny[opts.pop("target", "llama")]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 9, 40, 130, 6, 77)]
    sp = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)
    outs = []
    for on in (False, True):
        llm = LLM(target, device="cuda", dtype=dtype, max_total_tokens=1 << 14, chunked_prefill_size=64,
                  runtime_options=RuntimeOptions.from_env(kv_in_attention=on), **opts)
        outs.append([o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=sp, use_tqdm=False)])
        assert llm.engine.flush_cache() and llm.engine.kv_free_slots == llm.engine.kv_capacity_slots
        llm.shutdown()
    assert outs[0] == outs[1]
