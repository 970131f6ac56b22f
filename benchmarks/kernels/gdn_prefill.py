"""Gated DeltaNet prefill: our token-by-token delta walk (kernels/gated_delta_walk.py) against fla-core's chunked
kernel (chunk_gated_delta_rule), on one Qwen3.5-9B layer's shape (32 value heads, 16 key heads, dk = dv = 128), one
request of T tokens from a zero state, bf16 inputs and an fp32 state. Also checks that both give the same output and
final state (the decision to adopt fla for prefill needs both numbers).

On the GPU machine, fla-core and einops travel as wheels (.whl, see the device README):
  python -m benchmarks.kernels.gdn_prefill --out $OUT     # writes $OUT/gdn_prefill_<device>.md
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.common import require_cuda, tag_of
from benchmarks.kernels.timing import graph_ms
from hyperdraft.kernels.gated_delta_walk import Walk, delta_walk

HV, HK, DK, DV = 32, 16, 128, 128
LENGTHS = (256, 1024, 4096, 16384)


def inputs(tokens: int, gen: torch.Generator):
    key_dim = HK * DK
    qkv = torch.randn(tokens, 2 * key_dim + HV * DV, generator=gen, device="cuda").bfloat16()
    g = -torch.rand(tokens, HV, generator=gen, device="cuda") * 0.5
    beta = torch.rand(tokens, HV, generator=gen, device="cuda").bfloat16()
    return qkv, g, beta


def ours(qkv, g, beta):
    tokens = qkv.shape[0]
    i32 = dict(dtype=torch.int32, device="cuda")
    walk = Walk(1, torch.zeros(1, **i32), torch.full((1,), tokens, **i32), torch.ones(1, dtype=torch.int64, device="cuda"),
                torch.ones(1, **i32), torch.cat([torch.full((1,), -1, **i32), torch.full((tokens - 1,), -2, **i32)]),
                torch.full((tokens,), -1, **i32))
    state = torch.zeros(2, HV, DK, DV, device="cuda")
    scratch = torch.zeros(2, 0, HV, DK, DV, device="cuda")

    def run():
        return delta_walk(qkv, g, beta, state, scratch, walk, HK * DK, torch.bfloat16)

    return run, state


def fla(qkv, g, beta):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    tokens, key_dim = qkv.shape[0], HK * DK
    q, k, v = qkv.split([key_dim, key_dim, HV * DV], dim=-1)
    q = q.reshape(1, tokens, HK, DK).repeat_interleave(HV // HK, dim=2).contiguous()
    k = k.reshape(1, tokens, HK, DK).repeat_interleave(HV // HK, dim=2).contiguous()
    v = v.reshape(1, tokens, HV, DV).contiguous()
    gg, bb = g[None].contiguous(), beta[None].contiguous()
    out = {}

    def run():
        o, final = chunk_gated_delta_rule(q, k, v, gg, bb, initial_state=None, output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
        out["final"] = final
        return o

    return run, out


def timed_ms(fn) -> float:
    """CUDA-graph replays where fn can be captured, else eager launches timed with events."""
    try:
        return graph_ms(fn, reps=5)
    except RuntimeError:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    require_cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for tokens in LENGTHS:
        qkv, g, beta = inputs(tokens, gen)
        mine, state = ours(qkv, g, beta)
        theirs, fla_out = fla(qkv, g, beta)
        o_mine, o_fla = mine(), theirs()
        torch.cuda.synchronize()
        out_err = (o_mine.float() - o_fla[0].float()).abs().max().item()
        state_err = (state[1] - fla_out["final"][0].float()).abs().max().item()
        rows.append((tokens, timed_ms(mine), timed_ms(theirs), out_err, state_err))
        print(rows[-1], flush=True)
    name = torch.cuda.get_device_name()
    lines = [f"# Gated DeltaNet prefill, one Qwen3.5-9B layer: delta walk vs fla-core chunk_gated_delta_rule ({name})",
             "", f"Date {time.strftime('%Y-%m-%d')}. Command: `python -m benchmarks.kernels.gdn_prefill --out $OUT` "
             "(fla-core 0.6.0 carried as a wheel). One request from a zero state, bf16 q|k|v, fp32 state; times are "
             "CUDA-graph replays (eager, event-timed, where a capture fails).", "",
             "| tokens | delta walk ms | fla chunk ms | walk / fla | max abs diff, output | max abs diff, final state |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {t} | {a:.3f} | {b:.3f} | {a / b:.1f}x | {e1:.2e} | {e2:.2e} |" for t, a, b, e1, e2 in rows]
    with open(os.path.join(args.out, f"gdn_prefill_{tag_of(name)}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
