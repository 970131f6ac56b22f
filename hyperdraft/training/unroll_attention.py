"""The attention of EAGLE-3's training-time test: every draft step of every anchor, in one pass per step.

At inference a head extends over the committed tokens (step 0, fed the target's hidden states) and then drafts
step by step, each step fed its own previous output (models/eagle.py). Training simulates that for every anchor
position at once. For head position i (its RoPE position; it predicts token i + 2), the query of step s sees:
  - step 0's keys at positions 0 .. i - s (the extend before the anchor n = i - s + 1), and
  - step j's key at position i - s + j, for j = 1 .. s (its own chain: one key per earlier step, a diagonal).
Step s's own key at position i is always visible, so no row is empty. The diagonal keys cost N dot products per
step instead of an N x N block: scores are [heads, N, N + s], not [heads, N, (s + 1) N].

Called as the head's AttentionFn, attn(layer_id, q, k, v) with q [B * N, Hq, D], k and v [B * N, Hkv, D]: B
sequences of N positions each (padded to one length), each attending only within itself; the caller runs steps
0, 1, ... in order after `start()`.
"""

from __future__ import annotations

import math

import torch

from hyperdraft.models.decoder import rotated


class UnrollAttention:
    def __init__(self, batch: int = 1):
        self.batch = batch
        self.keys: list[torch.Tensor] = []  # per step: [B * N, Hkv, D]
        self.values: list[torch.Tensor] = []

    def start(self) -> None:
        """A new sequence: forget the keys and values of the last one."""
        self.keys, self.values = [], []

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope=None) -> torch.Tensor:
        q, k = rotated(q, k, rope)
        self.keys.append(k)
        self.values.append(v)
        step, (total, heads, dim), b = len(self.keys) - 1, q.shape, self.batch
        n, group = total // b, heads // k.shape[1]

        def per_sequence(t: torch.Tensor) -> torch.Tensor:  # [B * N, Hkv, D] -> [B, N, Hq, D]
            return t.repeat_interleave(group, dim=1).view(b, n, heads, dim)

        qh = q.view(b, n, heads, dim).transpose(1, 2) / math.sqrt(dim)  # [B, Hq, N, D]
        k0, v0 = (per_sequence(t[0]).transpose(1, 2) for t in (self.keys, self.values))
        scores = [qh @ k0.transpose(-1, -2)]  # [B, Hq, N, N] against step 0
        rows = torch.arange(n, device=q.device)
        visible = [rows[None, :] <= rows[:, None] - step]  # [N, N]
        diagonal_values = []
        for j in range(1, step + 1):
            at = (rows - step + j).clamp_min(0)  # the key of step j that row i sees (none before row step - j)
            kj = per_sequence(self.keys[j])[:, at].transpose(1, 2)  # [B, Hq, N, D]
            scores.append((qh * kj).sum(-1, keepdim=True))  # [B, Hq, N, 1]
            visible.append((rows - step + j >= 0)[:, None])
            diagonal_values.append(per_sequence(self.values[j])[:, at].transpose(1, 2))
        mask = torch.cat(visible, dim=1)  # [N, N + step]
        probs = torch.softmax(torch.cat(scores, dim=-1).masked_fill(~mask, float("-inf")), dim=-1)
        out = probs[..., :n] @ v0  # [B, Hq, N, D]
        for j, vj in enumerate(diagonal_values):
            out = out + probs[..., n + j:n + j + 1] * vj
        return out.transpose(1, 2).reshape(total, heads, dim)
