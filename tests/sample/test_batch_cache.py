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


def test_changed_batches_carry_penalty_rows_and_read_only_new_requests_tokens(monkeypatch):
    """Joins, finishes and reorders: every batch equals a fresh build, while only the tokens of penalised requests
    the previous batch did not hold are read on the host (each was read again on every change: the whole batch's
    prompts and outputs, per token in Python)."""
    import hyperdraft.sample.batch_cache as batch_cache
    import hyperdraft.sample.logits_ops as logits_ops

    read = []
    real = logits_ops.flat_token_index

    def counting(lists, vocab_size, first_row=0):
        read.append(sum(len(x) for x in lists))
        return real(lists, vocab_size, first_row)

    rng = random.Random(1)
    pen = dict(temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.1)
    reqs = [Request(f"r{i}", [rng.randrange(V) for _ in range(20 + i)],
                    SamplingParams(**pen) if i % 3 else SamplingParams(temperature=0.5), seed=i) for i in range(7)]
    cache = SamplingBatchCache(V, "cpu")
    running = reqs[:4]
    _assert_same(cache.get(running), _fresh(running))
    monkeypatch.setattr(logits_ops, "flat_token_index", counting)
    monkeypatch.setattr(batch_cache, "flat_token_index", counting)
    for step, change in enumerate(["join", "leave", "reverse", "join", "leave", "join"]):
        for r in running:
            r.output_ids += [rng.randrange(V) for _ in range(rng.randint(0, 3))]
        held = set(map(id, running))
        if change == "join":
            running = running + [r for r in reqs if id(r) not in held][:1]
        elif change == "leave":
            running = running[1:]
        else:
            running = running[::-1]
        read.clear()
        got = cache.get(running)
        fresh_tokens = sum(len(r.prompt_ids) + 2 * len(r.output_ids) for r in running
                           if r.params.has_penalties and id(r) not in held)
        monkeypatch.setattr(logits_ops, "flat_token_index", real)
        _assert_same(got, _fresh(running))
        monkeypatch.setattr(logits_ops, "flat_token_index", counting)
        carried_new = sum(len(r.output_ids) for r in running if r.params.has_penalties and id(r) in held)
        assert sum(read) <= fresh_tokens + carried_new, (step, change, read)
        # what a rebuild of every row read: the prompt and twice the outputs of every request
        assert sum(read) < sum(len(r.prompt_ids) + 2 * len(r.output_ids) for r in running), (step, change)
    assert cache.builds == 7


def test_rows_without_penalties_give_the_same_logits_without_counts():
    """SamplingBatch.build counts only penalised rows' tokens; the other rows' weights (repetition 1, frequency and
    presence 0) leave their logits bit for bit unchanged whatever their counts."""
    from hyperdraft.sample.logits_ops import Penalties, flat_token_index, penalised_logits

    rng = random.Random(2)
    params = [SamplingParams(temperature=0.7, repetition_penalty=1.4, frequency_penalty=0.4, presence_penalty=0.2),
              SamplingParams(temperature=0.9), SamplingParams(temperature=0.0), SamplingParams(presence_penalty=0.6)]
    prompts = [[rng.randrange(V) for _ in range(9)] for _ in params]
    outputs = [[rng.randrange(V) for _ in range(6)] for _ in params]
    sb = SamplingBatch.build(params, [1, 2, 3, 4], [15] * 4, V, "cpu", prompts=prompts, outputs=outputs)
    assert sb.penalties.output_counts[1:3].sum() == 0 and not sb.penalties.seen[1:3].any()
    every = Penalties.from_flat(4, V, torch.tensor(flat_token_index(outputs, V)),
                                torch.tensor(flat_token_index([p + o for p, o in zip(prompts, outputs)], V)),
                                sb.penalties.frequency, sb.penalties.presence, sb.penalties.repetition)
    logits = torch.randn(4, V) * 3
    counted_everywhere = SamplingBatch.build(params, [1, 2, 3, 4], [15] * 4, V, "cpu", prompts=prompts,
                                             outputs=outputs)
    counted_everywhere.penalties = every
    assert torch.equal(penalised_logits(logits, sb), penalised_logits(logits, counted_everywhere))
