"""benchmarks/probes/sampled_accept.sampled_overlap: sum_x min(p_T, q_T) on distributions whose overlap is known."""

from __future__ import annotations

import math

import torch

from benchmarks.probes.sampled_accept import sampled_overlap


def test_a_head_equal_to_the_target_over_its_whole_vocabulary_is_always_accepted():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    overlap = sampled_overlap(logits, logits, torch.arange(7), 0.7)
    torch.testing.assert_close(overlap, torch.ones(3))


def test_mass_outside_the_draft_vocabulary_is_never_accepted():
    # p: 1/2 on id 0, 1/2 on id 1; the head can only say id 1 (its whole mass): min(p, q) = 1/2
    target = torch.log(torch.tensor([[0.5, 0.5, 1e-30]]))
    overlap = sampled_overlap(target, torch.zeros(1, 1), torch.tensor([1]), 1.0)
    assert math.isclose(float(overlap[0]), 0.5, rel_tol=1e-6)


def test_temperature_applies_to_both_sides():
    target, draft = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 2.0]])  # mirror images
    at = {t: float(sampled_overlap(target, draft, torch.arange(2), t)[0]) for t in (0.5, 1.0, 2.0)}
    for t, value in at.items():  # min(p, q) sums to twice the smaller probability, 2 / (1 + e^(2/T))
        assert math.isclose(value, 2 / (1 + math.exp(2 / t)), rel_tol=1e-6)
    assert at[0.5] < at[1.0] < at[2.0]
