"""training/loss.py on hand-made distributions: the soft term, the hard term, their mix, and the draft-vocabulary
lookup of the target's argmax."""

from __future__ import annotations

import math

import torch

from hyperdraft.training.loss import draft_index, step_loss


def _case():
    soft = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])  # [B=1, n=2, Vd=3]
    log_q = torch.log(torch.tensor([[[0.2, 0.7, 0.1], [0.25, 0.25, 0.5]]]))
    top = torch.tensor([[0, 2]])  # the target's argmax as draft indices
    return soft, log_q, top


def test_weight_zero_is_the_soft_cross_entropy_bit_for_bit():
    soft, log_q, top = _case()
    ok = torch.ones_like(top, dtype=torch.bool)
    assert torch.equal(step_loss(soft, log_q, top, ok, 0.0), -(soft * log_q).sum(-1))


def test_weight_one_is_the_hard_cross_entropy_where_the_argmax_is_drafted():
    soft, log_q, top = _case()
    ok = torch.tensor([[True, False]])  # position 1's argmax is outside the draft vocabulary: the soft term alone
    loss = step_loss(soft, log_q, top, ok, 1.0)
    assert math.isclose(float(loss[0, 0]), -math.log(0.2), rel_tol=1e-6)
    assert math.isclose(float(loss[0, 1]), float(-(soft[0, 1] * log_q[0, 1]).sum()), rel_tol=1e-6)


def test_a_weight_between_mixes_the_two():
    soft, log_q, top = _case()
    ok = torch.ones_like(top, dtype=torch.bool)
    soft_ce, hard_ce = step_loss(soft, log_q, top, ok, 0.0), step_loss(soft, log_q, top, ok, 1.0)
    torch.testing.assert_close(step_loss(soft, log_q, top, ok, 0.25), 0.75 * soft_ce + 0.25 * hard_ce)
    assert not torch.allclose(soft_ce, hard_ce)


def test_draft_index_finds_ids_and_flags_the_missing():
    draft_ids = torch.tensor([3, 7, 20, 41])
    index, present = draft_index(draft_ids, torch.tensor([[7, 41, 5], [3, 99, 20]]))
    assert present.tolist() == [[True, True, False], [True, False, True]]
    assert index[present].tolist() == [1, 3, 0, 2]
    assert bool((index >= 0).all() and (index < 4).all())  # in range even where missing: safe to gather
