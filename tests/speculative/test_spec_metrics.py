"""SpecMetrics.observe counts per position from per-request ends; the same counters as a walk over every
(request, position)."""

from __future__ import annotations

import random

from hyperdraft.speculative.metrics import SpecMetrics


def _reference(m: SpecMetrics, lens, num_accepted, proposed=None) -> None:
    m.verify_forwards += 1
    for i, (k, a) in enumerate(zip(lens, num_accepted)):
        m.verifies += 1
        m.draft_tokens += proposed[i] if proposed is not None else k
        m.accepted_tokens += a
        m.emitted_tokens += a + 1
        m.accept_length_hist[a + 1] += 1
        for j in range(k):
            m.proposed_by_position[j] += 1
            m.accepted_by_position[j] += j < a


def test_observe_equals_walk_over_positions():
    rng = random.Random(0)
    for k_max in (1, 3, 6):
        got, expect = SpecMetrics(k_max), SpecMetrics(k_max)
        for _ in range(200):
            lens = [rng.randint(0, k_max) for _ in range(rng.randint(0, 9))]
            accepted = [rng.randint(0, k) for k in lens]
            proposed = [rng.randint(0, 9) for _ in lens] if rng.random() < 0.5 else None
            got.observe(lens, accepted, proposed)
            _reference(expect, lens, accepted, proposed)
        assert vars(got) == vars(expect)
        assert 0 < got.summary()["spec_acceptance_rate"] < 1


def test_observe_idle_equals_observe_of_no_drafts():
    """A step-0 step's O(1) update leaves every counter where observe() of zero drafts per request leaves it."""
    got, expect = SpecMetrics(4), SpecMetrics(4)
    for m in (got, expect):
        m.observe([3, 1], [2, 0])
    for n in (1, 5, 256):
        got.observe_idle(n)
        expect.observe([0] * n, [0] * n, proposed=[0] * n)
    assert vars(got) == vars(expect)
