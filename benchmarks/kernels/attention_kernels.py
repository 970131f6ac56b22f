"""Micro-benchmark: the Triton attention backend against the torch backend, one layer, on a CUDA GPU.

Llama-3-8B attention shapes (32 q heads, 8 kv heads, head_dim 128), bf16, page_size 16, pages shuffled.
Per layer = store the new K/V + attend (what backend.forward does); plan is per forward and not counted.
Eager times include Python launch overhead; graph times replay 20 captured layer calls (GPU time only).
The floor is the K/V bytes a decode must read, over the copy bandwidth measured in the same run.

    python -m benchmarks.kernels.attention_kernels --out $OUT/attention_kernels_h100.md   # GPU; also prints it
"""

from __future__ import annotations

import argparse
import datetime

import torch

from benchmarks.common import command_line, git_commit, require_cuda
from benchmarks.kernels.attention_case import D, DTYPE, HKV, HQ, PAGE, attention_case
from benchmarks.kernels.timing import eager_us, graph_call_us
from hyperdraft.attention.torch_backend import TorchAttentionBackend
from hyperdraft.attention.triton_backend import TritonAttentionBackend
from hyperdraft.kernels.attention import paged_attention
from hyperdraft.kernels.attention_tiles import Tiles, num_kv_splits, num_row_tiles, tile_config
from hyperdraft.kernels.kv_move import kv_move, kv_move_reference
from hyperdraft.kernels.kv_store import kv_store, kv_store_reference

GRAPH_REPS = 20


def _time_graph(fn) -> float:
    return graph_call_us(fn, calls=GRAPH_REPS)


def _time_graph_or_na(fn) -> str:
    try:
        return f"{_time_graph(fn):.1f}"
    except RuntimeError:  # not capturable
        torch.cuda.synchronize()
        return "n/a"


def _copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = eager_us(lambda: y.copy_(x))
    return 2 * x.numel() / (us * 1e-6)  # bytes read + written per second


def attention_rows(bw: float) -> list[str]:
    out = []
    cases = [("decode", b, s, 1, False) for b in (1, 32) for s in (1024, 8192)]
    cases += [("tree verify (8 nodes)", b, s, 8, True) for b in (1, 32) for s in (1024, 8192)]
    cases += [("prefill", 1, 0, 4096, False)]
    for name, batch, prefix, ext, tree in cases:
        table, pool, fb, q, k, v = attention_case(batch, prefix, ext, tree)
        tri, ref = TritonAttentionBackend(pool, table), TorchAttentionBackend(pool, table)
        tri_meta, ref_meta = tri.plan(fb), ref.plan(fb)
        tri_fn = lambda: tri.forward(0, q, k, v, fb, tri_meta)  # noqa: E731
        ref_fn = lambda: ref.forward(0, q, k, v, fb, ref_meta)  # noqa: E731
        diff = (tri_fn().float() - ref_fn().float()).abs().max().item()
        te, tg, oe = eager_us(tri_fn), _time_graph(tri_fn), eager_us(ref_fn)
        kv_bytes = batch * (prefix + ext) * HKV * D * 2 * 2
        floor = kv_bytes / bw * 1e6
        out.append(f"| {name} | {batch} | {prefix + ext} | {te:.1f} | {tg:.1f} | {oe:.1f} | {oe / te:.2f}x | "
                   f"{floor:.1f} | {diff:.1e} |")
        del table, pool, fb, q, k, v
        torch.cuda.empty_cache()
    return out


def ablation_rows() -> list[str]:
    """Attention launch only (no store), graph time: key splits by min keys per split, pipeline stages, tiles."""
    out = []
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [("decode", 1, 1024, 1, False), ("decode", 1, 8192, 1, False), ("decode", 32, 8192, 1, False),
             ("tree verify", 1, 8192, 8, True), ("tree verify", 32, 8192, 8, True), ("prefill", 1, 0, 4096, False)]
    for name, batch, prefix, ext, tree in cases:
        table, pool, fb, q, k, v = attention_case(batch, prefix, ext, tree)
        group = HQ // HKV
        base = tile_config(group, ext, D, DTYPE)
        variants = [(f"min keys {mk}", base, mk) for mk in (64, 128, 256)]
        variants += [("2 stages" if base.stages == 3 else "3 stages", base._replace(stages=5 - base.stages), 128)]
        if name == "prefill":
            variants += [("tiles 128x64, 8 warps", Tiles(128, 64, D, 8, 2), 128)]
        cells = []
        for label, tiles, mk in variants:
            splits = num_kv_splits(batch, HKV, num_row_tiles(group, ext, tiles.m), prefix + ext, num_sms, mk)
            fn = lambda: paged_attention(q, pool.k[0], pool.v[0], table.table, fb.req_rows, fb.seq_lens_t,  # noqa: E731
                                         fb.extend_starts_t, fb.extend_lens_t, page_size=PAGE, max_extend_len=ext,
                                         tail_mask=fb.tail_mask, num_splits=splits, tiles=tiles)
            cells.append(f"{label} (S={splits}): {_time_graph(fn):.1f}")
        out.append(f"| {name} | {batch} | {prefix + ext} | {base} | " + "; ".join(cells) + " |")
        del table, pool, fb, q, k, v
        torch.cuda.empty_cache()
    return out


def store_move_rows() -> list[str]:
    out = []
    for t in (32, 4096):
        cache = [torch.randn(1 << 16, HKV, D, dtype=DTYPE, device="cuda") for _ in range(2)]
        slots = torch.randperm(1 << 16, device="cuda")[:t]
        k, v = torch.randn(t, HKV, D, dtype=DTYPE, device="cuda"), torch.randn(t, HKV, D, dtype=DTYPE, device="cuda")
        tri = lambda: kv_store(*cache, slots, k, v)  # noqa: E731
        ref = lambda: kv_store_reference(*cache, slots, k, v)  # noqa: E731
        out.append(f"| kv store, {t} tokens | {eager_us(tri):.1f} | {_time_graph(tri):.1f} | "
                   f"{eager_us(ref):.1f} | {_time_graph_or_na(ref)} |")
    for n in (32 * 6, 256 * 6):
        pools = [torch.randn(32, 1 << 14, HKV, D, dtype=DTYPE, device="cuda") for _ in range(2)]
        src = torch.randperm(1 << 14, device="cuda")[:n]
        dst = torch.randperm(1 << 14, device="cuda")[:n]
        tri = lambda: kv_move(*pools, dst, src)  # noqa: E731
        ref = lambda: kv_move_reference(*pools, dst, src)  # noqa: E731
        out.append(f"| kv move, 32 layers, {n} slots | {eager_us(tri):.1f} | {_time_graph(tri):.1f} | "
                   f"{eager_us(ref):.1f} | {_time_graph_or_na(ref)} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels.attention_kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commit", default=None, help="commit to name in the header (default: the checkout's)")
    ap.add_argument("--out", default=None, help="also write the markdown here (e.g. $OUT/attention_kernels_h100.md)")
    args = ap.parse_args()
    require_cuda()
    torch.manual_seed(0)
    bw = _copy_bandwidth()
    lines = [
        "# Attention kernels: Triton backend vs torch backend (one layer)",
        "",
        f"- device: {torch.cuda.get_device_name()}, torch {torch.__version__}",
        f"- date: {datetime.date.today()}",
        f"- commit: {args.commit or git_commit()}",
        f"- command: `{command_line()}`",
        f"- shapes: {HQ} q heads, {HKV} kv heads, head_dim {D}, bf16, page_size {PAGE} (pages shuffled)",
        f"- measured copy bandwidth: {bw / 1e9:.0f} GB/s (read + write); floor = K/V bytes read / that",
        "",
        "Per layer (store new K/V + attention), microseconds, median. Eager includes launch overhead; graph = replay",
        f"of {GRAPH_REPS} captured calls (the torch backend cannot be captured: it indexes with a boolean mask).",
        "Speed-up = torch eager / triton eager. max abs diff = triton vs torch output.",
        "",
        "| case | batch | seq | triton eager | triton graph | torch eager | speed-up | floor | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|",
        *attention_rows(bw),
        "",
        "Tuning (attention launch only, graph time in microseconds; S = key splits):",
        "",
        "| case | batch | seq | default tiles | variants |",
        "|---|---|---|---|---|",
        *ablation_rows(),
        "",
        "KV store (one layer, Triton: one launch for K and V; reference: two index_copy_) and the compaction move",
        "(all layers; Triton: gather + scatter launches; reference: advanced indexing), microseconds:",
        "",
        "| op | triton eager | triton graph | torch eager | torch graph |",
        "|---|---|---|---|---|",
        *store_move_rows(),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
