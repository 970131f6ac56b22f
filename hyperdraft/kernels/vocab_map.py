"""An EAGLE-3 head's logits over its draft vocabulary, in target ids: spread over the target vocabulary in one
launch, or reduced straight to the greedy target token.

The head scores Vd draft ids (Vd = 32k for Llama-3 heads); everything downstream (the chooser, beams, q for
sampled drafts, verification) works in target ids, where a token outside the draft vocabulary has logit -inf.
Eager torch builds that row as a cast, a fill and an index_put (three launches, ~10 us per draft step on an H100);
here each program gathers one block of target ids through the inverse map, so every output element is written once.
A greedy chain needs only the argmax of that row: VocabMap.argmax takes it over the Vd draft logits (ties to the
smallest target id, as over the spread row), so a greedy draft step never builds the [N, V] row at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels._triton import jit, tl, triton
from hyperdraft.kernels.argmax import argmax_kernel
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


@dataclass(frozen=True)
class VocabMap:
    """A draft vocabulary inside a target vocabulary of `vocab` ids."""

    draft_to_target: torch.Tensor  # [Vd] int64: the target id of each draft id (distinct)
    target_to_draft: torch.Tensor  # [V] int32: the draft id of each target id, -1 outside the draft vocabulary

    @property
    def vocab(self) -> int:
        return self.target_to_draft.shape[0]

    def spread(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[N, Vd] -> [N, V] fp32, -inf outside the draft vocabulary."""
        if use_fused_kernels(draft_logits) and draft_logits.stride(-1) == 1:
            return spread_logits(draft_logits, self.target_to_draft)
        return spread_logits_reference(draft_logits, self.draft_to_target, self.vocab)

    def argmax(self, draft_logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, Vd] -> the argmax of spread(draft_logits) [N] int64 (written into out when given, any stride)."""
        if use_fused_kernels(draft_logits) and draft_logits.stride(-1) == 1:
            return argmax_kernel(draft_logits, self.draft_to_target, out)
        tokens = self.argmax_reference(draft_logits)
        return tokens if out is None else out.copy_(tokens)

    def argmax_reference(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """spread(draft_logits).argmax(-1) without the [N, V] spread: the smallest target id among the draft ids at
        the row's maximum (NaN counts as the maximum, as torch.argmax has it). On the CPU a draft step's argmax took
        47 against 163 us (SmolLM2's 8192 of 49152 ids, one row, 2-core EPYC); a chain-5 round runs five."""
        top = draft_logits.amax(-1, keepdim=True)
        at_top = (draft_logits == top) | draft_logits.isnan()
        return torch.where(at_top, self.draft_to_target, self.vocab).amin(-1)
