"""EAGLE-1 and EAGLE-3 draft heads in the checkpoint layouts the community publishes.

Checkpoint names (top level; a leading "model." is also accepted):
EAGLE-1, LlamaForCausalLMEagle (alias LlamaForCausalLM: SafeAILab's heads declare it, SGLang renames it for drafts):
  fc.weight [H, 2H] + fc.bias [H] (config "bias", default true) over concat(token embedding, hidden);
  layers.{i}.self_attn.{q,k,v,o}_proj, layers.{i}.mlp.{gate,up,down}_proj, layers.{i}.post_attention_layernorm, and
  layers.{i}.input_layernorm for i > 0 only (layer 0 has no input norm); optional embed_tokens.weight, lm_head.weight
  [V, H], else the target's are shared by reference. No final norm: the output goes straight into the (target's)
  lm_head, as in SafeAILab's head(out_hidden) and SGLang's LlamaForCausalLMEagle; the head regresses the target's
  final *normed* hidden, which is also what it consumes.
EAGLE-3, LlamaForCausalLMEagle3:
  fc.weight [H, 3*Ht] (bias only with "bias": true) over the concat of 3 target aux states; midlayer.input_layernorm
  (over the embedding), midlayer.hidden_norm (over the hidden), midlayer.self_attn.{q,k,v}_proj [*, 2H] over
  concat(normed embedding, normed hidden), o_proj, midlayer.mlp.*, midlayer.post_attention_layernorm, residual = the
  un-normed hidden; norm.weight; lm_head.weight [Vd, H]; d2t int64 [Vd] (target_id = draft_id + d2t[draft_id]);
  t2d bool [V]; optional embed_tokens.weight. lm_head/d2t/t2d may be absent only if draft_vocab_size == vocab_size.

What the head consumes from the target:
  EAGLE-1: the final normed hidden (DecoderLM.forward's first output, ModelRunner's ForwardOutput.hidden).
  EAGLE-3: the outputs (pre-norm residual stream) of target layers aux_layer_ids(head), concatenated in ascending
  layer order, through project_target_hidden. Default: SGLang's [1, L//2 - 1, L - 4] for L target layers (its capture
  list [2, L//2, L - 3]); for L < 7 those collide, so (lo, (lo + hi) // 2, hi) with hi = L - 2 (L - 1 if L == 3),
  lo = 1 if hi >= 3 else 0: L=6 -> (1, 2, 4), L=5 -> (1, 2, 3), L=4, 3 -> (0, 1, 2); L < 3 has none.
  DecoderLM.forward(capture_layers=c) captures the INPUT of layer c = the output of layer c - 1, so pass
  target_capture_layers(head) = sorted(i + 1 for i in aux ids); the captured list comes back in that (fc's) order.
  The last layer's output (id L - 1) is the final pre-norm sum, captured after the layer loop (capture index L);
  SGLang's target forward captures only inside its loop, so train-draft never picks it (--aux-layers <= L - 2).

Alignment (SafeAILab's topK_genrate feeds input_ids[:, 1:]; SGLang's draft extend shifts input_ids left by one,
appends the token the target just sampled, and keeps positions): the target ran t_0..t_{n-1} at positions 0..n-1,
giving h_i at position i (h_i predicts t_{i+1}), and sampled t_n. Head position i consumes (h_i, t_{i+1}) at RoPE
position i, writes its K/V at index i of the request (t_i's slot under a shared page table), and its output g_i
predicts t_{i+2} via compute_logits(g_i). A draft extend feeds input_ids = t_1..t_n, hidden = h_0..h_{n-1},
positions 0..n-1; d_1 (token n+1) comes from g_{n-1}. Draft step k >= 1 runs at position n - 1 + k on
(g_{n-2+k}, d_k) -- the head's own output stands in for the target hidden (EAGLE-3 does NOT apply fc to it) -- and
predicts d_{k+1}. After verify accepts a drafts plus a bonus token, the next extend covers positions n..n+a with the
target's h_n..h_{n+a} and tokens t_{n+1}..t_{n+a+1}, overwriting the speculative draft K/V there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel
from hyperdraft.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, model_config_from_dict
from hyperdraft.models.decoder import (MLP, Attention, AttentionFn, DecoderLayer, DecoderLM, IdentityNorm, RMSNorm,
                                       RotaryFrequencies, attention_and_mlp_groups)
from hyperdraft.models.cpu_linear import Linear
from hyperdraft.kernels import use_fused_kernels
from hyperdraft.kernels.norm import embed_hidden_norm, embed_hidden_norm_reference
from hyperdraft.kernels.rope import rope_table
from hyperdraft.kernels.vocab_map import VocabMap
from hyperdraft.models.hot_vocab import HotVocab
from hyperdraft.models.tensor_parallel import VocabParallelEmbedding, empty_embedding, head_vocab_modules

EAGLE_ARCHITECTURES = {"LlamaForCausalLMEagle": "eagle", "LlamaForCausalLM": "eagle", "LlamaForCausalLMEagle3": "eagle3"}


@dataclass(frozen=True)
class EagleConfig:
    architecture: str
    kind: str  # "eagle" (EAGLE-1) or "eagle3"
    layer: ModelConfig  # the head's own Llama-layout view of its layers and RoPE: a fresh object, never the target's
    vocab_size: int  # the target vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    eagle_aux_hidden_state_layer_ids: tuple[int, ...] | None  # as written in the checkpoint; None when absent
    fc_bias: bool

    hidden_size = property(lambda self: self.layer.hidden_size)
    num_attention_heads = property(lambda self: self.layer.num_heads)
    num_key_value_heads = property(lambda self: self.layer.num_kv_heads)
    num_kv_heads = num_key_value_heads
    head_dim = property(lambda self: self.layer.head_dim)
    intermediate_size = property(lambda self: self.layer.intermediate_size)
    rms_norm_eps = property(lambda self: self.layer.rms_norm_eps)
    rope_theta = property(lambda self: self.layer.rope_theta)
    rope_scaling = property(lambda self: self.layer.rope_scaling)
    num_layers = property(lambda self: self.layer.num_layers)
    num_kv_layers = property(lambda self: self.layer.num_layers)  # every head layer attends over its K/V cache
    is_hybrid = False  # no recurrent state


def eagle_config_from_dict(raw: dict) -> EagleConfig:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in EAGLE_ARCHITECTURES:
        # a target-style model given as a head: say what drafts with it
        whole = " (a whole model: it drafts with speculative_algorithm STANDALONE)" \
            if arch in SUPPORTED_ARCHITECTURES else ""
        raise ValueError(f"draft architecture {arch!r} is not supported; supported draft architectures: "
                         f"{', '.join(EAGLE_ARCHITECTURES)}{whole}")
    kind = EAGLE_ARCHITECTURES[arch]
    # A new dict: the draft's own config is parsed exactly like a Llama ModelConfig, and nothing is mutated.
    layer = model_config_from_dict({**raw, "architectures": ["LlamaForCausalLM"],
                                    "num_hidden_layers": raw.get("num_hidden_layers", 1)})
    if layer.num_layers < 1 or (kind == "eagle3" and layer.num_layers != 1):
        raise ValueError(f"num_hidden_layers={layer.num_layers} is not supported for {arch} (EAGLE-3 heads have 1 layer)")
    vocab, draft_vocab, target_hidden, ids = layer.vocab_size, layer.vocab_size, layer.hidden_size, None
    if kind == "eagle3":
        draft_vocab = int(raw.get("draft_vocab_size") or vocab)
        target_hidden = int(raw.get("target_hidden_size") or layer.hidden_size)
        raw_ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids",
                                                      raw.get("eagle_aux_hidden_state_layer_ids"))
        if raw_ids is not None and not (isinstance(raw_ids, list) and all(type(i) is int for i in raw_ids)):
            raise ValueError(f"eagle_config.eagle_aux_hidden_state_layer_ids must be a list of layer indices, got "
                             f"{raw_ids!r}")
        ids = None if raw_ids is None else tuple(raw_ids)
        if not 0 < draft_vocab <= vocab:
            raise ValueError(f"draft_vocab_size={draft_vocab} must lie in [1, vocab_size={vocab}]")
    return EagleConfig(arch, kind, layer, vocab, draft_vocab, target_hidden, ids, bool(raw.get("bias", kind == "eagle")))


def load_eagle_config(path: str) -> EagleConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"draft model path {path!r} has no config.json")
    with open(cfg_path) as f:
        return eagle_config_from_dict(json.load(f))


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """Target layer OUTPUT ids an EAGLE-3 head reads when its config names none (see the module docstring)."""
    n = num_target_layers
    if n >= 7:
        return (1, n // 2 - 1, n - 4)
    if n < 3:
        raise ValueError(f"EAGLE-3 needs 3 distinct target layers, the target has num_layers={n}")
    hi = n - 2 if n >= 4 else n - 1
    lo = 1 if hi >= 3 else 0
    return (lo, (lo + hi) // 2, hi)


class _Head(nn.Module):
    """Parts both heads share: RoPE, embedding/lm_head ownership, KV-pool sizing."""

    vocab_map: VocabMap | None = None  # set when the head scores a draft vocabulary (compute_draft_logits)

    def __init__(self, cfg: EagleConfig, target: DecoderLM, own_embed: bool, own_lm_head: bool, lm_rows: int,
                 aux_layer_ids: tuple[int, ...] = ()):
        super().__init__()
        self.config = cfg
        self.target_num_layers = target.config.num_layers
        self.aux_layer_ids = aux_layer_ids  # target layers whose outputs the head reads (EAGLE-3; () for EAGLE-1)
        # Target modules used by reference live in a plain dict, not as submodules: head.to(), state_dict() and
        # parameters() never reach them, so the target's weights are neither copied nor converted. A target split
        # over a tensor-parallel group lends its vocabulary-parallel embedding and a whole copy of its lm_head.
        self._shared: dict[str, nn.Module] = {}
        embed, lm_head = head_vocab_modules(target, embed=not own_embed, lm_head=not own_lm_head)
        if own_embed:
            self.embed_tokens = empty_embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self._shared["embed_tokens"] = embed
        if own_lm_head:
            self.lm_head = Linear(cfg.hidden_size, lm_rows, bias=False)
        else:
            self._shared["lm_head"] = lm_head
        self.rotary = RotaryFrequencies(cfg.layer)

    inv_freq = property(lambda self: self.rotary.inv_freq)
    num_layers = property(lambda self: self.config.num_layers)
    num_kv_heads = property(lambda self: self.config.num_kv_heads)
    head_dim = property(lambda self: self.config.head_dim)
    hidden_size = property(lambda self: self.config.hidden_size)

    def _part(self, name: str) -> nn.Module:
        return self._modules[name] if name in self._modules else self._shared[name]

    def _embed(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self._part("embed_tokens")(input_ids).to(dtype)

    def _lookup(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, table) with table[ids] the tokens' embeddings: the whole table, or under a split target the looked-up
        rows themselves (its vocabulary-parallel embedding sums them over the group) indexed in order."""
        embed = self._part("embed_tokens")
        if isinstance(embed, VocabParallelEmbedding):
            return torch.arange(input_ids.shape[0], device=input_ids.device), embed(input_ids)
        return input_ids, embed.weight

    def _lm_head(self, hidden: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """-> logits [N, rows of lm_head] in the lm_head's dtype (stored as out_dtype when given)."""
        lm = self._part("lm_head")
        return lm(hidden.to(lm.weight.dtype), out_dtype=out_dtype)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_table(positions, self.inv_freq, dtype)

    def _check_hidden(self, hidden: torch.Tensor) -> None:
        if hidden.dim() != 2 or hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden must be [T, {self.hidden_size}], got {tuple(hidden.shape)}"
                             + (" (call project_target_hidden on the target's aux states first)" if hidden.dim() == 2 else ""))

    def finish_loading(self) -> None:
        """Called once the weights are in (EAGLE-3 validates d2t/t2d here)."""


class EagleHead(_Head):
    """EAGLE-1: fc(concat(embedding, hidden)) -> num_layers Llama layers (layer 0 without input norm); no final norm.
    With a token map (hot_ids) its draft logits cover only the map's tokens (models/hot_vocab.py)."""

    def __init__(self, cfg: EagleConfig, target: DecoderLM, own_embed: bool, own_lm_head: bool,
                 hot_ids: torch.Tensor | None = None, tp: TensorParallel = SINGLE):
        """cfg: the rank's share of the heads and MLP columns when the layers split over tp (fc, embedding and
        lm_head stay whole)."""
        super().__init__(cfg, target, own_embed, own_lm_head, cfg.vocab_size)
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(cfg.layer, i, tp) for i in range(cfg.num_layers))
        self.layers[0].input_layernorm = IdentityNorm()
        self.hot_vocab = None if hot_ids is None else HotVocab(cfg.hidden_size, cfg.vocab_size, hot_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attn: AttentionFn):
        self._check_hidden(hidden)
        x = self.fc(torch.cat((self._embed(input_ids, hidden.dtype), hidden), dim=-1))
        cos, sin = self._rope(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attn)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._lm_head(hidden, out_dtype=torch.float32)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, V] fp32 over the whole target vocabulary, or [N, Vd] over the token map's ids (vocab_map)."""
        return self.compute_logits(hidden) if self.hot_vocab is None else self.hot_vocab.logits(hidden)

    @property
    def vocab_map(self) -> VocabMap | None:
        return None if self.hot_vocab is None else self.hot_vocab.vocab_map

    def finish_loading(self) -> None:
        if self.hot_vocab is not None:
            self.hot_vocab.finish_loading(self._part("lm_head").weight)

    def project_target_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        self._check_hidden(target_hidden)  # the target's final normed hidden; fc runs inside forward
        return target_hidden


class Eagle3Layer(nn.Module):
    def fused_projection_groups(self) -> list[tuple[Linear, ...]]:
        return attention_and_mlp_groups(self)

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.self_attn = Attention(cfg, 0, tp)
        h2, d = 2 * cfg.hidden_size, cfg.head_dim
        self.self_attn.q_proj = Linear(h2, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.self_attn.k_proj = Linear(h2, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.self_attn.v_proj = Linear(h2, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def inputs(self, input_ids: torch.Tensor, table: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
               inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> ([T, 2H]: the normed token embeddings (table[input_ids]) beside the normed hidden states, and the RoPE
        cos/sin of positions); on CUDA one launch instead of five (gather, two norms, concatenation, cos/sin)."""
        norms = (self.input_layernorm.weight, self.hidden_norm.weight, self.input_layernorm.eps)
        if (use_fused_kernels(hidden) and table.dtype == hidden.dtype and table.is_contiguous()
                and positions.is_contiguous()):
            return embed_hidden_norm(input_ids, table, hidden, *norms, rope=(positions, inv_freq.float()))
        return (embed_hidden_norm_reference(input_ids, table, hidden, *norms),
                *rope_table(positions, inv_freq, hidden.dtype))

    def forward(self, x, hidden, cos, sin, attn: AttentionFn):
        """x: inputs() of the step's tokens and hidden; hidden: the residual stream."""
        h, residual = self.post_attention_layernorm.add_norm(self.self_attn(x, cos, sin, attn), hidden)
        return self.mlp(h, residual)


class Eagle3Head(_Head):
    """EAGLE-3: fc over 3 target aux states; one midlayer over (embedding, hidden); norm + lm_head over the draft vocab."""

    def __init__(self, cfg: EagleConfig, target: DecoderLM, own_embed: bool, own_lm_head: bool,
                 aux_layer_ids: tuple[int, ...] = (), tp: TensorParallel = SINGLE):
        """tp: as EagleHead's."""
        super().__init__(cfg, target, own_embed, own_lm_head, cfg.draft_vocab_size, aux_layer_ids)
        self.fc = Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.midlayer = Eagle3Layer(cfg.layer, tp)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size), persistent=False)
        self.register_buffer("target_to_draft", torch.zeros(cfg.vocab_size, dtype=torch.int32), persistent=False)
        self.identity_vocab = cfg.draft_vocab_size == cfg.vocab_size

    def finish_loading(self) -> None:
        cfg = self.config
        ids = torch.arange(cfg.draft_vocab_size, device=self.d2t.device) + self.d2t
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or ids.unique().numel() != ids.numel()):
            raise ValueError(f"d2t maps draft ids outside [0, vocab_size={cfg.vocab_size}) or onto the same target id twice")
        if int(self.t2d.sum()) != cfg.draft_vocab_size or not bool(self.t2d[ids].all()):
            raise ValueError("t2d does not mark exactly the target ids that d2t maps the draft vocabulary to")
        self.draft_to_target = ids
        self.identity_vocab = bool((self.d2t == 0).all()) and cfg.draft_vocab_size == cfg.vocab_size
        inverse = torch.full((cfg.vocab_size,), -1, dtype=torch.int32, device=ids.device)
        inverse[ids] = torch.arange(cfg.draft_vocab_size, dtype=torch.int32, device=ids.device)
        self.target_to_draft = inverse  # spread_logits's map: the draft id of each target id, -1 outside

    @property
    def vocab_map(self) -> VocabMap | None:
        """Built from the current buffers each time (they follow the module across .to())."""
        return None if self.identity_vocab else VocabMap(self.draft_to_target, self.target_to_draft)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, attn: AttentionFn):
        self._check_hidden(hidden)
        x, cos, sin = self.midlayer.inputs(*self._lookup(input_ids), hidden, positions, self.inv_freq)
        return self.midlayer(x, hidden, cos, sin, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, V] over the target vocabulary, -inf outside the draft vocabulary."""
        vocab_map, logits = self.vocab_map, self.compute_draft_logits(hidden)
        return logits if vocab_map is None else vocab_map.spread(logits)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, Vd] over the draft vocabulary (vocab_map says which target ids), or [N, V] fp32 when it is the
        target's own."""
        return self._lm_head(self.norm(hidden), out_dtype=torch.float32 if self.identity_vocab else None)

    def project_target_hidden(self, target_hidden: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """[T, 3*Ht] (or the 3 captured [T, Ht] states, ascending layer order) -> [T, H]."""
        if isinstance(target_hidden, (list, tuple)):
            target_hidden = torch.cat(list(target_hidden), dim=-1)
        want = 3 * self.config.target_hidden_size
        if target_hidden.dim() != 2 or target_hidden.shape[-1] != want:
            raise ValueError(f"EAGLE-3 fc expects [T, {want}] (3 aux states of target_hidden_size="
                             f"{self.config.target_hidden_size}), got {tuple(target_hidden.shape)}")
        return self.fc(target_hidden.to(self.fc.weight.dtype))


def aux_layer_ids(head: EagleHead | Eagle3Head) -> tuple[int, ...]:
    """Target layer ids whose OUTPUTS the head consumes; () for EAGLE-1, which consumes the final normed hidden."""
    return head.aux_layer_ids


def target_capture_layers(head: EagleHead | Eagle3Head) -> tuple[int, ...]:
    """The capture_layers to pass to the target's DecoderLM.forward (it captures layer inputs: output of i = input
    of i+1; the last layer's output is capture index num_layers)."""
    return tuple(sorted(i + 1 for i in head.aux_layer_ids))
