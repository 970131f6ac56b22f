"""The attention backend's per-request custom mask: a packed two-branch tree must give each branch exactly the
logits that plain causal decoding of that branch gives. Tree verification depends on this."""

from __future__ import annotations

import torch

from hyperdraft.core.forward_batch import ForwardInput, ForwardMode, build_forward_batch


def _forward(llm, inputs):
    engine = llm.engine
    fb = build_forward_batch(ForwardMode.TARGET_VERIFY, inputs, engine.page_table, engine.device)
    return engine.runner.forward(fb).logits


def _acquire(llm, tokens: int) -> int:
    row = llm.engine.page_table.acquire_row()
    assert llm.engine.page_table.reserve(row, tokens)
    return row


def test_tree_mask_matches_plain_decoding_of_each_branch(llama_path, make_llm):
    llm = make_llm(llama_path, page_size=4)
    prefix, a1, a2, b1 = [3, 14, 15, 92, 65], 35, 89, 79
    n = len(prefix)
    tree_row, a_row, b_row = _acquire(llm, n + 3), _acquire(llm, n + 2), _acquire(llm, n + 1)
    try:
        # Prefill the prefix of all three rows.
        _forward(llm, [ForwardInput(r, 0, prefix, 0) for r in (tree_row, a_row, b_row)])
        # Tree: nodes a1 (depth 0), a2 (child of a1, depth 1), b1 (sibling of a1, depth 0).
        mask = torch.zeros(3, n + 3, dtype=torch.bool)
        mask[:, :n] = True
        mask[0, n] = True
        mask[1, n] = mask[1, n + 1] = True
        mask[2, n + 2] = True
        tree = _forward(llm, [ForwardInput(tree_row, n, [a1, a2, b1], 3, positions=[n, n + 1, n], mask=mask)])
        plain_a = _forward(llm, [ForwardInput(a_row, n, [a1, a2], 2)])
        plain_b = _forward(llm, [ForwardInput(b_row, n, [b1], 1)])
        assert torch.allclose(tree[:2], plain_a, atol=1e-5)
        assert torch.allclose(tree[2:], plain_b, atol=1e-5)
        # And the mask matters: without it b1 would see a1 and a2.
        causal = _forward(llm, [ForwardInput(tree_row, n, [a1, a2, b1], 3, positions=[n, n + 1, n])])
        assert not torch.allclose(causal[2:], plain_b, atol=1e-3)
    finally:
        for r in (tree_row, a_row, b_row):
            llm.engine.page_table.release_row(r)
