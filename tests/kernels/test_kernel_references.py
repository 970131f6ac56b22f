"""The plain-torch references beside the Triton kernels (hyperdraft/kernels) agree with the torch attention
backend and KVPool on random paged inputs. The GPU tests hold each Triton kernel to its reference, so this
keeps the chain kernel == reference == engine honest on a CPU-only CI.

Pages are handed out in a shuffled order, so a request's keys are scattered over the pool."""

from __future__ import annotations

import random

import pytest
import torch

from hyperdraft.attention.torch_backend import TorchAttentionBackend
from hyperdraft.core.forward_batch import ForwardInput, ForwardMode, build_forward_batch
from hyperdraft.kernels.attention import paged_attention_reference
from hyperdraft.kernels.attention_tiles import num_kv_splits, split_tiles, tile_config
from hyperdraft.kernels.kv_move import kv_move_reference
from hyperdraft.kernels.kv_store import kv_store_reference
from hyperdraft.kvcache.kv_pool import KVPool
from hyperdraft.kvcache.page_table import PageTable

HKV, HEAD_DIM = 2, 16


def _paged(page_size: int, lens: list[int], seed: int) -> tuple[PageTable, KVPool, list[int]]:
    """A page table with one row per request (room for lens[b] tokens, pages shuffled) and a random pool."""
    pages = sum(-(-n // page_size) for n in lens) + 3
    table = PageTable(pages + 1, page_size, max_rows=len(lens) + 1, max_pages_per_row=max(lens) + 1, device="cpu")
    random.Random(seed).shuffle(table._free_pages)  # scatter each request over the pool
    rows = []
    for n in lens:
        rows.append(table.acquire_row())
        assert table.reserve(rows[-1], n)
    torch.manual_seed(seed)
    pool = KVPool(1, (pages + 1) * page_size, HKV, HEAD_DIM, torch.float32, "cpu")
    pool.k.normal_()
    pool.v.normal_()
    return table, pool, rows


def _both(page_size: int, ratio: int, specs: list[tuple[int, int]], masks=None, seed: int = 0):
    """specs: (prefix, extend) per request; masks: optional per-request [extend, W] tail masks.
    Returns (torch backend output, reference output) for one layer, after the backend stored the new K/V."""
    table, pool, rows = _paged(page_size, [p + e for p, e in specs], seed)
    inputs = [ForwardInput(r, p, [0] * e, e, mask=None if masks is None else masks[i])
              for i, (r, (p, e)) in enumerate(zip(rows, specs))]
    fb = build_forward_batch(ForwardMode.EXTEND, inputs, table, "cpu")
    t = fb.num_tokens
    q = torch.randn(t, HKV * ratio, HEAD_DIM)
    k, v = torch.randn(t, HKV, HEAD_DIM), torch.randn(t, HKV, HEAD_DIM)
    backend = TorchAttentionBackend(pool, table)
    want = backend.forward(0, q, k, v, fb, backend.plan(fb))
    got = paged_attention_reference(q, pool.k[0], pool.v[0], table.table, fb.req_rows, fb.seq_lens_t,
                                    fb.extend_starts_t, fb.extend_lens_t, page_size=page_size,
                                    max_extend_len=fb.max_extend_len, tail_mask=fb.tail_mask)
    return want, got


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_decode_and_extend_reference_match_torch_backend(page_size, ratio):
    # Decodes (1 new token) beside prefills (no prefix) and chunked extends over a cached prefix, in one batch.
    specs = [(0, 1), (37, 1), (0, 23), (19, 9), (64, 1), (5, 40)]
    want, got = _both(page_size, ratio, specs, seed=page_size * 10 + ratio)
    assert want.shape == got.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_tree_mask_reference_matches_torch_backend(page_size, ratio):
    # Random ancestor masks (self always visible): a verify tree whose tail is its own nodes (W = extend), a
    # drafting step whose tail also covers earlier tree nodes (W > extend), and a mask over the whole sequence.
    g = torch.Generator().manual_seed(page_size + ratio)
    specs = [(20, 6), (33, 3), (0, 5)]
    widths = [6, 10, 5]
    masks = []
    for (prefix, ext), width in zip(specs, widths):
        m = torch.rand(ext, width, generator=g) < 0.5
        m[torch.arange(ext), width - ext + torch.arange(ext)] = True
        masks.append(m)
    want, got = _both(page_size, ratio, specs, masks, seed=page_size + ratio)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    causal, _ = _both(page_size, ratio, specs, None, seed=page_size + ratio)
    assert not torch.allclose(causal, got, atol=1e-3)  # the masks mattered


def test_reference_gives_zeros_for_padding_entries():
    # CUDA-graph padding: entries with seq_len 0 or 1 pointing at a dummy row (all pages 0) must give finite rows.
    table, pool, rows = _paged(4, [9], seed=3)
    dummy = table.acquire_row()
    q = torch.randn(4, 4, HEAD_DIM)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    out = paged_attention_reference(q, pool.k[0], pool.v[0], table.table, torch.tensor([rows[0], dummy, dummy]),
                                    i32([9, 0, 1]), i32([0, 2, 3]), i32([2, 1, 1]), page_size=4, max_extend_len=2)
    assert torch.isfinite(out).all()
    assert (out[2] == 0).all()  # seq_len 0: no key, zeros
    slot0 = pool.v[0, 0].repeat_interleave(2, 0)  # seq_len 1 on the dummy row reads the padding page's slot 0
    torch.testing.assert_close(out[3], slot0)


def test_kv_store_reference_matches_pool_store():
    pool = KVPool(2, 40, HKV, HEAD_DIM, torch.float32, "cpu")
    slots = torch.tensor([7, 3, 30, 0])
    k, v = torch.randn(4, HKV, HEAD_DIM), torch.randn(4, HKV, HEAD_DIM)
    k_ref, v_ref = pool.k[1].clone(), pool.v[1].clone()
    kv_store_reference(k_ref, v_ref, slots, k, v)
    pool.store(1, slots, k, v)
    assert torch.equal(pool.k[1], k_ref) and torch.equal(pool.v[1], v_ref)
    assert torch.equal(k_ref[30], k[2])


def test_kv_move_reference_matches_pool_move_with_overlap():
    pool = KVPool(3, 32, HKV, HEAD_DIM, torch.float32, "cpu")
    pool.k.normal_()
    pool.v.normal_()
    # Compaction-shaped: accepted nodes at 10, 12, 15 move to 10, 11, 12; 12 is both a source and a destination.
    dst, src = torch.tensor([10, 11, 12, 20]), torch.tensor([10, 12, 15, 20])
    k0, v0 = pool.k.clone(), pool.v.clone()
    kv_move_reference(k0, v0, dst, src)
    before = pool.k.clone()
    pool.move(dst, src)
    assert torch.equal(pool.k, k0) and torch.equal(pool.v, v0)
    assert torch.equal(k0[:, 11], before[:, 12]) and torch.equal(k0[:, 12], before[:, 15])


def test_split_count_comes_from_static_sizes():
    # Small batches get splits for parallelism; a full GPU gets one; never more than the keys warrant.
    assert num_kv_splits(1, 8, 1, 8192, 132) > 8
    assert num_kv_splits(256, 8, 1, 8192, 132) == 1
    assert num_kv_splits(1, 8, 1, 100, 132) == 1


def test_short_splits_run_a_two_stage_pipeline():
    """Batch-1 split-K (a few key blocks per program) takes 2 stages; long splits keep the 3-stage default."""
    tiles = tile_config(4, 1, 128, torch.bfloat16)
    assert tiles.stages == 3
    assert split_tiles(tiles, 4096, num_kv_splits(1, 8, 1, 4096, 132)).stages == 2
    assert split_tiles(tiles, 8192, num_kv_splits(32, 8, 1, 8192, 132)).stages == 3
    assert split_tiles(tiles, 131072, num_kv_splits(1, 8, 1, 131072, 132)).stages == 3
    assert split_tiles(tiles, 4096, 1) == tiles


def test_backend_choice_on_cpu(llama_path, make_llm):
    from hyperdraft import LLM

    assert isinstance(make_llm(llama_path).engine.runner.backend, TorchAttentionBackend)  # None -> torch on CPU
    with pytest.raises(ValueError, match="attention_backend 'triton' needs a CUDA device"):
        LLM(llama_path, device="cpu", attention_backend="triton")
