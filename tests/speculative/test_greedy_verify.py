"""verify_greedy_chain, the greedy shortcut (no coins, no vocabulary-wide race), returns exactly the general rule's
tokens and accept counts whenever every target row is one-hot and the drafts are deterministic."""

from __future__ import annotations

import pytest
import torch

from hyperdraft.speculative.verify.rejection import verify_chain, verify_greedy_chain


@pytest.mark.parametrize("k", [0, 1, 3, 7])
def test_greedy_shortcut_equals_general_rule(k):
    g = torch.Generator().manual_seed(k)
    n, vocab = 400, 6  # a small vocabulary: drafts often equal the argmax, so every accept count occurs
    p = torch.nn.functional.one_hot(torch.randint(0, vocab, (n, k + 1), generator=g), vocab).float()
    draft = torch.where(torch.rand(n, k, generator=g) < 0.7, p[:, :k].argmax(-1), torch.randint(0, vocab, (n, k), generator=g))
    lens = torch.randint(0, k + 1, (n,), generator=g)
    seeds, positions = torch.arange(n), torch.randint(0, 1000, (n,), generator=g)
    general = verify_chain(p, draft, lens, None, seeds, positions)
    fast = verify_greedy_chain(p.argmax(-1), draft, lens)
    assert torch.equal(general[0], fast[0]) and torch.equal(general[1], fast[1])
    if k:
        assert len(set(general[0].tolist())) == k + 1  # every accept count 0..k was exercised
