"""kernels/gemv.py's tensor-core Triton kernel `_gemv_dot` launched at a chosen tile, for the tile sweeps of
kernels/gemv_shapes.py and kernels/pdl_chain.py. gemv() itself picks the tile (and, where it fits, the CUDA kernel
gemv_mma.cu instead); these launch the Triton kernel directly, so a sweep changes nothing in hyperdraft."""

from __future__ import annotations

import torch

import hyperdraft.kernels.gemv as gemv_module

ENGINE_DOT_TILE = (gemv_module.DOT_BLOCK_N, gemv_module.DOT_BLOCK_K, gemv_module.DOT_WARPS, gemv_module.DOT_STAGES)


def gemv_dot(x: torch.Tensor, weight: torch.Tensor, tile: tuple[int, int, int, int], swap: bool = False,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= 16, K] @ weight [N, K]^T -> [M, N] on `_gemv_dot` with tile (BLOCK_N, BLOCK_K, warps, stages); swap:
    the weight as the MMA's wide operand (SWAP). Launched with PDL as the active RuntimeOptions say
    (hyperdraft.options.activated)."""
    import triton

    block_n, block_k, warps, stages = tile
    m, k = x.shape
    n = weight.shape[0]
    assert m <= gemv_module.MAX_ROWS and x.stride(-1) == 1 and weight.is_contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    gemv_module._gemv_dot[(triton.cdiv(m, 16), triton.cdiv(n, block_n))](  # row tiles, column tiles
        x, weight, weight, out, out, m, n, k, x.stride(0), out.stride(0), out.stride(0), HAS_BIAS=False,
        HAS_RES=False, IEEE=x.dtype == torch.float32, SWAP=swap, EVEN=n % block_n == 0 and k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, LINE=min(block_k, 128 // x.element_size()), num_warps=warps,
        num_stages=stages, **gemv_module.pdl_args(x.device))
    return out
