"""The attention backends by name, imported only when chosen (the Triton one needs triton and CUDA)."""

from __future__ import annotations

from hyperdraft.attention.base import AttentionBackend
from hyperdraft.kvcache.kv_pool import KVPool
from hyperdraft.kvcache.page_table import PageTable


def make_attention_backend(name: str, pool: KVPool, page_table: PageTable) -> AttentionBackend:
    if name == "torch":
        from hyperdraft.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(pool, page_table)
    if name == "triton":
        from hyperdraft.kernels import triton_available

        if pool.k.device.type != "cuda":
            raise ValueError(f"attention_backend 'triton' needs a CUDA device, but the model is on {pool.k.device}; "
                             "use attention_backend='torch'")
        if not triton_available():
            raise ValueError("attention_backend 'triton' needs the triton package, which is not installed; "
                             "use attention_backend='torch'")
        from hyperdraft.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(pool, page_table)
    raise ValueError(f"attention_backend {name!r} is not supported; allowed values: 'torch', 'triton'")
