"""Sampling: the logits -> distribution transform, penalties, the counter-based RNG, and seeded sampling end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from conftest import generate_ids, greedy, hf_logits, random_prompts
from hyperdraft import SamplingParams
from hyperdraft.sample.logits_ops import Penalties, SamplingBatch, penalised_logits, probs_from_logits
from hyperdraft.sample.rng import DOMAIN_SAMPLE, sample_from_probs, uniform
from hyperdraft.sample.sampler import Sampler

P = [0.4, 0.3, 0.15, 0.1, 0.05]


def _probs(logits, *params: SamplingParams, prompts=None, outputs=None) -> torch.Tensor:
    n, v = logits.shape
    sb = SamplingBatch.build(list(params), [0] * n, [0] * n, v, "cpu", prompts=prompts, outputs=outputs)
    return probs_from_logits(penalised_logits(logits, sb), sb)


def _dist(**kw) -> torch.Tensor:
    return _probs(torch.tensor([P]).log(), SamplingParams(**kw))[0]


def _renorm(p):
    p = torch.tensor(p, dtype=torch.float32)
    return p / p.sum()


def _assert_dist(got: torch.Tensor, expect):
    expect = torch.as_tensor(expect, dtype=torch.float32)
    assert torch.equal(got > 0, expect > 0), f"support {got} != {expect}"
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6)


def test_no_filter_is_softmax():
    _assert_dist(_dist(), _renorm(P))
    _assert_dist(_dist(top_k=-1, top_p=1.0, min_p=0.0), _renorm(P))
    _assert_dist(_dist(top_k=0), _renorm(P))  # 0 also means the whole vocabulary
    _assert_dist(_dist(top_k=5), _renorm(P))


@pytest.mark.parametrize("k", [2, 3, 4])
def test_top_k(k):
    _assert_dist(_dist(top_k=k), _renorm(P[:k] + [0.0] * (5 - k)))


@pytest.mark.parametrize("top_p,kept", [(0.7, 2), (0.71, 3), (0.4, 1), (0.39, 1), (0.41, 2), (0.85, 3), (0.86, 4),
                                        (0.96, 5), (1.0, 5)])
def test_top_p(top_p, kept):
    """Keep the smallest head whose mass reaches top_p."""
    _assert_dist(_dist(top_p=top_p), _renorm(P[:kept] + [0.0] * (5 - kept)))


@pytest.mark.parametrize("top_p", [1e-30, 1e-50, 5e-324])
def test_top_p_below_float32_range_keeps_the_top_token(top_p):
    """top_p is valid in (0, 1], but one below float32's smallest subnormal is 0 in the batch's tensor: no token's
    preceding mass is below 0, and the empty distribution became 0/0 (every sample token 0)."""
    _assert_dist(_dist(top_p=top_p), [1.0, 0, 0, 0, 0])


@pytest.mark.parametrize("min_p,kept", [(0.3, 3), (0.25, 4), (0.26, 3), (0.76, 1), (0.74, 2), (0.125, 5), (1.0, 1)])
def test_min_p(min_p, kept):
    """Keep p >= min_p * max p: min_p=0.3 -> threshold 0.12 keeps {0.4, 0.3, 0.15}."""
    _assert_dist(_dist(min_p=min_p), _renorm(P[:kept] + [0.0] * (5 - kept)))


def test_filter_combinations():
    # top-p acts on the top-k survivors, renormalised: {0.4,0.3,0.15}/0.85 has head mass 0.47, 0.82 -> keep 2.
    _assert_dist(_dist(top_k=3, top_p=0.8), _renorm([0.4, 0.3, 0, 0, 0]))
    _assert_dist(_dist(top_p=0.8), _renorm([0.4, 0.3, 0.15, 0, 0]))  # the same top_p alone keeps 3
    _assert_dist(_dist(top_k=4, min_p=0.3), _renorm([0.4, 0.3, 0.15, 0, 0]))
    _assert_dist(_dist(top_k=2, min_p=0.3), _renorm([0.4, 0.3, 0, 0, 0]))
    _assert_dist(_dist(top_p=0.9, min_p=0.3), _renorm([0.4, 0.3, 0.15, 0, 0]))
    _assert_dist(_dist(top_k=4, top_p=0.9, min_p=0.5), _renorm([0.4, 0.3, 0, 0, 0]))


def test_temperature():
    for t in (0.5, 0.8, 2.0):
        expect = _renorm([p ** (1 / t) for p in P])
        _assert_dist(_dist(temperature=t), expect)
    # Temperature before top-p: at t=0.5 the distribution is {0.4^2, 0.3^2, ...}/Z = {0.561, 0.316, ...}, so
    # top_p=0.86 keeps 2 tokens (at t=1 it keeps 4).
    sq = _renorm([p ** 2 for p in P])
    assert sq[0] + sq[1] > 0.86 > sq[0]
    _assert_dist(_dist(temperature=0.5, top_p=0.86), _renorm([sq[0], sq[1], 0, 0, 0]))
    _assert_dist(_dist(top_p=0.86), _renorm(P[:4] + [0]))


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(top_k=1), dict(temperature=0.0, top_p=0.1, min_p=0.9)])
def test_greedy_is_one_hot(kw):
    logits = torch.tensor([[0.3, -1.0, 2.5, 2.4, 0.0]])
    _assert_dist(_probs(logits, SamplingParams(**kw))[0], [0, 0, 1, 0, 0])


def test_rows_are_independent():
    """A batch of rows with different parameters equals each row computed alone."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 2
    params = [SamplingParams(top_k=5), SamplingParams(temperature=0), SamplingParams(top_p=0.6, temperature=0.7),
              SamplingParams(min_p=0.2), SamplingParams(), SamplingParams(top_k=10, top_p=0.5, min_p=0.1)]
    batch = _probs(logits, *params)
    for i, p in enumerate(params):
        torch.testing.assert_close(batch[i], _probs(logits[i:i + 1], p)[0], rtol=1e-6, atol=1e-7)
    assert (batch > 0).sum(-1).tolist()[:2] == [5, 1]


def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0],
                           [2.0, -1.0, 0.5, -0.5, 3.0, 1.0]])
    prompts = [[0, 1], [5]]
    outputs = [[2, 2, 3], [0, 0, 0, 1]]
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(repetition_penalty=1.0, frequency_penalty=-0.5, presence_penalty=1.0)]
    sb = SamplingBatch.build(params, [0, 0], [0, 0], 6, "cpu", prompts=prompts, outputs=outputs)
    assert isinstance(sb.penalties, Penalties)
    got = penalised_logits(logits, sb)
    # Row 0: seen = {0,1,2,3}: positive logits /2, negative *2; then output counts {2: 2, 3: 1}:
    #   token 2: 0.5/2 - 0.5*2 - 0.25 = -1.0;  token 3: -0.5*2 - 0.5*1 - 0.25 = -1.75.
    # Row 1: no repetition penalty; counts {0: 3, 1: 1}: token 0: 2 + 0.5*3 - 1 = 2.5; token 1: -1 + 0.5 - 1 = -1.5.
    expect = torch.tensor([[1.0, -2.0, -1.0, -1.75, 3.0, 1.0],
                           [2.5, -1.5, 0.5, -0.5, 3.0, 1.0]])
    torch.testing.assert_close(got, expect, rtol=0, atol=1e-6)


def test_no_penalties_means_untouched_logits():
    sb = SamplingBatch.build([SamplingParams(), SamplingParams(top_k=3)], [0, 0], [0, 0], 4, "cpu")
    assert sb.penalties is None
    logits = torch.randn(2, 4)
    assert torch.equal(penalised_logits(logits, sb), logits)


def test_greedy_sampler_follows_penalised_argmax():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    sb = SamplingBatch.build([SamplingParams(temperature=0, presence_penalty=0.5, return_logprob=True)], [0], [0], 4, "cpu",
                             prompts=[[1]], outputs=[[0]])
    tokens, logprobs = Sampler().sample(logits, sb)
    assert tokens.tolist() == [1]  # 3.0 - 0.5 < 2.9
    expect = torch.log_softmax(torch.tensor([2.5, 2.9, 0.0, -1.0]), -1)[1]
    assert abs(logprobs.item() - expect.item()) < 1e-6


# ---- the counter-based RNG ----------------------------------------------------------------------------------------


def test_uniform_range_and_determinism():
    seeds = torch.tensor([0, 1, 2**62, -5], dtype=torch.int64)
    positions = torch.tensor([0, 7, 123456, 3], dtype=torch.int64)
    u = uniform(seeds, positions, DOMAIN_SAMPLE, 1000)
    assert u.shape == (4, 1000)
    assert (u > 0).all() and (u < 1).all()
    assert torch.equal(u, uniform(seeds, positions, DOMAIN_SAMPLE, 1000))
    assert not torch.equal(u, uniform(seeds, positions, DOMAIN_SAMPLE + 1, 1000))
    # Each row depends only on its own (seed, position).
    assert torch.equal(u[2], uniform(seeds[2:3], positions[2:3], DOMAIN_SAMPLE, 1000)[0])
    assert abs(u.mean().item() - 0.5) < 0.02


@pytest.mark.parametrize("seed", [1234, 99])
def test_sample_from_probs_chi_square(seed):
    """sample_from_probs draws token v with probability p_v.

    Significance threshold 1e-6: with a correct sampler and ideal randomness this test fails with probability
    1e-6 per seed. Inputs are fixed, so its outcome is deterministic; a failure means a biased sampler.
    """
    probs = [0.35, 0.25, 0.2, 0.1, 0.06, 0.03, 0.01, 0.0]
    p = torch.tensor(probs)
    n = 40000
    seeds = torch.full((n,), seed, dtype=torch.int64)
    positions = torch.arange(n, dtype=torch.int64)
    draws = sample_from_probs(p.expand(n, -1), seeds, positions, DOMAIN_SAMPLE)
    counts = np.bincount(draws.numpy(), minlength=len(p))
    assert counts[-1] == 0, "a zero-probability token was drawn"
    expected = np.array(probs[:-1]) * n
    result = stats.chisquare(counts[:-1], expected)
    assert result.pvalue > 1e-6, f"counts {counts} vs expected {expected}: p-value {result.pvalue}"


def test_sample_from_probs_across_seeds_chi_square():
    """Same check drawing across seeds at a fixed position (false-failure probability 1e-6)."""
    probs = [0.5, 0.3, 0.15, 0.05]
    p = torch.tensor(probs)
    n = 20000
    draws = sample_from_probs(p.expand(n, -1), torch.arange(n, dtype=torch.int64) * 7919 + 11,
                              torch.full((n,), 42, dtype=torch.int64), DOMAIN_SAMPLE)
    counts = np.bincount(draws.numpy(), minlength=4)
    assert stats.chisquare(counts, np.array(probs) * n).pvalue > 1e-6, counts


# ---- end to end ---------------------------------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=0.8, seed=1234, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def sample_prompts():
    return random_prompts([13, 40, 3, 27, 9, 51, 20, 6, 33], seed=40)


def _others(n_new=24):
    return [
        greedy(n_new),
        SamplingParams(temperature=1.0, top_k=5, seed=1, max_new_tokens=n_new - 3, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.8, seed=2, max_new_tokens=n_new, ignore_eos=True),
        SamplingParams(temperature=1.2, min_p=0.1, max_new_tokens=5, ignore_eos=True),  # engine-drawn seed
        SamplingParams(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.4, seed=3, max_new_tokens=n_new,
                       ignore_eos=True),
        SamplingParams(temperature=0.5, presence_penalty=-0.7, seed=1234, max_new_tokens=n_new, ignore_eos=True),
        greedy(11, repetition_penalty=1.5),
        SamplingParams(temperature=1.5, top_k=50, top_p=0.9, min_p=0.02, seed=4, max_new_tokens=17, ignore_eos=True),
    ]


def test_seeded_sampling_is_batch_invariant(llama_path, make_llm, sample_prompts):
    target = sample_prompts[0]
    alone = generate_ids(make_llm(llama_path, page_size=1), [target], SEEDED)[0].token_ids
    assert len(alone) == 24
    mixed = make_llm(llama_path, page_size=4, chunked_prefill_size=16)
    # The target sits at index 4 of a batch of nine, among eight requests with other prompts and parameters.
    outs = generate_ids(mixed, sample_prompts[1:5] + [target] + sample_prompts[5:], _others()[:4] + [SEEDED] + _others()[4:])
    assert outs[4].token_ids == alone
    again = generate_ids(make_llm(llama_path, page_size=16, max_running_requests=3), [target], SEEDED)[0].token_ids
    assert again == alone


def test_different_seeds_give_different_outputs(llama_path, make_llm, sample_prompts):
    llm = make_llm(llama_path)
    params = [SamplingParams(temperature=0.8, seed=s, max_new_tokens=24, ignore_eos=True) for s in (1, 2, 3, 4)]
    outs = generate_ids(llm, [sample_prompts[0]] * 4, params)
    assert len({tuple(o.token_ids) for o in outs}) == 4
    # ...while the same seed in one batch gives the same output for the same prompt.
    twins = generate_ids(llm, [sample_prompts[0]] * 2, [params[0], params[0]])
    assert twins[0].token_ids == twins[1].token_ids == outs[0].token_ids


def test_sampling_differs_from_greedy(llama_path, make_llm, sample_prompts):
    llm = make_llm(llama_path)
    sampled = generate_ids(llm, sample_prompts[:3], SamplingParams(temperature=1.0, seed=7, max_new_tokens=24,
                                                                   ignore_eos=True))
    greedy_out = generate_ids(llm, sample_prompts[:3], greedy(24))
    assert [o.token_ids for o in sampled] != [o.token_ids for o in greedy_out]


def test_unseeded_requests_follow_random_seed(llama_path, make_llm, sample_prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    a = generate_ids(make_llm(llama_path, random_seed=5), sample_prompts[:3], params)
    b = generate_ids(make_llm(llama_path, random_seed=5), sample_prompts[:3], params)
    c = generate_ids(make_llm(llama_path, random_seed=6), sample_prompts[:3], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_mixed_greedy_and_sampled_batch(llama_path, make_llm, sample_prompts):
    llm = make_llm(llama_path, page_size=3)
    pure = generate_ids(llm, sample_prompts, greedy(20))
    params = [greedy(20) if i % 2 == 0 else SamplingParams(temperature=1.3, top_p=0.9, seed=i, max_new_tokens=20,
                                                            ignore_eos=True) for i in range(len(sample_prompts))]
    mixed = generate_ids(llm, sample_prompts, params)
    for i in range(0, len(sample_prompts), 2):
        assert mixed[i].token_ids == pure[i].token_ids
    assert any(mixed[i].token_ids != pure[i].token_ids for i in range(1, len(sample_prompts), 2))


def test_greedy_logprobs_match_hf(llama_path, tiny_models, make_llm, sample_prompts):
    for kind in ("llama", "qwen3"):
        path = tiny_models[kind]
        llm = make_llm(path, page_size=4)
        outs = generate_ids(llm, sample_prompts[:4], greedy(10, return_logprob=True))
        for p, out in zip(sample_prompts[:4], outs):
            lps = out.meta_info["output_token_logprobs"]
            assert len(lps) == len(out.token_ids) == 10
            ref = torch.log_softmax(hf_logits(path, p + out.token_ids), -1)
            for j, (tok, lp) in enumerate(zip(out.token_ids, lps)):
                assert abs(lp - ref[len(p) - 1 + j, tok].item()) < 1e-4
                assert lp <= 0 and math.isfinite(lp)


def test_sampled_logprobs_are_raw_model_logprobs(llama_path, make_llm, sample_prompts):
    """With temperature and top-k, the reported logprob is the raw model's, one per output token."""
    llm = make_llm(llama_path)
    p = sample_prompts[2]
    out = generate_ids(llm, [p], SamplingParams(temperature=1.7, top_k=3, seed=9, max_new_tokens=8, ignore_eos=True,
                                                return_logprob=True))[0]
    ref = torch.log_softmax(hf_logits(llama_path, p + out.token_ids), -1)
    lps = out.meta_info["output_token_logprobs"]
    assert len(lps) == 8
    for j, (tok, lp) in enumerate(zip(out.token_ids, lps)):
        assert abs(lp - ref[len(p) - 1 + j, tok].item()) < 1e-4
        assert tok in ref[len(p) - 1 + j].topk(3).indices.tolist()  # top_k=3 respected


def test_no_logprobs_unless_asked(llama_path, make_llm, sample_prompts):
    out = generate_ids(make_llm(llama_path), sample_prompts[:1], greedy(3))[0]
    assert "output_token_logprobs" not in out.meta_info


def test_vanishing_temperature_is_greedy_and_finite():
    """A temperature below GREEDY_BELOW_TEMPERATURE would scale logits to inf (a NaN softmax): it means greedy, and
    the distribution stays a finite one-hot."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    for t in (1e-30, 1e-300, 9e-6):
        assert SamplingParams(temperature=t).is_greedy
        p = _probs(logits, SamplingParams(temperature=t))
        assert torch.equal(p, torch.tensor([[0.0, 0.0, 0.0, 1.0]])), (t, p)
    assert not SamplingParams(temperature=2e-5).is_greedy


def test_hash_matches_exact_integer_arithmetic():
    """hash_u32 relies on int64 multiplication wrapping past 2^63; Python's unbounded integers are the truth."""
    from hyperdraft.sample.rng import hash_u32

    def exact(x: int) -> int:
        x &= 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    values = [0, 1, 0xFFFFFFFF, 0xFFFFFFFE, 2**31, 2**31 - 1, 0x9E3779B9] + torch.randint(
        0, 2**32, (2000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64).tolist()
    assert hash_u32(torch.tensor(values)).tolist() == [exact(v) for v in values]


@pytest.mark.parametrize("asked", [(), (1,), (0, 2)])
def test_logprobs_only_when_a_row_asks(asked):
    """Sampler.sample computes the sampled tokens' logprobs only when some row's request asked (return_logprob);
    then every row gets them, equal to the log-softmax at its token."""
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0 if i != 1 else 0.8, return_logprob=i in asked) for i in range(3)]
    sb = SamplingBatch.build(params, [5, 6, 7], [0, 0, 0], 11, "cpu")
    sampled = Sampler().sample(logits, sb)
    assert sb.want_logprobs == bool(asked)
    if not asked:
        assert sampled.logprobs is None
        return
    want = torch.log_softmax(logits, -1).gather(1, sampled.tokens[:, None]).squeeze(1)
    torch.testing.assert_close(sampled.logprobs, want)
