"""SamplingBatchCache: over steps of the same requests it returns what a fresh SamplingBatch.build returns (penalty
counts updated in place from the new output tokens), and it rebuilds when the batch's requests or order change."""

from __future__ import annotations

import random

import torch

from hyperdraft import SamplingParams
from hyperdraft.request import Request
from hyperdraft.sample.batch_cache import SamplingBatchCache
from hyperdraft.sample.logits_ops import SamplingBatch

V = 11


def _fresh(reqs) -> SamplingBatch:
    return SamplingBatch.build([r.params for r in reqs], [r.seed for r in reqs], [r.seq_len for r in reqs], V, "cpu",
                               prompts=[r.prompt_ids for r in reqs], outputs=[r.output_ids for r in reqs])


def _assert_same(a: SamplingBatch, b: SamplingBatch) -> None:
    for name in ("temperature", "top_k", "top_p", "min_p", "greedy", "seeds", "positions"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.penalties is None) == (b.penalties is None)
    if a.penalties is not None:
        for name in ("output_counts", "seen", "frequency", "presence", "repetition"):
            assert torch.equal(getattr(a.penalties, name), getattr(b.penalties, name)), name
    flags = ("need_top_k", "need_top_p", "need_min_p", "all_greedy", "any_greedy")
    assert [getattr(a, f) for f in flags] == [getattr(b, f) for f in flags]


def test_cached_batches_equal_fresh_builds():
    rng = random.Random(0)
    params = [SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.2),
              SamplingParams(temperature=0.0), SamplingParams(top_k=3, presence_penalty=0.5), SamplingParams(top_p=0.8)]
    reqs = [Request(f"r{i}", [rng.randrange(V) for _ in range(3 + i)], p, seed=i) for i, p in enumerate(params)]
    cache = SamplingBatchCache(V, "cpu")
    for step in range(6):
        _assert_same(cache.get(reqs), _fresh(reqs))
        for r in reqs:  # a speculative step appends several tokens, some none
            r.output_ids += [rng.randrange(V) for _ in range(rng.randint(0, 3))]
    assert cache.builds == 1
    _assert_same(cache.get(reqs[::-1]), _fresh(reqs[::-1]))  # another order: rebuilt
    _assert_same(cache.get(reqs[:2]), _fresh(reqs[:2]))  # a request left: rebuilt
    assert cache.builds == 3
    plain = [Request("p", [1, 2], SamplingParams(temperature=0.5), seed=9)]
    _assert_same(cache.get(plain), _fresh(plain))
    plain[0].output_ids.append(4)
    _assert_same(cache.get(plain), _fresh(plain))
    assert cache.builds == 4
