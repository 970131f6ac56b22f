"""KVPool: the physical K/V tensors of one model, indexed by page-table slots."""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: [T]; k, v: [T, Hkv, D]."""
        self.k[layer_id].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer_id].index_copy_(0, slots, v.to(self.v.dtype))

    def move(self, dst_slots: torch.Tensor, src_slots: torch.Tensor) -> None:
        """Copy every layer's K/V from src to dst slots (accepted-path compaction). Gather first, so overlaps are safe."""
        from hyperdraft.kernels import triton_available

        if self.k.is_cuda and triton_available():  # two launches for all layers instead of six
            from hyperdraft.kernels.kv_move import kv_move

            return kv_move(self.k, self.v, dst_slots, src_slots)
        self.k[:, dst_slots] = self.k[:, src_slots].clone()
        self.v[:, dst_slots] = self.v[:, src_slots].clone()
