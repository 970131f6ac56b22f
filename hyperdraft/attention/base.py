"""The attention-backend contract.

A backend turns a ForwardBatch into backend-specific metadata once per
forward (plan), then serves every layer from it (forward). It also owns the
store of new K/V into the paged pool, because the fastest backends fuse the
two.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from hyperdraft.core.forward_batch import ForwardBatch
from hyperdraft.kvcache.kv_pool import KVPool
from hyperdraft.kvcache.page_table import PageTable


class AttentionBackend(ABC):
    def __init__(self, pool: KVPool, page_table: PageTable):
        self.pool = pool
        self.page_table = page_table

    @abstractmethod
    def plan(self, fb: ForwardBatch) -> Any:
        """Build per-forward metadata shared by every layer."""

    @abstractmethod
    def forward(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, meta: Any,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens -> [T, Hq, D]. Stores k/v first. rope: (cos, sin)
        when q and k are not yet rotated (models/decoder.py AttentionFn): rotated before the store and the attention."""
