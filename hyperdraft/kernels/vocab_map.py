"""An EAGLE-3 head's logits over its draft vocabulary, spread over the target vocabulary in one launch.

The head scores Vd draft ids (Vd = 32k for Llama-3 heads); everything downstream (the chooser, beams, q for
sampled drafts, verification) works in target ids, where a token outside the draft vocabulary has logit -inf.
Eager torch builds that row as a cast, a fill and an index_put (three launches, ~10 us per draft step on an H100);
here each program gathers one block of target ids through the inverse map, so every output element is written once.
"""

from __future__ import annotations

import torch

from hyperdraft.kernels._triton import jit, tl, triton
from hyperdraft.kernels.pdl import pdl_args, pdl_wait

BLOCK = 1024  # 126 programs over a 128k vocabulary: each writes 4 KB


@jit
def _spread_logits(DraftLogits, TargetToDraft, Out, stride_d, vocab, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    draft_id = tl.load(TargetToDraft + cols, mask=in_vocab, other=-1)
    hit = draft_id >= 0
    logit = tl.load(DraftLogits + n * stride_d + draft_id, mask=hit, other=0.0).to(tl.float32)
    tl.store(Out + n * vocab + cols, tl.where(hit, logit, float("-inf")), mask=in_vocab)


def spread_logits(draft_logits: torch.Tensor, target_to_draft: torch.Tensor) -> torch.Tensor:
    """draft_logits [N, Vd] (any float dtype, last dim contiguous); target_to_draft [V] int32, the draft id of each
    target id or -1 -> [N, V] fp32: out[n, t] = draft_logits[n, target_to_draft[t]], -inf where that is -1."""
    rows, vocab = draft_logits.shape[0], target_to_draft.shape[0]
    out = torch.empty(rows, vocab, dtype=torch.float32, device=draft_logits.device)
    assert draft_logits.stride(-1) == 1 and target_to_draft.is_contiguous() and target_to_draft.dtype == torch.int32
    if rows:
        _spread_logits[(rows, triton.cdiv(vocab, BLOCK))](draft_logits, target_to_draft, out, draft_logits.stride(0),
                                                         vocab, BLOCK=BLOCK, num_warps=4, **pdl_args(out.device))
    return out


def spread_logits_reference(draft_logits: torch.Tensor, draft_to_target: torch.Tensor, vocab: int) -> torch.Tensor:
    """draft_to_target [Vd] int64: the target id of each draft id."""
    out = torch.full((draft_logits.shape[0], vocab), float("-inf"), dtype=torch.float32, device=draft_logits.device)
    out[:, draft_to_target] = draft_logits.float()
    return out
