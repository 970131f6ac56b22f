"""Blocked copies of a CPU model's fp32 weights for the 3..16-row products of speculative verifies.

Why: on CPU a verify's products are not streamed at the price of a decode's. MKL's sgemm, in the orientation
cpu_linear picks (`W @ x^T`), ran 30 layers of SmolLM2-135M's gate/up product (3072 x 576) in 6.3 ms at 1-2 rows,
but 9.2 at 3 rows, 14.6 at 6 and 16.0 at 8: past two rows that kernel is compute-bound (~48 GFLOP/s on two AMD
EPYC threads). oneDNN's inner-product kernel over a weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, sized for 8 rows) ran the same product in 6.5 ms at 3 rows, 6.2 at 4,
6.3 at 6 and 7.6-9.8 at 8, and down (576 x 1536) in 3.4 against MKL's 10.9 ms at 6 rows; the lm_head (49152 x 576)
2.7 against 6.5 ms at 6 rows (benchmarks/results/cpu_verify_rows_cpu.md, session 33). At 1-2 rows oneDNN loses
(gate/up 8.0-9.0 ms), so decodes and draft steps keep MKL: the blocked copy is a second copy of the weights, made
only when an engine verifies 3 rows or more on CPU in fp32, and only when it fits in half the free memory
(cpu_linear.pack_for_verify).

Numerics: another summation order than F.linear (float32 rounding apart, as two MKL row counts already are); the
same weight gives a row the same bits at every row count from 2 to 16 (tests/models/test_cpu_packed.py), so a token
gets the same logits in any verify width.

Not done, measured: a drafter's products through bf16 blocked copies (AVX512-BF16 here) ran an EAGLE-3 head's five
chain-5 steps' products in 2.2 ms instead of MKL fp32's 5.7, but its drafts then depend on the path and row count
(graph against step-by-step drafts, a padded catch-up against its recomputation, a self-draft's full acceptance:
~30 CPU tests of those invariants failed), so drafters keep fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PACKED_MIN_ROWS, PACKED_MAX_ROWS = 3, 16
ROWS_HINT = 8  # the row count the blocked layout is chosen for: 4 and 16 measured the same, 8 never worse


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available()


@dataclass(frozen=True)
class BlockedWeight:
    """A weight [out, in] (and its bias) in oneDNN's blocked layout, and the products it serves: fp32 rows on CPU,
    PACKED_MIN_ROWS..PACKED_MAX_ROWS of them, outside autograd (the copy has no gradient)."""

    weight: torch.Tensor  # opaque (torch.ops.mkldnn._reorder_linear_weight)
    bias: torch.Tensor | None
    out_features: int

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "BlockedWeight":
        blocked = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
        return cls(blocked, None if bias is None else bias.detach(), weight.shape[0])

    def takes(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        return (x.is_cpu and x.dtype == torch.float32 and PACKED_MIN_ROWS <= rows <= PACKED_MAX_ROWS
                and not ((x.requires_grad or weight.requires_grad) and torch.is_grad_enabled()))

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] @ W^T (+ bias) -> [..., out]."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)
