"""Pure-PyTorch paged attention: runs on CPU and CUDA, and is the reference.

Requests are padded to [B, Qmax] queries and [B, Kmax] keys. Keys are
gathered from the paged pool in sequence order, so key j of request b is the
token at sequence index j. The mask is built once per forward and shared by
all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyperdraft.attention.base import AttentionBackend
from hyperdraft.core.forward_batch import ForwardBatch
from hyperdraft.kernels.rope import apply_rope_reference


@dataclass
class TorchAttentionMeta:
    kv_slots: torch.Tensor  # [B, Kmax] pool slot of each key, padding -> slot 0 (the dummy page)
    q_index: torch.Tensor  # [B, Qmax] packed row of each query, padding -> T (a zero row)
    mask: torch.Tensor  # [B, 1, Qmax, Kmax] bool, True = may attend
    valid: torch.Tensor  # [B, Qmax] bool, real queries
    all_valid: bool  # every request has Qmax queries (decodes, verifies): no padding to drop


class TorchAttentionBackend(AttentionBackend):
    def plan(self, fb: ForwardBatch) -> TorchAttentionMeta:
        device = fb.input_ids.device
        ext = torch.tensor(fb.extend_lens, dtype=torch.int64, device=device)
        # The device lengths, where a batch has them: a verify queued ahead knows each request's length only there,
        # and its host lists hold an upper bound (speculative/verify_ahead.py), which serves as kmax.
        if fb.seq_lens_t is not None:
            seq_lens = fb.seq_lens_t.to(torch.int64)
        else:
            seq_lens = torch.tensor(fb.seq_lens, dtype=torch.int64, device=device)
        prefix = seq_lens - ext
        kmax, qmax = max(fb.seq_lens), max(fb.extend_lens)
        key_pos = torch.arange(kmax, device=device)
        kv_slots = self.page_table.slots(fb.req_rows, key_pos.expand(fb.batch_size, kmax))
        kv_slots = torch.where(key_pos[None] < seq_lens[:, None], kv_slots, torch.zeros_like(kv_slots))

        q_off = torch.arange(qmax, device=device)
        starts = torch.cumsum(ext, 0) - ext
        valid = q_off[None] < ext[:, None]
        q_index = torch.where(valid, starts[:, None] + q_off[None], torch.full_like(valid, fb.num_tokens, dtype=torch.int64))

        # Causal default: query i (sequence index prefix+i) sees keys 0..prefix+i.
        mask = key_pos[None, None, :] <= (prefix[:, None] + q_off[None])[:, :, None]
        if fb.tail_mask is not None:
            mask = self._apply_tail_mask(fb.tail_mask, seq_lens, key_pos, qmax)
        mask &= (key_pos[None, None, :] < seq_lens[:, None, None])
        mask |= ~valid[:, :, None]  # padded queries attend to something so softmax stays finite
        return TorchAttentionMeta(kv_slots, q_index, mask[:, None], valid, min(fb.extend_lens) == qmax)

    @staticmethod
    def _apply_tail_mask(tail: torch.Tensor, seq_lens: torch.Tensor, key_pos: torch.Tensor, qmax: int) -> torch.Tensor:
        """tail: [B, Q, W] over the last W keys -> [B, qmax, Kmax]; keys before the tail are visible."""
        bsz, q, w = tail.shape
        rel = key_pos[None, :] - (seq_lens[:, None] - w)  # [B, Kmax] index into the tail, < 0 before it
        picked = tail[:, :qmax].gather(2, rel.clamp(0, w - 1)[:, None, :].expand(bsz, min(q, qmax), -1))
        if q < qmax:
            picked = torch.cat([picked, picked.new_zeros(bsz, qmax - q, picked.shape[2])], 1)
        return torch.where((rel >= 0)[:, None, :], picked, torch.ones_like(picked))

    def forward(self, layer_id, q, k, v, fb, meta: TorchAttentionMeta, rope=None):
        if rope is not None:
            q, k = apply_rope_reference(q, k, *rope)
        self.pool.store(layer_id, fb.out_slots, k, v)
        k_cache, v_cache = self.pool.layer(layer_id)
        keys, values = (gathered(cache, meta.kv_slots) for cache in (k_cache, v_cache))  # [B, Hkv, Kmax, D]
        q_pad = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[meta.q_index].transpose(1, 2)  # [B, Hq, Qmax, D]
        out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=meta.mask, enable_gqa=True)
        out = out.transpose(1, 2)  # [B, Qmax, Hq, D]
        if meta.all_valid:  # a boolean-mask copy cost 37 us a layer in a CPU verify (profiled); a reshape, ~1
            return out.reshape(-1, *out.shape[2:])
        return out[meta.valid]  # packed order == request order, so this is [T, Hq, D]


def gathered(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [S, Hkv, D], slots [B, K] -> [B, Hkv, K, D]. index_select, not cache[slots]: the same bits, and on CPU
    5x faster (1024 keys of SmolLM2's shape: 45 against 241 us a layer); SmolLM2's plain decode after a 900-token
    prompt ran 5% faster, no change at 100-300 tokens (benchmarks/results/real_accept_cpu.md, session 36)."""
    return cache.index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[1:]).transpose(1, 2)
