"""Paged attention for every forward mode, as one Triton kernel plus a split merge, beside its torch reference.

Decode, extend over a cached prefix, and tree-masked target verify are the same computation: request b's
extend_lens[b] new queries (packed from row extend_starts[b]) attend over its seq_lens[b] keys, read from the
paged pool through its page-table row. New keys are already in the pool (the backend stores them first).
Query i sits at sequence index prefix + i (prefix = seq_len - ext) and sees keys <= prefix + i, or, with a tail
mask [B, Q, W], every key before the last W and those of the last W its row allows (query rows >= Q see none of
them). So one kernel serves all modes; what differs is only the tiling:

- a program owns one (request, kv head, row tile, key split). Its rows are (query, q head) pairs of that kv
  head's GQA group, so every key block read from the pool serves all the group's heads (decode: 1 query x G
  heads, padded to the 16 rows a tensor-core dot needs);
- split-K (flash-decoding): when request x kv head x row tile leaves the GPU idle (decode, small verifies),
  the keys are cut into num_splits ranges; each program writes its normalised partial output and log-sum-exp,
  and a second kernel merges them. The split count is a launch constant derived from the static bounds only,
  so a captured CUDA graph stays valid for every seq_len under its bound (surplus splits find no keys).

Rows with no visible key (graph-padding entries with seq_len 0) get zeros, never NaN. Every row of every
request is written, so an output poisoned with NaN comes back clean.

Batch invariance (deterministic mode, attention_tiles.invariant_tiles): a row's output is the same bits whatever else
is launched with it when the tiles do not depend on the batch (one row-tile height and key block per model), the keys
are cut into splits at fixed positions (every INVARIANT_SPLIT_KEYS from key 0) merged in split order, and every row
walks a split's keys in blocks fixed in absolute key positions. Keys a row cannot see, and splits past its keys, add
exact zeros, so sharing a tile with later queries or a graph's longer bound changes nothing. A decode or verify runs
the splits as parallel programs (then _attn_merge IN_ORDER); a prefill walks them in one program (INLINE) with the
same merge arithmetic (_merge_weights). A tree's tail breaks the last condition: a node's
ancestors sit at scattered tail offsets, interleaved with masked siblings, so a block would hold its keys at other
lanes than the same tokens' keys in a chain. With `path` ([B, Q, W]: each query's visible tail offsets, ascending) a
program serves one query and reads the key at sequence index prefix + j from tail offset path[j]: the keys land
where a plain decode of that branch has them, so the sums run in the same order.
"""

from __future__ import annotations

import math

import torch

from hyperdraft.kernels._triton import jit, tl
from hyperdraft.kernels.attention_tiles import (INVARIANT_SPLIT_KEYS, MAX_SPLITS, Tiles, attention_workspace,
                                                next_pow2, num_row_tiles, tile_config)
from hyperdraft.kernels.kv_store import NewTokens, NewTokenArgs, store_head_kv
from hyperdraft.kernels.pdl import pdl_args, pdl_wait
from hyperdraft.kernels.rope import rotated_dims

# A tree mask's shape arguments ([B, Q, W] bool): they follow the verify width, and Triton would compile the kernel
# again when one of them first lands on a multiple of 16 (measured: a tree's first timed run compiled _attn_stage1
# for stride_tb, benchmarks/results/first_use_compiles_h100.md).
TAIL_SHAPE = ("stride_tb", "stride_tq", "tail_q", "tail_w")


@jit
def _attend_keys(
    acc, l_i, m_i, q, K, V, Table, Tail, PathRow, row, kvh, b, lo, hi, qi, prefix, row_ok, d, d_ok, seq_len,
    stride_ks, stride_kh, stride_vs, stride_vh, stride_row, stride_tb, stride_tq, stride_tw, tail_q, tail_w, scale_log2,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_TAIL: tl.constexpr, IEEE: tl.constexpr,
    PATH: tl.constexpr,
):
    """Online softmax over keys [lo, hi) of one page-table row. MASKED applies the causal or tail mask per element;
    otherwise only the range end is masked. PATH: key index n >= seq_len - tail_w is read from the tail offset
    PathRow[n - (seq_len - tail_w)] (one query's branch, see the module doc)."""
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        if PATH:
            j = n - (seq_len - tail_w)
            step = tl.load(PathRow + j, mask=n_ok & (j >= 0), other=0)
            src = tl.where(j >= 0, seq_len - tail_w + step, n)
        else:
            src = n
        page = tl.load(Table + row * stride_row + src // PAGE_SIZE, mask=n_ok, other=0)
        slot = page * PAGE_SIZE + src % PAGE_SIZE
        k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0)  # [N, D]: each key's head row is contiguous, so the loads are 16 bytes wide
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        if MASKED:
            visible = row_ok[:, None] & n_ok[None, :]
            if HAS_TAIL:
                rel = n - (seq_len - tail_w)  # index into the tail; < 0 before it, where every key is visible
                picked = tl.load(Tail + b * stride_tb + qi[:, None] * stride_tq + rel[None, :] * stride_tw,
                                 mask=visible & (rel >= 0)[None, :] & (qi < tail_q)[:, None], other=0)
                visible = visible & ((rel < 0)[None, :] | (picked != 0))
            else:
                visible = visible & (n[None, :] <= (prefix + qi)[:, None])
            s = tl.where(visible, s, float("-inf"))
        else:
            s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at zero
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0)  # masked: a stray NaN in an unused slot must not meet p == 0
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@jit(do_not_specialize=("num_splits",) + TAIL_SHAPE)
def _attn_stage1(
    Q, K, V, Out, PartO, PartLse, Table, ReqRows, SeqLens, ExtStarts, ExtLens, Tail, Path, PathLen,
    NewK, NewV, NewSlots, Cos, Sin,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_row,
    stride_tb, stride_tq, stride_tw, tail_q, tail_w, num_heads, head_dim, num_splits, scale_log2,
    stride_nkt, stride_nkh, stride_nvt, stride_nvh, half,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_TAIL: tl.constexpr, IEEE: tl.constexpr, PATH: tl.constexpr,
    FIXED: tl.constexpr, INLINE: tl.constexpr, SPLIT_KEYS: tl.constexpr, NEW_KV: tl.constexpr, ROPE: tl.constexpr,
    PDL: tl.constexpr,
):
    # Kept whole: one GPU program. The key loops already live in _attend_keys; what is left (the tile's queries, the
    # split bounds, the mask start, the store) is read by both loops and the store, and a further @jit helper would
    # only pass the same thirty values through another signature.
    pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    seq_len = tl.load(SeqLens + b)
    ext = tl.load(ExtLens + b)
    if FIXED and not INLINE:  # a split past the request's keys (the graph's bound is longer): never merged
        if split * SPLIT_KEYS >= seq_len:
            return
    if PATH:  # one query per program, its group's heads as rows
        if tile >= ext:
            return
        r = tl.arange(0, BLOCK_M)
        qi = tl.zeros([BLOCK_M], tl.int32) + tile
        head = kvh * GROUP + r
        row_ok = r < GROUP
        # the query sits where a plain decode of its branch has it: after the tail's start and its visible offsets
        seen = tl.load(PathLen + b * tail_q + tile, mask=tile < tail_q, other=0)
        prefix = seq_len - tail_w + seen - 1
        path_row = Path + (b * tail_q + tile).to(tl.int64) * tail_w
    else:
        if tile * BLOCK_M >= ext * GROUP:
            return
        r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        qi = r // GROUP  # query index within the request
        head = kvh * GROUP + r % GROUP
        row_ok = qi < ext
        prefix = seq_len - ext
        path_row = Path
    start = tl.load(ExtStarts + b)
    row = tl.load(ReqRows + b)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    tok = (start + qi).to(tl.int64)
    q_rows = Q + tok[:, None] * stride_qt + head[:, None] * stride_qh
    if ROPE:
        q = rotated_dims(q_rows, Cos + tok[:, None] * 2 * half, Sin + tok[:, None] * 2 * half, d[None, :],
                    row_ok[:, None] & d_ok[None, :], half)
    else:
        q = tl.load(q_rows + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    if PATH:  # causal over the branch: prefix is the query's own index (its qi is 0)
        kv_end = prefix + 1
    elif HAS_TAIL:  # a tail mask may open any key of the sequence
        kv_end = seq_len
    else:  # causal: nothing past this tile's last query
        last_q = (tl.minimum(tile * BLOCK_M + BLOCK_M, ext * GROUP) - 1) // GROUP
        kv_end = tl.minimum(seq_len, prefix + last_q + 1)
    kv_end = tl.maximum(kv_end, 0)
    # Keys before first_visible are visible to every row of this tile (causal: up to the tile's first query; tail
    # mask: everything before the tail), so whole blocks before it skip the per-element mask (see _attend_split).
    if PATH:
        first_visible = prefix + 1
    elif HAS_TAIL:
        first_visible = seq_len - tail_w
    else:
        first_visible = prefix + (tile * BLOCK_M) // GROUP + 1
    mask = row_ok[:, None] & d_ok[None, :]
    if FIXED:  # splits at fixed key positions: the same cut whatever the batch (the merge then sums them in order)
        split_len = SPLIT_KEYS
    else:
        split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    lo = split * split_len
    if NEW_KV:  # NewTokens: each new key this program is about to read, it stores first (key n is token n - prefix)
        if INLINE:
            reads_to = kv_end
        else:
            reads_to = tl.minimum(lo + split_len, kv_end)
        for n in range(tl.maximum(lo, prefix), reads_to):
            store_head_kv(NewK, NewV, K, V, NewSlots, Cos, Sin, (start + n - prefix).to(tl.int64), kvh, stride_nkt,
                          stride_nkh, stride_nvt, stride_nvh, stride_ks, stride_kh, stride_vs, stride_vh, head_dim,
                          half, BLOCK_D=BLOCK_D, ROPE=ROPE)
        tl.debug_barrier()  # the program's own stores are visible to all its threads before the key loads
    if INLINE:  # fixed splits walked in order by this program, merged as _attn_merge merges them (module doc)
        big_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        big_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        den = tl.zeros([BLOCK_M], tl.float32)
        for lo in range(0, kv_end, SPLIT_KEYS):
            o, lse = _attend_split(
                q, K, V, Table, Tail, path_row, row, kvh, b, lo, tl.minimum(lo + SPLIT_KEYS, kv_end), first_visible,
                qi, prefix, row_ok, d, d_ok, seq_len, stride_ks, stride_kh, stride_vs, stride_vh, stride_row, stride_tb,
                stride_tq, stride_tw, tail_q, tail_w, scale_log2, PAGE_SIZE=PAGE_SIZE, BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HAS_TAIL=HAS_TAIL, IEEE=IEEE, PATH=PATH)
            big_m, keep, w = _merge_weights(big_m, lse)
            big_acc = big_acc * keep[:, None] + o * w[:, None]
            den = den * keep + w
        o = big_acc / tl.where(den == 0.0, 1.0, den)[:, None]
        tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], o.to(Out.dtype.element_ty),
                 mask=mask)
        return
    o, lse = _attend_split(
        q, K, V, Table, Tail, path_row, row, kvh, b, lo, tl.minimum(lo + split_len, kv_end), first_visible, qi, prefix,
        row_ok, d, d_ok, seq_len, stride_ks, stride_kh, stride_vs, stride_vh, stride_row, stride_tb, stride_tq,
        stride_tw, tail_q, tail_w, scale_log2, PAGE_SIZE=PAGE_SIZE, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D, HAS_TAIL=HAS_TAIL, IEEE=IEEE, PATH=PATH)
    if not SPLIT:
        tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], o.to(Out.dtype.element_ty),
                 mask=mask)
    else:
        part = (tok * num_heads + head) * num_splits + split
        tl.store(PartO + part[:, None] * head_dim + d[None, :], o, mask=mask)
        tl.store(PartLse + part, lse, mask=row_ok)


@jit
def _attend_split(
    q, K, V, Table, Tail, path_row, row, kvh, b, lo, hi, first_visible, qi, prefix, row_ok, d, d_ok, seq_len,
    stride_ks, stride_kh, stride_vs, stride_vh, stride_row, stride_tb, stride_tq, stride_tw, tail_q, tail_w, scale_log2,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_TAIL: tl.constexpr, IEEE: tl.constexpr, PATH: tl.constexpr,
):
    """Keys [lo, hi) from a fresh softmax -> (normalised output [M, D], log2-sum-exp [M]; -inf for a row that saw
    nothing). Blocks before first_visible skip the per-element mask; the cut is rounded down to a block of this split,
    so the block that straddles it runs masked once instead of as two partial blocks back to back (a small verify's
    split holds one block, and each block is a chain of dependent loads: two cost ~2 us more per layer than one)."""
    mask_start = lo + tl.maximum(first_visible - lo, 0) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc, l_i, m_i = _attend_keys(
        acc, l_i, m_i, q, K, V, Table, Tail, path_row, row, kvh, b, lo, tl.minimum(hi, mask_start), qi, prefix, row_ok,
        d, d_ok, seq_len, stride_ks, stride_kh, stride_vs, stride_vh, stride_row, stride_tb, stride_tq, stride_tw, tail_q,
        tail_w, scale_log2, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, MASKED=False, HAS_TAIL=HAS_TAIL, IEEE=IEEE, PATH=PATH)
    acc, l_i, m_i = _attend_keys(
        acc, l_i, m_i, q, K, V, Table, Tail, path_row, row, kvh, b, tl.maximum(lo, mask_start), hi, qi - qi * PATH,
        prefix, row_ok, d, d_ok, seq_len, stride_ks, stride_kh, stride_vs, stride_vh, stride_row, stride_tb, stride_tq,
        stride_tw, tail_q, tail_w, scale_log2, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, MASKED=True, HAS_TAIL=HAS_TAIL,
        IEEE=IEEE, PATH=PATH)
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    return o, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_i))


@jit
def _merge_weights(m, lse):
    """One split into a running merge: -> (new max, the running sums' factor, the split's weight). A split that saw
    nothing (lse -inf) gets weight 0 and factor 1, so it changes nothing, bit for bit."""
    m_new = tl.maximum(m, lse)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, tl.exp2(m - m_safe), tl.exp2(lse - m_safe)


@jit(do_not_specialize=("num_splits",))
def _attn_merge(
    Out, PartO, PartLse, SeqLens, ExtStarts, ExtLens, stride_ot, stride_oh, num_heads, head_dim, num_splits,
    SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, IN_ORDER: tl.constexpr, SPLIT_KEYS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (query i, q head h, request b): one output row from its splits' partial outputs, all loaded at once
    (a loop over splits would wait on one load after another). IN_ORDER: a running merge, split after split, the
    same arithmetic as _attn_stage1's INLINE walk (deterministic mode: the sum's order never depends on the launch),
    over the splits that hold the request's keys only (later ones would add exact zeros)."""
    pdl_wait(PDL)
    i = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    if i >= tl.load(ExtLens + b):
        return
    tok = (tl.load(ExtStarts + b) + i).to(tl.int64)
    base = (tok * num_heads + h) * num_splits
    s = tl.arange(0, SPLITS)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    if IN_ORDER:
        m = tl.full([], float("-inf"), tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        den = tl.zeros([], tl.float32)
        for split in range(0, tl.minimum(num_splits, tl.cdiv(tl.load(SeqLens + b), SPLIT_KEYS))):
            lse_s = tl.load(PartLse + base + split)
            o_s = tl.load(PartO + (base + split) * head_dim + d, mask=d_ok, other=0.0)
            m, keep, w = _merge_weights(m, lse_s)
            acc = acc * keep + o_s * w
            den = den * keep + w
        o = acc / tl.where(den == 0.0, 1.0, den)
        tl.store(Out + tok * stride_ot + h * stride_oh + d, o.to(Out.dtype.element_ty), mask=d_ok)
        return
    lse = tl.load(PartLse + base + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key: every weight is 0 and the row is 0
    w = tl.exp2(lse - m)
    part = tl.load(PartO + (base + s)[:, None] * head_dim + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    den = tl.sum(w, 0)
    o = tl.sum(w[:, None] * part, 0) / tl.where(den == 0.0, 1.0, den)
    tl.store(Out + tok * stride_ot + h * stride_oh + d, o.to(Out.dtype.element_ty), mask=d_ok)


def _merge_width(num_splits: int, invariant: bool) -> int:
    """_attn_merge's SPLITS: one value for every split count up to MAX_SPLITS (masked lanes add nothing), so an
    eager forward whose key bound crosses a power of two does not compile the merge again (~1 s, seen inside timed
    runs); the in-order merge of deterministic mode loops and never reads it."""
    return 1 if invariant else next_pow2(max(num_splits, MAX_SPLITS))


def paged_attention(q, k_cache, v_cache, page_table, req_rows, seq_lens, extend_starts, extend_lens, *,
                    page_size: int, max_extend_len: int, tail_mask=None, num_splits: int = 1, out=None, workspace=None,
                    tiles: Tiles | None = None, path: tuple[torch.Tensor, torch.Tensor] | None = None,
                    invariant: bool = False, new_tokens: NewTokens | None = None):
    """q: [T, Hq, D]; k_cache/v_cache: [slots, Hkv, D]; page_table: [rows, pages] int64; req_rows: [B] int64;
    seq_lens/extend_starts/extend_lens: [B] int32; tail_mask: optional [B, Q, W] bool -> out [T, Hq, D].
    Launch sizes come from tensor shapes, max_extend_len and num_splits only (CUDA-graph safe). tiles overrides
    tile_config (benchmarks). invariant: deterministic mode (module doc): splits of INVARIANT_SPLIT_KEYS keys, run
    as num_splits parallel programs (num_splits = invariant_num_splits) or, with num_splits 1, walked in order by
    one program; path: tail_paths(tail_mask), for batch-invariant trees (one query per program); new_tokens: a
    forward's new k/v, stored by this launch (NewTokens; q is then unrotated when it carries the RoPE table)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    batch = req_rows.shape[0]
    out = torch.empty_like(q) if out is None else out
    if batch == 0 or max_extend_len == 0:
        return out
    cfg = tiles or tile_config(group, max_extend_len, head_dim, q.dtype)
    row_tiles = num_row_tiles(group, max_extend_len, cfg.m)
    if path is not None:
        assert tail_mask is not None and invariant and cfg.m >= group
        row_tiles = max_extend_len
    if num_splits > 1 and workspace is None:
        workspace = attention_workspace(num_tokens, num_heads, head_dim, num_splits, q.device)
    part_o, part_lse = workspace if num_splits > 1 else (out, out)  # unused when there is one split
    tail = tail_mask.view(torch.uint8) if tail_mask is not None else seq_lens  # any pointer; HAS_TAIL=False
    tail_strides = tail.stride() if tail_mask is not None else (0, 0, 0)
    tail_q, tail_w = (tail_mask.shape[1], tail_mask.shape[2]) if tail_mask is not None else (0, 0)
    path_offsets, path_seen = path if path is not None else (seq_lens, seq_lens)  # any pointer; PATH=False
    new = NewTokenArgs.of(new_tokens, q, max_extend_len, path)
    _attn_stage1[(batch, num_kv_heads, row_tiles * num_splits)](
        q, k_cache, v_cache, out, part_o, part_lse, page_table, req_rows, seq_lens, extend_starts, extend_lens, tail,
        path_offsets, path_seen, *new.tensors,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), *tail_strides, tail_q, tail_w, num_heads, head_dim,
        num_splits, head_dim ** -0.5 * math.log2(math.e), *new.scalars,
        GROUP=group, PAGE_SIZE=page_size, SPLIT=num_splits > 1, BLOCK_M=cfg.m, BLOCK_N=cfg.n, BLOCK_D=cfg.d,
        HAS_TAIL=tail_mask is not None and path is None, IEEE=q.dtype == torch.float32, PATH=path is not None,
        FIXED=invariant, INLINE=invariant and num_splits == 1, SPLIT_KEYS=INVARIANT_SPLIT_KEYS,
        NEW_KV=new_tokens is not None, ROPE=new_tokens is not None and new_tokens.rope is not None,
        num_warps=cfg.warps, num_stages=cfg.stages,
        **pdl_args(q.device),
    )
    if num_splits > 1:
        _attn_merge[(max_extend_len, num_heads, batch)](
            out, part_o, part_lse, seq_lens, extend_starts, extend_lens, out.stride(0), out.stride(1), num_heads,
            head_dim, num_splits, SPLITS=_merge_width(num_splits, invariant), BLOCK_D=cfg.d, IN_ORDER=invariant,
            SPLIT_KEYS=INVARIANT_SPLIT_KEYS, num_warps=4, **pdl_args(q.device),
        )
    return out


def paged_attention_reference(q, k_cache, v_cache, page_table, req_rows, seq_lens, extend_starts, extend_lens, *,
                              page_size: int, max_extend_len: int = 0, tail_mask=None, num_splits: int = 1, out=None,
                              workspace=None):
    """Plain torch, one request at a time, in float32; same arguments as paged_attention (the launch-shape ones
    are ignored). A query with no visible key gets zeros."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    res = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lens, starts, exts, rows = (t.tolist() for t in (seq_lens, extend_starts, extend_lens, req_rows))
    for b, (seq_len, start, ext, row) in enumerate(zip(lens, starts, exts, rows)):
        if ext == 0 or seq_len <= 0:
            continue
        idx = torch.arange(seq_len, device=q.device)
        slots = page_table[row, idx // page_size] * page_size + idx % page_size
        keys = k_cache[slots].float().repeat_interleave(group, 1)  # [L, Hq, D]
        values = v_cache[slots].float().repeat_interleave(group, 1)
        scores = torch.einsum("ehd,lhd->hel", q[start:start + ext].float(), keys) * head_dim ** -0.5
        if tail_mask is None:
            visible = idx[None, :] <= (seq_len - ext + torch.arange(ext, device=q.device))[:, None]
        else:
            n_rows, width = tail_mask.shape[1], tail_mask.shape[2]
            rows_mask = torch.zeros(ext, width, dtype=torch.bool, device=q.device)
            rows_mask[: min(ext, n_rows)] = tail_mask[b, : min(ext, n_rows)]
            rel = idx - (seq_len - width)
            visible = torch.where(rel[None, :] < 0, True, rows_mask[:, rel.clamp(0, width - 1)])
        probs = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), -1).nan_to_num(0.0)
        res[start:start + ext] = torch.einsum("hel,lhd->ehd", probs, values)
    if out is None:
        return res.to(q.dtype)
    out.copy_(res)
    return out
