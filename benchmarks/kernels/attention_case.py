"""One layer's paged-attention inputs at Llama-3-8B attention shapes, for the attention micro-benchmarks
(kernels/attention_kernels.py, kernels/verify_attention.py)."""

from __future__ import annotations

import random

import torch

from hyperdraft.core.forward_batch import ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.kvcache.kv_pool import KVPool
from hyperdraft.kvcache.page_table import PageTable

HQ, HKV, D, PAGE, DTYPE = 32, 8, 128, 16, torch.bfloat16


def attention_case(batch: int, prefix: int, ext: int, tree: bool):
    """batch requests, each with `prefix` cached keys (random K/V, pages shuffled) and `ext` new tokens: a decode
    (ext 1), a verify (ext > 1; tree: node i's parent is (i - 1) // 2) or a prefill (prefix 0)
    -> (page table, K/V pool, forward batch, q, k, v of the new tokens)."""
    seq = prefix + ext
    pages = batch * -(-seq // PAGE) + 2
    table = PageTable(pages, PAGE, batch + 1, -(-seq // PAGE) + 1, "cuda")
    random.Random(0).shuffle(table._free_pages)
    pool = KVPool(1, pages * PAGE, HKV, D, DTYPE, "cuda")
    pool.k.normal_()
    pool.v.normal_()
    rows = []
    for _ in range(batch):
        rows.append(table.acquire_row())
        table.reserve(rows[-1], seq)
    mask = None
    if tree:  # a binary-ish tree: node i's parent is (i - 1) // 2
        anc = torch.zeros(ext, ext, dtype=torch.bool)
        for i in range(ext):
            if i:
                anc[i] = anc[(i - 1) // 2]
            anc[i, i] = True
        mask = anc
    inputs = [ForwardInput(r, prefix, [0] * ext, ext, mask=mask) for r in rows]
    fb = build_forward_batch(ForwardMode.TARGET_VERIFY if ext > 1 else ForwardMode.DECODE, inputs, table, "cuda")
    t = fb.num_tokens
    q = torch.randn(t, HQ, D, dtype=DTYPE, device="cuda")
    k, v = torch.randn(t, HKV, D, dtype=DTYPE, device="cuda"), torch.randn(t, HKV, D, dtype=DTYPE, device="cuda")
    return table, pool, fb, q, k, v
