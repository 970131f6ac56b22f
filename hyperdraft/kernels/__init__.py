"""Triton kernels for CUDA, each beside a plain-torch reference of the same signature.

Nothing here imports triton at module load: CPU machines (CI included) have no triton, and `import hyperdraft`
must work there. Each kernel module imports it inside its launcher; the references need only torch.

- attention.py: paged attention (decode, extend over a cached prefix, tree-masked verify), split-K + merge
- kv_store.py: new K/V into the paged pool (one launch for K and V)
- kv_move.py: the accepted-path compaction copy, every layer, gather-then-scatter
"""

from __future__ import annotations

import functools


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
