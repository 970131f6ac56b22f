"""RoundSampling: the sampling rows a whole-round draft graph reads (drafting/graphs.py), as static tensors.

A graph reads fixed addresses, so a round's SamplingBatch is copied in before each replay (device-to-device copies,
no host sync): the per-row parameters (temperature, top-p, min-p, top-k, seed, position, greedy) and, for penalised
rounds, the penalty tables ([rows, V] output counts and seen flags, and the three weights). The tables are allocated
on the first penalised round (V is the target's vocabulary, known from that batch).

Draft-ahead queues the next round's graph before this round's results reach the host, so the next round's rows are
built on the device from this round's: positions moved on by the a + 1 tokens each request commits, and those tokens
added to the output counts (and the seen flags) as SamplingBatchCache.get adds them for the real next round. Counts
are sums of ones, exact in float32 whatever the order, so the queued round reads the same bits.
"""

from __future__ import annotations

import torch

from hyperdraft.sample.logits_ops import Penalties, SamplingBatch
from hyperdraft.speculative.drafting.choice import SamplingKey


class RoundSampling:
    """Static rows [size] (the largest captured batch size). Rows past a batch keep earlier values (any valid row
    will do: their drafts are cut off)."""

    def __init__(self, size: int, device):
        self.size, self.device = size, device
        self.floats = torch.tensor([[1.0, 1.0, 0.0]] * size, device=device).T.contiguous()  # temperature, top_p, min_p
        self.ints = torch.tensor([[1, 0, 0]] * size, device=device).T.contiguous()  # top_k, seed, position
        self.greedy = torch.zeros(size, dtype=torch.bool, device=device)
        self.penalties: Penalties | None = None  # [size, V] tables, from the first penalised round on

    def load(self, sb: SamplingBatch, committed: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """sb's rows. committed (draft-ahead): (num_accepted [B], tokens [B, W]): each request commits its first
        num_accepted + 1 tokens before the queued round, which samples that far on and counts them as outputs."""
        n = sb.temperature.shape[0]
        positions = sb.positions if committed is None else sb.positions + committed[0] + 1
        for dst, src in zip((*self.floats, *self.ints, self.greedy),
                            (sb.temperature, sb.top_p, sb.min_p, sb.top_k, sb.seeds, positions, sb.greedy)):
            dst[:n].copy_(src)
        if sb.penalties is not None:
            self._load_penalties(sb.penalties, n, committed)

    def _load_penalties(self, pen: Penalties, n: int, committed) -> None:
        if self.penalties is None:
            vocab = pen.output_counts.shape[1]
            self.penalties = Penalties(torch.zeros(self.size, vocab, device=self.device),
                                       torch.zeros(self.size, vocab, dtype=torch.bool, device=self.device),
                                       *(torch.ones(self.size, device=self.device) for _ in range(3)))
        mine = self.penalties
        for dst, src in zip((mine.output_counts, mine.seen, mine.frequency, mine.presence, mine.repetition),
                            (pen.output_counts, pen.seen, pen.frequency, pen.presence, pen.repetition)):
            dst[:n].copy_(src)
        if committed is not None:
            num_accepted, tokens = committed
            kept = torch.arange(tokens.shape[1], device=tokens.device)[None, :] <= num_accepted[:, None]  # [B, W]
            # a tree's tokens are -1 past its path: those columns add nothing, at any valid index
            mine.output_counts[:n].scatter_add_(1, tokens.clamp_min(0), kept.float())
            mine.seen[:n] |= mine.output_counts[:n] > 0

    def batch(self, bs: int, key: SamplingKey) -> SamplingBatch:
        """The first bs rows as the SamplingBatch a round of this key runs with."""
        (temperature, top_p, min_p), (top_k, seeds, positions) = (t[:, :bs] for t in (self.floats, self.ints))
        pen = None
        if key.penalised:
            p = self.penalties
            pen = Penalties(p.output_counts[:bs], p.seen[:bs], p.frequency[:bs], p.presence[:bs], p.repetition[:bs])
        return SamplingBatch(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, greedy=self.greedy[:bs],
                             seeds=seeds, positions=positions, penalties=pen, need_top_k=key.need_top_k,
                             need_top_p=key.need_top_p, need_min_p=key.need_min_p, all_greedy=key.all_greedy,
                             any_greedy=key.any_greedy, want_logprobs=False)
