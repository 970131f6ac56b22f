"""VocabMap.argmax on the CPU (the torch path every eager draft step takes there) == torch.argmax over the spread
target row: the smallest target id among tied maxima, whatever the draft order, and NaN as torch.argmax treats it."""

from __future__ import annotations

import pytest
import torch

from hyperdraft.kernels.vocab_map import VocabMap, spread_logits_reference


def _scrambled_map(draft_vocab: int, vocab: int, seed: int) -> VocabMap:
    g = torch.Generator().manual_seed(seed)
    draft_to_target = torch.randperm(vocab, generator=g)[:draft_vocab]
    target_to_draft = torch.full((vocab,), -1, dtype=torch.int32)
    target_to_draft[draft_to_target] = torch.arange(draft_vocab, dtype=torch.int32)
    return VocabMap(draft_to_target, target_to_draft)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,draft_vocab,vocab", [(1, 8192, 49152), (5, 100, 5000), (3, 777, 777)])
def test_draft_argmax_equals_spread_argmax(dtype, rows, draft_vocab, vocab):
    vocab_map = _scrambled_map(draft_vocab, vocab, seed=rows + draft_vocab)
    logits = (torch.randn(rows, draft_vocab, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    order = vocab_map.draft_to_target.argsort(descending=True)  # draft ids from the largest target id down
    top = logits.float().max().item() + 1.0
    logits[0, order[:2]] = top  # a tie whose later draft id has the smaller target id
    if rows >= 2:
        logits[1, order[[0, draft_vocab // 2, draft_vocab - 1]]] = top
    if rows >= 3:
        logits[2] = logits[2].round()  # many ties below and at the maximum
    want = spread_logits_reference(logits, vocab_map.draft_to_target, vocab).argmax(-1)
    assert torch.equal(vocab_map.argmax(logits), want)
    column = torch.full((rows, 3), -7, dtype=torch.int64)
    vocab_map.argmax(logits, column[:, 1])
    assert torch.equal(column[:, 1], want) and bool((column[:, [0, 2]] == -7).all())


def test_draft_argmax_with_nan_follows_torch():
    """A NaN logit wins, as torch.argmax has it (the first NaN in target order), never an out-of-range id."""
    vocab_map = _scrambled_map(64, 500, seed=1)
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    order = vocab_map.draft_to_target.argsort(descending=True)
    logits[0, order[:3]] = float("nan")
    want = spread_logits_reference(logits, vocab_map.draft_to_target, 500).argmax(-1)
    got = vocab_map.argmax(logits)
    assert torch.equal(got, want) and int(got.max()) < 500
