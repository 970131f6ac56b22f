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


def _literal_tail_mask(leading: torch.Tensor, extend_lens: list[int]) -> torch.Tensor:
    """Request by request, the rows each request reads: a leading request's rows are its tree mask, right-aligned in
    the key window; every other request's are causal over its own tail; keys before a request's tail are visible."""
    b, n = leading.shape[0], leading.shape[1]
    q, w = max(extend_lens), max(max(extend_lens), n)
    out = torch.zeros(len(extend_lens), q, w, dtype=torch.bool)
    for r, length in enumerate(extend_lens):
        own = leading[r] if r < b else torch.ones(length, length, dtype=torch.bool).tril()
        out[r, : own.shape[0], : w - own.shape[1]] = True
        out[r, : own.shape[0], w - own.shape[1] :] = own
    return out


def test_leading_tail_mask_equals_a_literal_construction():
    """The round-alone path (the tree masks themselves, no launches) and the path with prefill chunks riding along
    (shorter and longer than the tree) give the mask built request by request."""
    from hyperdraft.core.forward_batch import leading_tail_mask

    gen = torch.Generator().manual_seed(0)
    n = 5
    leading = (torch.rand(3, n, n, generator=gen) < 0.5) | torch.eye(n, dtype=torch.bool)
    leading = leading.tril()
    alone = leading_tail_mask(leading, [n, n, n], "cpu")
    assert torch.equal(alone, leading)
    for extend_lens in ([n, n, n, 2], [n, n, n, 9, 1], [n, n, n, n]):
        built = leading_tail_mask(leading, extend_lens, "cpu")
        literal = _literal_tail_mask(leading, extend_lens)
        for r, length in enumerate(extend_lens):  # compare the rows each request reads
            rows = n if r < 3 else length
            assert torch.equal(built[r, :rows], literal[r, :rows]), (extend_lens, r)
