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


def jit(fn=None, *, do_not_specialize: tuple[str, ...] = ()):
    """triton.jit where triton exists. do_not_specialize: integer arguments that follow the batch or the tier (a row,
    request or split count, a tier's width or depth, a stride set by either): Triton otherwise compiles the kernel
    again when one of them first equals 1 or a multiple of 16, a second or so in the middle of serving
    (tests/gpu/test_compiles.py)."""
    if fn is None:
        return lambda f: jit(f, do_not_specialize=do_not_specialize)
    return triton.jit(fn, do_not_specialize=list(do_not_specialize)) if triton is not None else fn
