"""benchmarks/e2e/gpu_bench_report.py's expected accept length of a finite run (the 'E_run' column): exact values at the
edges, and the untruncated E in the long limit."""

from __future__ import annotations

import random

import pytest

from benchmarks.e2e.gpu_bench_report import expected_run_accept, expected_tokens


def test_edges_and_long_limit():
    assert expected_run_accept(0.8, 5, 1) == pytest.approx(1.0)  # one token: one round, whatever it accepts
    assert expected_run_accept(1.0, 5, 60) == pytest.approx(6.0)  # every draft accepted: 10 rounds of 6
    assert expected_run_accept(0.0, 5, 60) == pytest.approx(1.0)
    assert expected_run_accept(0.8, 5, 200_000) == pytest.approx(expected_tokens(0.8, 5), rel=1e-4)
    assert expected_run_accept(0.8, 5, 255) < expected_tokens(0.8, 5)  # the cut last round


def test_matches_a_simulation():
    """Pooled accept length of 20000 simulated 255-token runs (fixed seed). Its standard error is ~0.0016 tokens
    (one 255-token run's accept length has a standard deviation of ~0.23), so the 0.01 tolerance is ~6 standard
    errors: a false failure has probability below 1e-8."""
    rng = random.Random(7)
    tokens_total = rounds_total = 0
    for _ in range(20000):
        left = 255
        while left:
            a = 0
            while a < 5 and rng.random() < 0.8:
                a += 1
            left -= min(a + 1, left)
            rounds_total += 1
        tokens_total += 255
    assert tokens_total / rounds_total == pytest.approx(expected_run_accept(0.8, 5, 255), abs=0.01)


def test_accept_draws_replay_the_gpu_runs_draws():
    """benchmarks/e2e/accept_draws.py replays gpu_bench's request order on the CPU: its draws for the batch-1 rows at
    alpha 0.8 are the accept lengths the H100 run measured (benchmarks/results/gpu_bench_h100.md: chain 5 3.58,
    chain 3 2.88, both 24 runs). Deterministic: the coins are a function of seed and position only."""
    from benchmarks.e2e.accept_draws import bench_seeds, pooled_accept

    seeds = bench_seeds((1, 8, 32))[(0.8, 1)]
    assert len(seeds) == 24
    assert round(pooled_accept(seeds, 0.8, 5, 512, 256), 2) == 3.58
    assert round(pooled_accept(seeds, 0.8, 3, 512, 256), 2) == 2.88
