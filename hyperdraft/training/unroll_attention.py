"""The attention of EAGLE-3's training-time test: every draft step of every anchor, in one pass per step.

At inference a head extends over the committed tokens (step 0, fed the target's hidden states) and then drafts
step by step, each step fed its own previous output (models/eagle.py). Training simulates that for every anchor
position at once. For head position i (its RoPE position; it predicts token i + 2), the query of step s sees:
  - step 0's keys at positions 0 .. i - s (the extend before the anchor n = i - s + 1), and
  - step j's key at position i - s + j, for j = 1 .. s (its own chain: one key per earlier step, a diagonal).
Step s's own key at position i is always visible, so no row is empty. The diagonal keys cost N dot products per
step instead of an N x N block: scores are [heads, N, N + s], not [heads, N, (s + 1) N].

Called as the head's AttentionFn, attn(layer_id, q, k, v) with q [N, Hq, D], k and v [N, Hkv, D]; the caller runs
steps 0, 1, ... in order after `start()`.
"""

from __future__ import annotations

import math

import torch


class UnrollAttention:
    def __init__(self):
        self.keys: list[torch.Tensor] = []  # per step: [N, Hkv, D]
        self.values: list[torch.Tensor] = []

    def start(self) -> None:
        """A new sequence: forget the keys and values of the last one."""
        self.keys, self.values = [], []

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        step, (n, heads, dim) = len(self.keys) - 1, q.shape
        group = heads // k.shape[1]
        expand = lambda t: t.repeat_interleave(group, dim=1)  # noqa: E731 - [N, Hkv, D] -> [N, Hq, D]
        qh = q.transpose(0, 1) / math.sqrt(dim)  # [Hq, N, D]
        k0, v0 = expand(self.keys[0]).transpose(0, 1), expand(self.values[0]).transpose(0, 1)
        scores = [qh @ k0.transpose(1, 2)]  # [Hq, N, N] against step 0
        rows = torch.arange(n, device=q.device)
        visible = [rows[None, :] <= rows[:, None] - step]  # [N, N]
        diagonal_values = []
        for j in range(1, step + 1):
            at = rows - step + j  # the key of step j that row i sees
            kj = expand(self.keys[j])[at.clamp_min(0)].transpose(0, 1)  # [Hq, N, D]
            scores.append((qh * kj).sum(-1, keepdim=True))  # [Hq, N, 1]
            visible.append((at >= 0)[:, None])
            diagonal_values.append(expand(self.values[j])[at.clamp_min(0)].transpose(0, 1))
        mask = torch.cat(visible, dim=1)  # [N, N + step]
        probs = torch.softmax(torch.cat(scores, dim=-1).masked_fill(~mask, float("-inf")), dim=-1)
        out = probs[..., :n] @ v0  # [Hq, N, D]
        for j, vj in enumerate(diagonal_values):
            out = out + probs[..., n + j:n + j + 1] * vj
        return out.transpose(0, 1)  # [N, Hq, D]
