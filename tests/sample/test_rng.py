"""The counter-based uniforms must stay strictly inside (0, 1) in float32: a 1.0 would make the exponential
race compute 0/0 for zero-probability tokens and let argmax pick one."""

import pytest
import torch

from hyperdraft.sample import rng


@pytest.fixture
def uncached_index_hashes():
    """rng caches each draw width's index hashes: a patched hash_u32 must neither read nor leave cached values (it
    once poisoned every later test's draws)."""
    rng._index_hashes.cache_clear()
    yield
    rng._index_hashes.cache_clear()


def test_extreme_hash_values_map_strictly_inside_the_unit_interval(monkeypatch, uncached_index_hashes):
    for extreme in (0xFFFFFFFF, 0):
        monkeypatch.setattr(rng, "hash_u32", lambda x, e=extreme: torch.full_like(x, e))
        u = rng.uniform(torch.arange(3), torch.zeros(3, dtype=torch.int64), rng.DOMAIN_SAMPLE, 5)
        assert u.min() > 0 and u.max() < 1, (extreme, u)


def test_uniform_extremes_over_many_draws():
    u = rng.uniform(torch.arange(64), torch.zeros(64, dtype=torch.int64), rng.DOMAIN_SAMPLE, 1 << 16)
    assert u.dtype == torch.float32 and u.min() > 0 and u.max() < 1


def test_zero_probability_tokens_are_never_sampled():
    probs = torch.zeros(4096, 1000)
    probs[:, 7] = 1.0
    tokens = rng.sample_from_probs(probs, torch.arange(4096), torch.zeros(4096, dtype=torch.int64), rng.DOMAIN_SAMPLE)
    assert (tokens == 7).all()
