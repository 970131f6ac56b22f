"""MtpHead: a hybrid model's own multi-token-prediction module (Qwen3.5 / Qwen3-Next `mtp.*` weights), as a draft head.

Head position i consumes the target's final normed hidden state h_i and the next token t_{i+1}, as an EAGLE head does
(the same catch-up, draft steps and graphs serve both: speculative/proposers/eagle.py):
  z = fc([pre_fc_norm_embedding(embed(t_{i+1})) ; pre_fc_norm_hidden(h_i)])      fc: 2H -> H, no bias
  z = one gated full-attention decoder layer (its own paged K/V)
  g = norm(z);  logits = lm_head(g)                                              embed and lm_head: the target's
g also feeds the next draft step, so one module drafts any number of steps. With a token map (hot_vocab.py) the
logits cover only the map's tokens: the lm_head over a 248k vocabulary is most of a draft step's bytes.

The head owns a frozen config of its own (MtpConfig); the target's layer is built from the target's frozen
ModelConfig, which nothing can rewrite, and a layer's kind is its module's type: drafting cannot change how the
target routes its layers (seed 000's first bug).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from hyperdraft.kernels.rope import rope_table
from hyperdraft.models.config import ModelConfig, load_model_config
from hyperdraft.models.cpu_linear import Linear, fuse_projections
from hyperdraft.models.decoder import AttentionFn, RotaryFrequencies
from hyperdraft.kernels.vocab_map import VocabMap
from hyperdraft.models.hot_vocab import HotVocab
from hyperdraft.models.hybrid import FullAttentionLayer, HybridLM, ZeroCenteredRMSNorm
from hyperdraft.models.loader import checkpoint_name, fill_dummy_weights, safetensors_files
from hyperdraft.models.moe import pack_experts
from hyperdraft.models.tensor_parallel import head_vocab_modules

PREFIX = "mtp."


@dataclass(frozen=True)
class MtpConfig:
    layer: ModelConfig  # the decoder layer's shapes: the target's own, copied
    architecture: str
    kind: str = "mtp"
    num_layers: int = 1
    is_hybrid: bool = False  # its layer is full attention: no recurrent state

    num_kv_layers = property(lambda self: self.num_layers)
    hidden_size = property(lambda self: self.layer.hidden_size)
    num_kv_heads = property(lambda self: self.layer.num_kv_heads)
    head_dim = property(lambda self: self.layer.head_dim)


class MtpHead(nn.Module):
    aux_layer_ids: tuple[int, ...] = ()  # it reads the target's final hidden state, no aux layers

    def __init__(self, cfg: MtpConfig, target: HybridLM, hot_ids: torch.Tensor | None = None):
        """hot_ids: the token map's ids (hot_vocab.load_token_map), or None to score the whole vocabulary."""
        super().__init__()
        self.config = cfg
        layer_cfg = cfg.layer
        h = layer_cfg.hidden_size
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, layer_cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, layer_cfg.rms_norm_eps)
        self.layers = nn.ModuleList([FullAttentionLayer(layer_cfg, 0, 0)])
        self.norm = ZeroCenteredRMSNorm(h, layer_cfg.rms_norm_eps)
        # The target's modules by reference, outside the module tree: .to(), state_dict() never reach them.
        embed, lm_head = head_vocab_modules(target)  # the target's (a split target: its vocabulary-parallel
        # embedding, a whole copy of its lm_head)
        self._shared = {"embed_tokens": embed, "lm_head": lm_head}
        self.hot_vocab = None if hot_ids is None else HotVocab(h, layer_cfg.vocab_size, hot_ids)
        self.rotary = RotaryFrequencies(layer_cfg)

    inv_freq = property(lambda self: self.rotary.inv_freq)
    num_layers = property(lambda self: self.config.num_layers)
    num_kv_heads = property(lambda self: self.config.num_kv_heads)
    head_dim = property(lambda self: self.config.head_dim)
    hidden_size = property(lambda self: self.config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                attn: AttentionFn) -> torch.Tensor:
        """input_ids [T], positions [T], hidden [T, H] (the target's, or this head's own previous output) -> [T, H]."""
        embed = self._shared["embed_tokens"](input_ids).to(hidden.dtype)
        z = self.fc(torch.cat([self.pre_fc_norm_embedding(embed), self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = rope_table(positions, self.inv_freq, z.dtype)
        x, residual = self.layers[0](z, None, cos, sin, attn, None)
        return self.norm.add_norm(x, residual)[0]

    @property
    def vocab_map(self) -> VocabMap | None:
        """Which target ids compute_draft_logits' columns are: None for the whole vocabulary."""
        return None if self.hot_vocab is None else self.hot_vocab.vocab_map

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] fp32 logits, or [N, Vd] over the token map's ids (vocab_map)."""
        if self.hot_vocab is not None:
            return self.hot_vocab.logits(hidden)
        lm = self._shared["lm_head"]
        return lm(hidden.to(lm.weight.dtype), out_dtype=torch.float32)

    def finish_loading(self) -> None:
        if self.hot_vocab is not None:
            self.hot_vocab.finish_loading(self._shared["lm_head"].weight)

    def project_target_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden  # the target's final normed hidden state, as it is


def load_model_config_if_model(path: str) -> ModelConfig | None:
    """A hybrid language model's config at path (a checkpoint that can carry an MTP module), else None (an EAGLE
    head's directory, or anything else)."""
    from hyperdraft.models.config import HYBRID_ARCHITECTURES, load_model_config

    try:
        cfg = load_model_config(path)
    except ValueError:
        return None
    return cfg if cfg.architecture in HYBRID_ARCHITECTURES else None


def mtp_weight_names(path: str) -> list[str]:
    """The checkpoint's mtp.* tensor names (none: it has no MTP module)."""
    from safetensors import safe_open

    names = []
    for f in safetensors_files(path):
        with safe_open(f, framework="pt") as handle:
            names += [n for n in handle.keys() if checkpoint_name(n).startswith(PREFIX)]
    return names


def load_mtp_head(path: str, target: HybridLM, load_format: str = "auto",
                  hot_ids: torch.Tensor | None = None) -> MtpHead:
    """The MTP module of the checkpoint at `path` (the target's own), on the target's device and dtype; hot_ids:
    a token map's ids (its logits then cover only those)."""
    from safetensors import safe_open

    if not target.config.is_hybrid:
        raise ValueError(f"{path!r} is a {target.config.architecture}: only hybrid Qwen3.5 models carry an MTP module")
    param = next(target.parameters())
    # A split target's config holds its rank's share of the heads; the MTP layer is whole on every rank.
    whole = target.config if target.tp.size == 1 else load_model_config(path)
    cfg = MtpConfig(dataclasses.replace(whole, num_layers=1, layer_types=("full_attention",)), whole.architecture)
    with torch.device("meta"):
        head = MtpHead(cfg, target, hot_ids)
    head = head.to_empty(device=param.device)
    state = {n: t for n, t in head.state_dict().items() if not n.startswith("hot_vocab.")}  # copied, not loaded
    if load_format == "dummy":
        fill_dummy_weights(head)
    else:
        names = mtp_weight_names(path)
        if not names:
            raise ValueError(f"{path!r} has no mtp.* weights, so it carries no MTP module to draft with "
                             "(speculative_algorithm NEXTN, MTP, or EAGLE without speculative_draft_model_path, drafts "
                             "with the target's own): pass speculative_draft_model_path with an EAGLE head")
        loaded = set()
        for f in safetensors_files(path):
            with safe_open(f, framework="pt") as handle:
                for stored in handle.keys():
                    name = checkpoint_name(stored)
                    if not name.startswith(PREFIX) or name[len(PREFIX):] not in state:
                        continue
                    tensor, mine = handle.get_tensor(stored), state[name[len(PREFIX):]]
                    if tensor.shape != mine.shape:
                        raise ValueError(f"MTP weight {name} has shape {tuple(tensor.shape)}, expected {tuple(mine.shape)}")
                    with torch.no_grad():
                        mine.copy_(tensor)
                    loaded.add(name[len(PREFIX):])
        missing = sorted(set(state) - loaded)
        if missing:
            raise ValueError(f"{path!r}: the MTP module lacks weights {['mtp.' + n for n in missing[:5]]}")
    head.to(param.dtype)
    head.finish_loading()
    fuse_projections(head.layers)
    if cfg.layer.moe is not None:
        pack_experts(head.layers)
    return head.eval().requires_grad_(False)
