"""The optional triton import every kernel module shares: CPU machines (CI included) have no triton, and there the
kernels stay plain functions that are never launched (each module's torch reference is the path)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None
try:
    from triton.language.extra import libdevice  # the CUDA math library: expf, cosf, ... as torch's kernels compute them
except ImportError:
    libdevice = None


def jit(fn):
    return triton.jit(fn) if triton is not None else fn
