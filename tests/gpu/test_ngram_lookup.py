"""NGRAM's device lookup (kernels/ngram.py: append, match, draft) against its torch reference, element for element:
the appended tokens in their slots, the drafts and their counts, over random sequences, histories with separators,
page sizes and windows, including sequences and histories longer than one match block and more blocks than match
programs. Run on a GPU machine: `python3 -m pytest tests/gpu/test_ngram_lookup.py`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyperdraft.kernels.ngram import MATCH_BLOCK, MAX_MATCH_PROGRAMS, TokenStore, ngram_draft_ahead_kernel, \
    ngram_draft_ahead_reference
from helpers.token_store import random_history, random_store

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("long", [False, True])
def test_lookup_kernel_equals_reference(page_size, long):
    rng = np.random.default_rng(page_size * 2 + long)
    for trial in range(25):
        bsz, k = int(rng.integers(1, 9)), int(rng.integers(1, 8))
        vocab = int(rng.integers(2, 7)) if not long else int(rng.integers(3, 40))
        lo = int(rng.integers(1, 4))
        hi = int(rng.integers(lo, 13))
        max_len = 200 if long else 60
        lengths = [int(rng.integers(1, max_len)) for _ in range(bsz)]
        if long:  # one row past a match block, one history past MAX_MATCH_PROGRAMS blocks
            lengths[0] = 200
        store, rows, _ = random_store(rng, page_size, lengths, vocab, "cuda")
        capacity = MATCH_BLOCK * (MAX_MATCH_PROGRAMS + 3) if long else 64
        history, device_history = random_history(rng, vocab, capacity, "cuda")
        rows_t = torch.tensor(rows, device="cuda")
        bases = torch.tensor(lengths, device="cuda")
        num_accepted = torch.tensor(rng.integers(0, k + 1, bsz), device="cuda")
        accepted = torch.tensor(rng.integers(0, vocab, (bsz, k + 2)), device="cuda")[:, : k + 1]
        ref_store = TokenStore(store.tokens.clone(), store.table, page_size)
        got = ngram_draft_ahead_kernel(store, rows_t, bases, num_accepted, accepted, device_history, len(history),
                                       max(lengths) + k + 1, k, lo, hi)
        want = ngram_draft_ahead_reference(ref_store, rows_t, bases, num_accepted, accepted, device_history,
                                           len(history), k, lo, hi)
        assert torch.equal(store.tokens, ref_store.tokens), f"appended tokens, trial {trial}"
        assert torch.equal(got.lens, want.lens), (trial, got.lens, want.lens)
        assert torch.equal(got.tokens, want.tokens), (trial, got.tokens, want.tokens)
