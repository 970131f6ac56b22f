"""RoundSampling: the static sampling rows of whole-round draft graphs (drafting/round_sampling.py).

Draft-ahead builds the next round's rows on the device from this round's results. They must be exactly the rows
the next round's own SamplingBatch holds (the sampler's positions one committed run further on, the committed tokens
counted as outputs), or the queued round would draft from other parameters than a fresh round would."""

from __future__ import annotations

import torch

from hyperdraft.sample.logits_ops import SamplingBatch
from hyperdraft.sampling_params import SamplingParams
from hyperdraft.speculative.drafting.choice import SamplingKey
from hyperdraft.speculative.drafting.round_sampling import RoundSampling

VOCAB = 50
PARAMS = [SamplingParams(temperature=0.8, repetition_penalty=1.3),
          SamplingParams(temperature=0.0, frequency_penalty=0.4),
          SamplingParams(temperature=1.0, top_k=7, presence_penalty=0.5)]
PROMPTS = [[1, 2, 3], [4, 4], [7, 8, 9, 10]]
OUTPUTS = [[5, 5], [], [11]]


def _batch(positions: list[int], outputs: list[list[int]]) -> SamplingBatch:
    return SamplingBatch.build(PARAMS, [3, 4, 5], positions, VOCAB, "cpu", prompts=PROMPTS, outputs=outputs)


def test_rows_moved_on_by_the_committed_tokens_are_the_next_rounds_own():
    """A chain round accepting 2, 0 and 3 drafts (tokens past each request's a + 1 are not committed) and a tree
    round's path padded with -1: the rows loaded with them equal a batch built from scratch after the commit."""
    positions = [5, 2, 5]
    num_accepted = torch.tensor([2, 0, 3])
    for tokens in (torch.tensor([[5, 6, 49, 0], [12, 13, 14, 15], [0, 1, 2, 3]]),
                   torch.tensor([[5, 6, 49, -1], [12, -1, -1, -1], [0, 1, 2, 3]])):
        rows = RoundSampling(4, "cpu")
        rows.load(_batch(positions, OUTPUTS), committed=(num_accepted, tokens))
        committed = [t[: a + 1] for t, a in zip(tokens.tolist(), num_accepted.tolist())]
        want = _batch([p + a + 1 for p, a in zip(positions, num_accepted.tolist())],
                      [o + c for o, c in zip(OUTPUTS, committed)])
        got = rows.batch(4, SamplingKey.of(want, drawn=True, coupled=False))
        for name in ("temperature", "top_k", "top_p", "min_p", "greedy", "seeds", "positions"):
            assert torch.equal(getattr(got, name)[:3], getattr(want, name)), name
        for name in ("output_counts", "seen", "frequency", "presence", "repetition"):
            assert torch.equal(getattr(got.penalties, name)[:3], getattr(want.penalties, name)), name
        assert got.penalties.output_counts.shape == (4, VOCAB)  # padded to the graph's batch size


def test_a_round_without_penalties_reads_none():
    """Rows of an unpenalised batch: the key says penalties are off, and the batch carries none."""
    sb = SamplingBatch.build([SamplingParams(temperature=0.7, top_p=0.9)] * 2, [1, 2], [9, 9], VOCAB, "cpu")
    rows = RoundSampling(2, "cpu")
    rows.load(sb)
    key = SamplingKey.of(sb, drawn=True, coupled=False)
    assert key.penalised is False and key.need_top_p and rows.batch(2, key).penalties is None
    assert SamplingKey.of(sb, drawn=False, coupled=True) is None  # greedy drafts, no penalties: the greedy graphs
