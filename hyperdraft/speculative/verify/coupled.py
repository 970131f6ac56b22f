"""Coupled verification: the target's own keyed sample decides, and a draft is accepted iff it equals that sample.

Terms, for one request whose verify row j predicts the token at sequence index i = n + j:
  p_j        the target's sampling distribution at row j (penalties, temperature, top-k/top-p/min-p applied)
  E_v(s, i)  Exp(1) noise for vocabulary entry v, a pure function of the request's seed s and the index i
             (sample/rng.py, DOMAIN_SAMPLE)
  t_j        the keyed sample argmax_v p_j(v) / E_v(s, i): exactly the token plain decoding samples at index i
Acceptance is the greedy rule applied to t instead of the argmax: the longest prefix of drafts with d_j == t_j is
accepted, then t at the first mismatch (or after the last draft) is emitted.

Why: the output is plain decoding's output, token for token, whatever was drafted. It does not depend on the
drafts, on the draft length (adaptive tiers, batch size), on other requests (NGRAM's shared history), or on
streaming: a seeded request is reproducible with or without speculation. It is lossless because plain decoding
is; its distribution is the target's.

Acceptance: a deterministic draft d is accepted with probability p(d), as under rejection sampling. A drafter
that samples d_j = argmax_v q_j(v) / E_v(s, i) with the same noise (drafting/choice.py) matches t_j whenever both
races pick the same token, which happens with probability at least (1 - TV(p, q)) / (1 + TV(p, q)), against
1 - TV(p, q) for rejection sampling: nearly equal when the draft is good.
"""

from __future__ import annotations

import torch

from hyperdraft.sample.rng import DOMAIN_SAMPLE, sample_from_probs


def keyed_targets(p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """p: [R, V] target distributions of R verify rows; seeds, positions: [R] -> t: [R] int64, the token plain
    decoding samples for each row (greedy rows have a one-hot p, so t is their argmax)."""
    return sample_from_probs(p, seeds, positions, DOMAIN_SAMPLE)
