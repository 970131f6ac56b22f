"""Tile sweep for the batch-1 attention a speculative round runs: a one-query decode (draft steps, plain decode) and
a chain verify of 6 queries (chain 5), at short and long contexts, on a CUDA GPU.

Attention launch only (stage 1 + split merge; the store is not counted), CUDA-graph time per layer in microseconds,
Llama-3-8B shapes (32 q heads, 8 kv heads, head_dim 128), bf16, page_size 16, pages shuffled. The split count comes
from the engine's rule over a graph's static bound (max_seq_len 4096 here, as a captured graph sees it), so most
splits of a short context find no keys, as in the engine.

    python -m benchmarks.kernels.verify_attention      # GPU; prints a markdown table
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import require_cuda
from benchmarks.kernels.attention_case import D, HKV, HQ, PAGE, attention_case
from benchmarks.kernels.timing import graph_call_us
from hyperdraft.kernels.attention import paged_attention
from hyperdraft.kernels.attention_tiles import MIN_KEYS_PER_SPLIT, num_kv_splits, num_row_tiles, tile_config

GRAPH_BOUND = 4096
GRAPH_REPS = 20  # calls per captured graph, as in attention_kernels.py


def main() -> None:
    argparse.ArgumentParser(prog="python -m benchmarks.kernels.verify_attention", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    require_cuda()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    group = HQ // HKV
    print(f"device: {torch.cuda.get_device_name(0)}; us per layer (graph), static bound {GRAPH_BOUND} keys")
    print("| case | keys | tiles | min keys/split | splits | us |")
    print("|---|---|---|---|---|---|")
    for name, ext in (("decode", 1), ("chain verify", 6)):
        for prefix in (640, 1024, 4090 - ext):
            table, pool, fb, q, k, v = attention_case(1, prefix, ext, False)
            base = tile_config(group, ext, D, q.dtype)
            variants = [base, base._replace(m=16), base._replace(stages=2), base._replace(n=32),
                        base._replace(m=16, n=32)]
            for tiles in dict.fromkeys(variants):
                for min_keys in (64, MIN_KEYS_PER_SPLIT, 256):
                    splits = num_kv_splits(1, HKV, num_row_tiles(group, ext, tiles.m), GRAPH_BOUND, num_sms, min_keys)
                    fn = lambda: paged_attention(  # noqa: E731
                        q, pool.k[0], pool.v[0], table.table, fb.req_rows, fb.seq_lens_t, fb.extend_starts_t,
                        fb.extend_lens_t, page_size=PAGE, max_extend_len=ext, num_splits=splits, tiles=tiles)
                    mark = " (engine)" if tiles == base and min_keys == MIN_KEYS_PER_SPLIT else ""
                    print(f"| {name} | {prefix + ext} | {tuple(tiles)}{mark} | {min_keys} | {splits} | "
                          f"{graph_call_us(fn, calls=GRAPH_REPS):.1f} |", flush=True)
            del table, pool, fb, q, k, v
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
