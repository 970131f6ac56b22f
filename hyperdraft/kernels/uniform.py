"""Counter-based uniforms (sample/rng.py's `uniform`) in one Triton launch instead of about 60 int64 torch ops.

The hash runs in uint32 arithmetic, where the reference masks int64 products to 32 bits: both compute the same
lowbias32 mixer, so the kernel's numbers are bit-identical to the reference's (the sampling contract: a seeded
request draws the same numbers on any device and through either path).
"""

from __future__ import annotations

import torch

from hyperdraft.kernels._triton import jit, tl, triton

BLOCK = 1024
_M32 = 0xFFFFFFFF


@jit
def _hash(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@jit
def uniform_at(seed, pos, domain_hash, cols):
    """The uniforms of (seed, position) at columns cols (int64 seed and positions, scalars or blocks; the other
    kernels that draw coins call this)."""
    h = _hash(domain_hash.to(tl.uint32) ^ (seed & 0xFFFFFFFF).to(tl.uint32))
    h = _hash(h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
    key = _hash(h ^ (pos & 0xFFFFFFFF).to(tl.uint32))
    index = _hash(cols.to(tl.uint32) + 0x632BE5AB)
    bits = _hash(key ^ index) >> 9
    return (bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@jit
def _uniform(Seeds, Positions, Out, domain_hash, width, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = uniform_at(tl.load(Seeds + n), tl.load(Positions + n), domain_hash, cols)
    tl.store(Out + n * width + cols, u, mask=cols < width)


def _hash_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def fold_domain(domain: int) -> int:
    """The seed-independent first round of the hash, folded on the host (uniform_at's domain_hash)."""
    return _hash_int(domain * 0x9E3779B9)


def uniform(seeds: torch.Tensor, positions: torch.Tensor, domain: int, width: int = 1) -> torch.Tensor:
    """seeds, positions: [N] int64 -> [N, width] float32 in (0, 1); the same numbers as sample.rng.uniform."""
    out = torch.empty((seeds.shape[0], width), dtype=torch.float32, device=seeds.device)
    if out.numel():
        _uniform[(seeds.shape[0], triton.cdiv(width, BLOCK))](seeds, positions, out, fold_domain(domain), width,
                                                             BLOCK=BLOCK, num_warps=4)
    return out
