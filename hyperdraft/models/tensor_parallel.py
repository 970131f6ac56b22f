"""A dense decoder split over a tensor-parallel group (distributed/tensor_parallel.py): the rank's config, its
row-parallel and vocab-parallel modules, and its slice of the whole model's weights.

  rank_config       the rank's own frozen ModelConfig: num_heads, num_kv_heads and intermediate_size are its share;
                    with fewer K/V heads than ranks, each rank keeps the one K/V head its query heads read (replicated)
  RowParallelLinear o_proj / down_proj: the product of the rank's input columns, summed over the group, then the
                    bias and any residual, once
  VocabParallelEmbedding  the rank's vocabulary rows; other ids contribute zero rows to the group's sum
  shard_state       each parameter of the rank's model from the whole model's: which dim, which rows
Only dense decoders split so far (Llama, Mistral, Qwen2, Qwen3); hybrid and MoE models refuse a group of 2 or more.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hyperdraft.distributed.tensor_parallel import TensorParallel
from hyperdraft.kernels.activation import silu_mul, silu_mul_reference
from hyperdraft.models.config import ModelConfig
from hyperdraft.models.cpu_linear import Linear, skinny_linear


def rank_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The rank's share of the heads and MLP columns; everything else (hidden size, vocabulary) as the model's."""
    if tp.size == 1:
        return cfg
    if cfg.is_hybrid or cfg.moe is not None:
        raise ValueError(f"tp_size={tp.size}: {cfg.architecture} cannot be split yet (dense decoders only: Llama, "
                         "Mistral, Qwen2, Qwen3)")
    for field, n in (("num_attention_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size)):
        if n % tp.size:
            raise ValueError(f"tp_size={tp.size} must divide the model's {field}={n}")
    kv = cfg.num_kv_heads
    if kv % tp.size and tp.size % kv:
        raise ValueError(f"tp_size={tp.size} and num_key_value_heads={kv}: one must divide the other")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp.size, num_kv_heads=max(1, kv // tp.size),
                               intermediate_size=cfg.intermediate_size // tp.size)


def kv_head_range(cfg: ModelConfig, tp: TensorParallel) -> tuple[int, int]:
    """[first, stop) of the whole model's K/V heads this rank keeps (one shared head when they are fewer than ranks)."""
    kv = cfg.num_kv_heads
    if kv >= tp.size:
        return tp.split(kv)
    head = tp.rank * kv // tp.size
    return head, head + 1


class RowParallelLinear(Linear):
    """A projection whose input columns are split over the group: partial products summed, then bias and residual."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out = self.tp.all_reduce(skinny_linear(x, self.weight))
        if self.bias is not None:
            out = out + self.bias
        if residual is not None:
            out = out + residual
        return out if out_dtype is None else out.to(out_dtype)

    def forward_silu_mul(self, gate: torch.Tensor, up: torch.Tensor, residual: torch.Tensor | None = None,
                         fused: bool = False) -> torch.Tensor:
        """The activation first, then the split product (a fused one-row kernel would skip the reduction)."""
        return self.forward((silu_mul if fused else silu_mul_reference)(gate, up), residual)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> Linear:
    """o_proj / down_proj: split over the group's ranks, or a plain Linear for an unsplit model."""
    return Linear(in_features, out_features, bias=bias) if tp.size == 1 else RowParallelLinear(
        in_features, out_features, bias, tp)


def embedding(vocab_size: int, hidden_size: int, tp: TensorParallel) -> nn.Module:
    return nn.Embedding(vocab_size, hidden_size) if tp.size == 1 else VocabParallelEmbedding(vocab_size, hidden_size, tp)


class VocabParallelEmbedding(nn.Module):
    """The rank's rows [start, stop) of the embedding table (padded past the vocabulary on the last rank)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.start, self.stop = tp.padded_split(vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.stop - self.start, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = self.weight[local.clamp(0, self.weight.shape[0] - 1)] * mine[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(rows)


def whole_vocab_modules(target: nn.Module) -> tuple[nn.Module, Linear]:
    """(embedding, lm_head) over the whole vocabulary for a draft head that shares the target's: the target's own
    modules, or, when the target is split, whole copies gathered from its ranks (a collective: every rank calls it,
    in the same order, as every rank builds its head). A head drafts on every rank alike, from whole tables."""
    tp, cfg = target.tp, target.config
    if tp.size == 1:
        return target.model.embed_tokens, target.lm_head
    table = tp.gather_first_dim(target.model.embed_tokens.weight.detach())[: cfg.vocab_size]
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=table.device, dtype=table.dtype)
    embed.weight = nn.Parameter(table, requires_grad=False)
    lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=table.device, dtype=table.dtype)
    lm_weight = table if cfg.tie_word_embeddings else tp.gather_first_dim(target.lm_head.weight.detach())[: cfg.vocab_size]
    lm_head.weight = nn.Parameter(lm_weight, requires_grad=False)
    return embed, lm_head


def shard_state(part: nn.Module, whole: nn.Module, cfg: ModelConfig, tp: TensorParallel) -> None:
    """Copy into the rank's model `part` its slice of every parameter of the unsplit model `whole` (cfg: whole's)."""
    whole_params = dict(whole.named_parameters())
    q_heads = tp.split(cfg.num_heads)
    kv_heads = kv_head_range(cfg, tp)
    inter = tp.split(cfg.intermediate_size)
    vocab = tp.padded_split(cfg.vocab_size)
    d = cfg.head_dim
    rows_of = {"q_proj": (q_heads[0] * d, q_heads[1] * d), "k_proj": (kv_heads[0] * d, kv_heads[1] * d),
               "v_proj": (kv_heads[0] * d, kv_heads[1] * d), "gate_proj": inter, "up_proj": inter}
    cols_of = {"o_proj": (q_heads[0] * d, q_heads[1] * d), "down_proj": inter}
    with torch.no_grad():
        for name, param in part.named_parameters():
            src = whole_params[name]
            module, kind = name.rsplit(".", 2)[-2:] if name.count(".") >= 1 else ("", name)
            if module in rows_of:
                start, stop = rows_of[module]
                src = src[start:stop]
            elif module in cols_of and kind == "weight":
                start, stop = cols_of[module]
                src = src[:, start:stop]
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                src = _padded_rows(src, *vocab)
            param.copy_(src)


def _padded_rows(table: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    rows = table[start:stop]
    if rows.shape[0] < stop - start:
        rows = torch.cat([rows, rows.new_zeros(stop - start - rows.shape[0], table.shape[1])])
    return rows
