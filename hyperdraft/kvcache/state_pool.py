"""StatePool: the recurrent state of a hybrid model's Gated DeltaNet layers, one slot per running request.

A K/V cache rolls back by length; a recurrent state cannot: it is one fixed-size tensor folded over every token. So a
request's committed state lives in its slot, and a speculative verify never touches it: the state after each verified
token goes to a scratch slot of its own, and after acceptance one batched copy over all layers moves the state after
the last accepted token into the committed slot (commit). Rejected tokens leave nothing behind.

Slots follow the page table's rows: the request in row r owns slot r + 1. Slot 0 belongs to no request: padding rows of
a captured CUDA graph read and write it.

  conv               [L, S, C, K-1]        the last K-1 conv inputs (model dtype)
  recurrent          [L, S, HV, dk, dv]    the recurrence's state (state dtype, fp32 by default)
  conv_scratch       [L, S, W, C, K-1]     after verify token j of the request in slot s: [:, s, j]
  recurrent_scratch  [L, S, W, HV, dk, dv]
L: Gated DeltaNet layers, S: rows + 1, W: the widest verify any tier can run (0 without speculation). Whoever indexes
the scratch reads W from the buffer's own shape, never from the round at hand.
"""

from __future__ import annotations

import torch

from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels.gated_delta_walk import commit_states
from hyperdraft.models.config import LinearAttentionConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StatePool:
    def __init__(self, cfg: LinearAttentionConfig, num_layers: int, max_rows: int, dtype: torch.dtype,
                 device: torch.device, verify_width: int = 0):
        self.cfg = cfg
        slots, k = max_rows + 1, cfg.conv_kernel - 1
        state_dtype = DTYPES[cfg.state_dtype]
        self.conv = torch.zeros(num_layers, slots, cfg.conv_dim, k, dtype=dtype, device=device)
        self.recurrent = torch.zeros(num_layers, slots, cfg.num_v_heads, cfg.k_head_dim, cfg.v_head_dim,
                                     dtype=state_dtype, device=device)
        width = max(verify_width, 0)
        self.conv_scratch = torch.zeros(num_layers, slots, width, cfg.conv_dim, k, dtype=dtype, device=device)
        self.recurrent_scratch = torch.zeros(num_layers, slots, width, cfg.num_v_heads, cfg.k_head_dim,
                                             cfg.v_head_dim, dtype=state_dtype, device=device)

    @property
    def verify_width(self) -> int:
        return self.conv_scratch.shape[2]

    @staticmethod
    def bytes_per_slot(cfg: LinearAttentionConfig, num_layers: int, dtype: torch.dtype, verify_width: int) -> int:
        state = cfg.num_v_heads * cfg.k_head_dim * cfg.v_head_dim * DTYPES[cfg.state_dtype].itemsize
        conv = cfg.conv_dim * (cfg.conv_kernel - 1) * dtype.itemsize
        return num_layers * (1 + max(verify_width, 0)) * (state + conv)

    def commit(self, rows: torch.Tensor, index: torch.Tensor) -> None:
        """rows [B]: page-table rows; index [B]: the scratch entry whose state becomes each request's committed one
        (its last accepted token), -1 to keep the committed state. One gather and one scatter over every layer."""
        if use_fused_kernels(self.conv):  # one launch per buffer (kernels/gated_delta_walk.py)
            commit_states(self.conv, self.conv_scratch, rows + 1, index)
            commit_states(self.recurrent, self.recurrent_scratch, rows + 1, index)
            return
        slots, keep = rows + 1, (index < 0)[None, :, None]
        index = index.clamp_min(0)
        self.conv[:, slots] = torch.where(keep[..., None], self.conv[:, slots], self.conv_scratch[:, slots, index])
        self.recurrent[:, slots] = torch.where(keep[..., None, None], self.recurrent[:, slots],
                                               self.recurrent_scratch[:, slots, index])
