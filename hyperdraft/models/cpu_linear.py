"""Linear layers that pick a fast MKL kernel for the few-token products of decoding and verifying on CPU.

`F.linear(x, W)` with x [M, in] asks MKL for sgemm(W, x^T) with the token count M as the *narrow output
dimension*; for M = 1..8 MKL then runs a kernel that reaches only 8-20 GB/s of memory bandwidth on fp32 weights
(measured on AMD EPYC with 2 threads, SmolLM2-135M: 34 ms per token at M = 1, 50-65 ms at M = 2..8). The same
product written as `W @ x^T` puts M on the *other* side of the call, and MKL's kernel for that case streams the
weights at 30-38 GB/s for M = 2..4, so a 4-token verify costs about half of today's 1-token decode. A single
row is the exception: `W @ x^T` with M = 1 becomes a gemv as slow as F.linear, so it is padded to two rows.

From M = 12 up both calls run the same kernel (bit-identical results), so wider inputs keep F.linear. Only CPU
float32 takes this path: CUDA, half precision and autograd callers get plain F.linear. Results differ from
F.linear by float32 rounding only (another summation order), the same order of difference as between two M.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows, `W @ x^T` beats F.linear; above it MKL picks the same kernel for both.
SKINNY_MAX_ROWS = 8
ENABLED = True  # a switch for A/B measurements against plain F.linear


def uses_skinny_path(x: torch.Tensor, weight: torch.Tensor) -> bool:
    rows = x.numel() // max(x.shape[-1], 1)
    return (ENABLED and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and 0 < rows <= SKINNY_MAX_ROWS and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., in]; the fast orientation when uses_skinny_path holds."""
    if not uses_skinny_path(x, weight):
        return F.linear(x, weight, bias)
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width).contiguous()  # x^T must be a transposed view of row-major rows to hit the fast kernel
    m = rows.shape[0]
    if m == 1:
        rows = torch.cat([rows, rows.new_zeros(1, width)])
    out = weight @ rows.t()  # [out, m (or 2)]
    if bias is not None:
        out += bias[:, None]
    return out[:, :m].t().contiguous().view(*lead, weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict names) whose forward uses skinny_linear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias)
