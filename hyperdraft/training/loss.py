"""The loss of one unrolled draft step, per position.

Terms (shapes: B samples, n positions, Vd draft-vocabulary ids):
  soft [B, n, Vd]     the target's distribution over the draft vocabulary (softmax of its logits there)
  log_q [B, n, Vd]    the head's log-probabilities over the same ids
  top [B, n]          the target's argmax as a draft-vocabulary index; top_ok [B, n] False where that argmax is not
                      in the draft vocabulary (no draft can propose it)

loss = (1 - w) * CE(soft, q) + w * CE(one-hot(top), q), with w = hard_weight; where top_ok is False, CE(soft, q) alone.

Why a hard term: greedy verification accepts a draft only when it is the target's argmax. SmolLM2's misses on
MT-bench are mostly near-ties among common tokens (" the", ",", "."), where the soft label spreads its weight and a
head that matches the distribution well can still rank the two leaders the other way; the hard term pays for the
ranking itself. w = 0 is EAGLE-3's loss, bit for bit.
"""

from __future__ import annotations

import torch


def step_loss(soft: torch.Tensor, log_q: torch.Tensor, top: torch.Tensor, top_ok: torch.Tensor,
              hard_weight: float) -> torch.Tensor:
    """-> [B, n] the per-position loss (see the module docstring)."""
    soft_ce = -(soft * log_q).sum(-1)
    if hard_weight == 0:
        return soft_ce
    hard_ce = -log_q.gather(-1, top[..., None]).squeeze(-1)
    return torch.where(top_ok, (1 - hard_weight) * soft_ce + hard_weight * hard_ce, soft_ce)


def draft_index(draft_ids: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_ids [Vd] ascending target ids; target_ids [...] -> (their draft-vocabulary indices, clamped into range;
    whether each id is in the draft vocabulary)."""
    index = torch.searchsorted(draft_ids, target_ids).clamp_max(draft_ids.numel() - 1)
    return index, draft_ids[index] == target_ids
