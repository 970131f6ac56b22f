"""A dense decoder split over a tensor-parallel group (distributed/tensor_parallel.py): the rank's config, its
row-parallel and vocab-parallel modules, and its slice of the whole model's weights.

  split_problem     why a model cannot be split over the group (None when it can)
  rank_config       the rank's own frozen ModelConfig: num_heads, num_kv_heads and intermediate_size are its share;
                    with fewer K/V heads than ranks, each rank keeps the one K/V head its query heads read (replicated)
  RowParallelLinear o_proj / down_proj: the product of the rank's input columns, summed over the group, then the
                    bias and any residual, once
  VocabParallelEmbedding  the rank's vocabulary rows; other ids contribute zero rows to the group's sum
  shard_state       each parameter of the rank's model from the whole model's: which dim, which rows
  rank_part         one parameter's slice (also a split draft head's checkpoint tensors, its lm_head kept whole)
  head_vocab_modules  the embedding and lm_head a draft head borrows from its (split) target
Dense decoders (Llama, Mistral, Qwen2, Qwen3), Qwen3.5 hybrids (a Gated DeltaNet by key-head groups) and Qwen3-Next's
sparse MLPs (every expert's intermediate columns, and the shared expert's; the router whole) split.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hyperdraft.distributed.tensor_parallel import TensorParallel
from hyperdraft.kernels.activation import silu_mul, silu_mul_reference
from hyperdraft.kernels.gemv import silu_mul_gemv, silu_mul_gemv_fits
from hyperdraft.models.config import ModelConfig
from hyperdraft.models.cpu_linear import Linear, skinny_linear
from hyperdraft.models.cpu_packed import BlockedWeight


def split_problem(cfg: ModelConfig, tp: TensorParallel) -> str | None:
    """Why cfg's model cannot be split over tp's ranks, or None when it can."""
    if tp.size == 1:
        return None
    lin, moe = cfg.linear_attention, cfg.moe
    counts = [("num_attention_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size)]
    counts += [("linear_num_key_heads", lin.num_k_heads)] if lin is not None else []
    counts += [("moe_intermediate_size", moe.intermediate_size),
               ("shared_expert_intermediate_size", moe.shared_intermediate_size)] if moe is not None else []
    for field, n in counts:
        if n % tp.size:
            return f"tp_size={tp.size} must divide the model's {field}={n}"
    kv = cfg.num_kv_heads
    if kv % tp.size and tp.size % kv:
        return f"tp_size={tp.size} and num_key_value_heads={kv}: one must divide the other"
    return None


def rank_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The rank's share of the heads and MLP columns; everything else (hidden size, vocabulary) as the model's."""
    problem = split_problem(cfg, tp)
    if problem is not None:
        raise ValueError(problem)
    if tp.size == 1:
        return cfg
    lin, moe = cfg.linear_attention, cfg.moe
    kv = cfg.num_kv_heads
    if lin is not None:  # a rank keeps whole groups: its key heads and the value heads that read them
        lin = dataclasses.replace(lin, num_k_heads=lin.num_k_heads // tp.size, num_v_heads=lin.num_v_heads // tp.size)
    if moe is not None:
        moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // tp.size,
                                  shared_intermediate_size=moe.shared_intermediate_size // tp.size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp.size, num_kv_heads=max(1, kv // tp.size),
                               intermediate_size=cfg.intermediate_size // tp.size, linear_attention=lin, moe=moe)


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
        return self._summed(skinny_linear(x, self.weight, blocked=self.blocked), residual, out_dtype)

    def blocked_copy(self) -> BlockedWeight:
        """Without the bias: it is added once, after the partial products are summed."""
        return BlockedWeight.of(self.weight, None)

    def forward_silu_mul(self, gate: torch.Tensor, up: torch.Tensor, residual: torch.Tensor | None = None,
                         fused: bool = False) -> torch.Tensor:
        """The activation, then the split product: for one row on CUDA inside the product's launch (as an unsplit
        model's, bit for bit the same; bias and residual wait until after the sum)."""
        if fused and silu_mul_gemv_fits(gate, up, self.weight):
            return self._summed(silu_mul_gemv(gate, up, self.weight), residual)
        return self.forward((silu_mul if fused else silu_mul_reference)(gate, up), residual)

    def _summed(self, partial: torch.Tensor, residual: torch.Tensor | None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out = self.tp.all_reduce(partial)
        if self.bias is not None:
            out = out + self.bias
        if residual is not None:
            out = out + residual
        return out if out_dtype is None else out.to(out_dtype)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> Linear:
    """o_proj / down_proj: split over the group's ranks, or a plain Linear for an unsplit model."""
    return Linear(in_features, out_features, bias=bias) if tp.size == 1 else RowParallelLinear(
        in_features, out_features, bias, tp)


def embedding(vocab_size: int, hidden_size: int, tp: TensorParallel) -> nn.Module:
    if tp.size == 1:
        return empty_embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp)


def empty_embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """An nn.Embedding whose table is allocated, not drawn: every loader overwrites it (or fills dummy weights). Its
    default normal_ init, under the device context a model is built in, goes through torch._refs, whose first use
    imports torch._dynamo: 3.2 s of a fresh process's first engine on a 2-core CPU."""
    return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))


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


def head_vocab_modules(target: nn.Module, embed: bool = True,
                        lm_head: bool = True) -> tuple[nn.Module | None, Linear | None]:
    """(embedding, lm_head) for a draft head that shares the target's (None for the one not asked for): the target's
    own modules. When the target is split, its vocabulary-parallel embedding as it is (a lookup sums one row per
    token over the group, so every rank gets the whole rows without a whole table: a Llama-70B table is 2.1 GB in
    bf16), and a whole copy of its lm_head gathered from the ranks (a collective: every rank calls it, in the same
    order, as every rank builds its head), so a head drafts on every rank alike."""
    tp, cfg = target.tp, target.config
    whole_embed = target.model.embed_tokens if embed else None
    if tp.size == 1 or not lm_head:
        return whole_embed, (target.lm_head if lm_head else None)
    source = target.model.embed_tokens if cfg.tie_word_embeddings else target.lm_head
    weight = tp.gather_first_dim(source.weight.detach())[: cfg.vocab_size]
    whole_lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=weight.device, dtype=weight.dtype)
    whole_lm_head.weight = nn.Parameter(weight, requires_grad=False)
    return whole_embed, whole_lm_head


def shard_state(part: nn.Module, whole: nn.Module, cfg: ModelConfig, tp: TensorParallel) -> None:
    """Copy into the rank's model `part` its slice of every parameter of the unsplit model `whole` (cfg: whole's)."""
    whole_params = dict(whole.named_parameters())
    with torch.no_grad():
        for name, param in part.named_parameters():
            param.copy_(rank_part(name, whole_params[name], cfg, tp))


def rank_part(name: str, whole: torch.Tensor, cfg: ModelConfig, tp: TensorParallel,
              vocab_parallel: bool = True) -> torch.Tensor:
    """The rank's slice of the unsplit parameter `name` (cfg: the unsplit model's). vocab_parallel False keeps an
    lm_head whole (a draft head's, which every rank scores alike)."""
    if "." not in name:  # a buffer of the model's own (an EAGLE-3 head's d2t, t2d)
        return whole
    rows, cols = _row_blocks(cfg, tp), _col_blocks(cfg, tp)
    module, kind = name.rsplit(".", 2)[-2:]
    if ".mlp.experts." in name or ".mlp.shared_expert." in name:  # a sparse MLP's own intermediate split
        module = ("shared_" if ".shared_expert." in name else "expert_") + module
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _padded_rows(whole, *tp.padded_split(cfg.vocab_size)) if vocab_parallel else whole
    if module in rows:  # a column-parallel weight, its bias, a conv's channels
        runs, units = rows[module]
        return _take(whole, runs, whole.shape[0] // units, dim=0)
    if kind in ("dt_bias", "A_log"):  # one per value head
        return _take(whole, rows["in_proj_b"][0], 1, dim=0)
    if module in cols and kind == "weight":
        runs, units = cols[module]
        return _take(whole, runs, whole.shape[1] // units, dim=1)
    return whole


# Which whole-model blocks a rank keeps, per module: ([(first unit, units)], units in the whole model); a unit is a
# head, a value head, an MLP column or a row, and how many rows (or columns) it spans follows from the weight's shape.
Blocks = dict[str, tuple[list[tuple[int, int]], int]]


def _row_blocks(cfg: ModelConfig, tp: TensorParallel) -> Blocks:
    q0, q1 = tp.split(cfg.num_heads)
    kv0, kv1 = kv_head_range(cfg, tp)
    i0, i1 = tp.split(cfg.intermediate_size)
    blocks = {"q_proj": ([(q0, q1 - q0)], cfg.num_heads), "k_proj": ([(kv0, kv1 - kv0)], cfg.num_kv_heads),
              "v_proj": ([(kv0, kv1 - kv0)], cfg.num_kv_heads), "gate_proj": ([(i0, i1 - i0)], cfg.intermediate_size),
              "up_proj": ([(i0, i1 - i0)], cfg.intermediate_size)}
    blocks.update(_moe_blocks(cfg, tp, ("gate_proj", "up_proj")))
    lin = cfg.linear_attention
    if lin is not None:
        k0, k1 = tp.split(lin.num_k_heads)
        v0, v1 = tp.split(lin.num_v_heads)
        value = ([(v0, v1 - v0)], lin.num_v_heads)
        blocks.update(in_proj_z=value, in_proj_b=value, in_proj_a=value)
        blocks["in_proj_qkv"] = blocks["conv1d"] = (_qkv_runs(lin, k0, k1, v0, v1), lin.conv_dim)
    return blocks


def _col_blocks(cfg: ModelConfig, tp: TensorParallel) -> Blocks:
    q0, q1 = tp.split(cfg.num_heads)
    i0, i1 = tp.split(cfg.intermediate_size)
    blocks = {"o_proj": ([(q0, q1 - q0)], cfg.num_heads), "down_proj": ([(i0, i1 - i0)], cfg.intermediate_size)}
    blocks.update(_moe_blocks(cfg, tp, ("down_proj",)))
    if cfg.linear_attention is not None:
        v0, v1 = tp.split(cfg.linear_attention.num_v_heads)
        blocks["out_proj"] = ([(v0, v1 - v0)], cfg.linear_attention.num_v_heads)
    return blocks


def _moe_blocks(cfg: ModelConfig, tp: TensorParallel, modules: tuple[str, ...]) -> Blocks:
    """A sparse MLP's routed experts (expert_*) and shared expert (shared_*): each split by its own intermediate size."""
    if cfg.moe is None:
        return {}
    blocks = {}
    for prefix, size in (("expert_", cfg.moe.intermediate_size), ("shared_", cfg.moe.shared_intermediate_size)):
        first, stop = tp.split(size)
        blocks.update({prefix + m: ([(first, stop - first)], size) for m in modules})
    return blocks


def _qkv_runs(lin, k0: int, k1: int, v0: int, v1: int) -> list[tuple[int, int]]:
    """The rank's q, k and v rows of a Gated DeltaNet's q|k|v, in units of one row: q and k of its key heads, v of its
    value heads."""
    dk, dv, keys = lin.k_head_dim, lin.v_head_dim, lin.num_k_heads * lin.k_head_dim
    return [(k0 * dk, (k1 - k0) * dk), (keys + k0 * dk, (k1 - k0) * dk), (2 * keys + v0 * dv, (v1 - v0) * dv)]


def _take(src: torch.Tensor, runs: list[tuple[int, int]], unit: int, dim: int) -> torch.Tensor:
    """The runs (first unit, units) of src along dim, each unit `unit` rows or columns wide, concatenated."""
    return torch.cat([src.narrow(dim, first * unit, count * unit) for first, count in runs], dim=dim)


def _padded_rows(table: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    rows = table[start:stop]
    if rows.shape[0] < stop - start:
        rows = torch.cat([rows, rows.new_zeros(stop - start - rows.shape[0], table.shape[1])])
    return rows
