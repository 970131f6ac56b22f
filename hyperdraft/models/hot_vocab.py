"""HotVocab: a draft head's lm_head cut down to the hot tokens of a token map (FR-Spec, SGLang's
--speculative-token-map).

A head that scores the target's whole vocabulary pays for its lm_head at every draft step. Over a 248k vocabulary
(Qwen3.5) that product is 2 GB of bf16 weights, and at batch 1 it was 2.4 ms of an 8.9 ms MTP chain-5 round on an
H200 (five draft steps, each streaming it once; benchmarks/results/hybrid_bench_h200.md). A token map names the
Vd tokens drafts may use (the most frequent ones); the head then reads Vd rows instead of V. Verification is
untouched: a token outside the map is never drafted, so it can only come from the target itself, and outputs stay
the target's (greedy) or its distribution (sampled: q is zero outside the map, which rejection sampling allows).

The rows are copied from the full lm_head once the weights are in (finish_loading): the head is built on the meta
device and its buffers are written after to_empty.
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from hyperdraft.kernels.vocab_map import VocabMap
from hyperdraft.models.cpu_linear import Linear

FIELD = "speculative_token_map"


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """The hot token ids of a token map file -> [Vd] int64, ascending. SGLang's format is a torch file holding a
    list or 1-D tensor of ids (.pt); a JSON list of ids is accepted too."""
    if not os.path.isfile(path):
        raise ValueError(f"{FIELD}={path!r}: no such file (a .pt list or tensor of token ids, or a .json list)")
    if path.endswith(".json"):
        with open(path) as f:
            raw = json.load(f)
    else:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    ids = torch.as_tensor(raw)
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{FIELD}={path!r} must hold a non-empty 1-D list of integer token ids, got "
                         f"{ids.dtype} with shape {tuple(ids.shape)}")
    ids = ids.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{FIELD}={path!r}: token ids must lie in [0, vocab_size={vocab_size}), got "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"{FIELD}={path!r} lists a token id more than once")
    return ids.sort().values


class HotVocab(nn.Module):
    """The lm_head rows of the hot tokens and the maps between draft ids (0..Vd-1) and target ids."""

    def __init__(self, hidden_size: int, vocab_size: int, hot_ids: torch.Tensor):
        super().__init__()
        self.hot_ids = hot_ids.cpu()  # kept off the module's buffers: they are rewritten after to_empty
        self.lm_head = Linear(hidden_size, hot_ids.numel(), bias=False)
        self.register_buffer("draft_to_target", torch.zeros(hot_ids.numel(), dtype=torch.int64), persistent=False)
        self.register_buffer("target_to_draft", torch.zeros(vocab_size, dtype=torch.int32), persistent=False)

    def finish_loading(self, full_lm_head: torch.Tensor) -> None:
        """Copy the hot rows out of the full lm_head weight [V, H] (loaded by now) and fill the maps."""
        device = self.lm_head.weight.device
        ids = self.hot_ids.to(device)
        with torch.no_grad():
            self.lm_head.weight.copy_(full_lm_head.detach()[ids.to(full_lm_head.device)].to(device))
        self.draft_to_target = ids
        inverse = torch.full_like(self.target_to_draft, -1)
        inverse[ids] = torch.arange(ids.numel(), dtype=torch.int32, device=device)
        self.target_to_draft = inverse

    @property
    def vocab_map(self) -> VocabMap:
        return VocabMap(self.draft_to_target, self.target_to_draft)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, Vd] in the weights' dtype, over the hot tokens (vocab_map spreads them)."""
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))
