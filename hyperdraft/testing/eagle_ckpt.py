"""Random-weight EAGLE-1 / EAGLE-3 draft checkpoints in the published layouts, for a given target checkpoint.

Weights are N(0, 0.2) like hyperdraft.testing.tiny's initializer_range, so draft logits are decisive; norm weights are
1 + N(0, 0.1) rather than ones, so a loader that swapped two norms would be caught.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from hyperdraft.models.eagle import default_aux_layer_ids


def write_random_eagle_checkpoint(path: str, target_path: str, kind: str = "eagle3", draft_vocab_size: int | None = None,
                                  seed: int = 0, with_embed: bool = False, **overrides) -> str:
    """Write config.json + model.safetensors for a draft head of `target_path`; return path.

    kind: "eagle3" (LlamaForCausalLMEagle3) or "eagle" (EAGLE-1, LlamaForCausalLMEagle).
    draft_vocab_size (EAGLE-3): a random, sorted subset of that many target ids forms the draft vocabulary
    (d2t = offsets, t2d = mask); None keeps the full target vocabulary (d2t all zero, t2d all True).
    with_embed: also write embed_tokens.weight (otherwise the loader shares the target's embedding).
    overrides: config.json fields set after the defaults (a None value deletes the field); weight shapes follow the
    final config, so e.g. hidden_size=... or vocab_size=... writes a consistently shaped but mismatched head.
    """
    if kind not in ("eagle", "eagle3"):
        raise ValueError(f"kind {kind!r} is not supported; allowed values: 'eagle', 'eagle3'")
    with open(os.path.join(target_path, "config.json")) as f:
        target = json.load(f)
    cfg = _head_config(target, kind)
    _add_kind_fields(cfg, target, kind, draft_vocab_size)
    _apply_overrides(cfg, overrides)
    head = _RandomHead(cfg, seed)
    if kind == "eagle":
        _draw_eagle1(head)
    else:
        _draw_eagle3(head)
    if with_embed:  # drawn last, so adding the embedding leaves every other tensor of the same seed unchanged
        head.w["embed_tokens.weight"] = head.rnd(head.v, head.h)
    _save(path, cfg, head.w)
    return path


def _head_config(t: dict, kind: str) -> dict:
    """The fields both kinds share: one Llama layer shaped like the target's, with the target's RoPE."""
    heads = t["num_attention_heads"]
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3" if kind == "eagle3" else "LlamaForCausalLMEagle"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": t["hidden_size"],
        "intermediate_size": t["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": t.get("num_key_value_heads") or heads,
        "head_dim": t.get("head_dim") or t["hidden_size"] // heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": t.get("max_position_embeddings", 4096),
        "vocab_size": t["vocab_size"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    for key in ("rope_parameters", "rope_scaling", "rope_theta"):  # the head uses the target's RoPE
        if t.get(key) is not None:
            cfg[key] = t[key]
    return cfg


def _add_kind_fields(cfg: dict, t: dict, kind: str, draft_vocab_size: int | None) -> None:
    if kind == "eagle":
        cfg["bias"] = True
        return
    cfg["draft_vocab_size"] = draft_vocab_size or t["vocab_size"]
    # default_aux_layer_ids raises below 3 target layers: such a head goes out without ids, for the loader to reject
    if t["num_hidden_layers"] >= 3:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(default_aux_layer_ids(t["num_hidden_layers"])),
                               "use_aux_hidden_state": True}


def _apply_overrides(cfg: dict, overrides: dict) -> None:
    for key, value in overrides.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value


class _RandomHead:
    """A head's tensors, drawn from one seeded generator. The draw order is part of the output: the same seed must
    keep giving a byte-identical file, so tensors are drawn in exactly the order they are added."""

    def __init__(self, cfg: dict, seed: int):
        self.cfg = cfg
        self.g = torch.Generator().manual_seed(seed)
        self.h, self.v, self.d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
        self.w: dict[str, torch.Tensor] = {}

    def rnd(self, *shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g) * std

    def norm(self, n: int) -> torch.Tensor:
        return 1.0 + self.rnd(n, std=0.1)

    def layer(self, prefix: str, attn_in: int, input_norm: bool) -> None:
        cfg, h, d, w = self.cfg, self.h, self.d, self.w
        nh, nkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
        w[prefix + "self_attn.q_proj.weight"] = self.rnd(nh * d, attn_in)
        w[prefix + "self_attn.k_proj.weight"] = self.rnd(nkv * d, attn_in)
        w[prefix + "self_attn.v_proj.weight"] = self.rnd(nkv * d, attn_in)
        w[prefix + "self_attn.o_proj.weight"] = self.rnd(h, nh * d)
        w[prefix + "mlp.gate_proj.weight"] = self.rnd(inter, h)
        w[prefix + "mlp.up_proj.weight"] = self.rnd(inter, h)
        w[prefix + "mlp.down_proj.weight"] = self.rnd(h, inter)
        w[prefix + "post_attention_layernorm.weight"] = self.norm(h)
        if input_norm:
            w[prefix + "input_layernorm.weight"] = self.norm(h)


def _draw_eagle1(head: _RandomHead) -> None:
    """EAGLE-1: fc over [embedding, hidden] (with bias unless the config turns it off), then plain decoder layers."""
    cfg, h, w = head.cfg, head.h, head.w
    w["fc.weight"] = head.rnd(h, 2 * h)
    if cfg.get("bias", True):
        w["fc.bias"] = head.rnd(h)
    for i in range(cfg["num_hidden_layers"]):
        head.layer(f"layers.{i}.", h, input_norm=i > 0)  # EAGLE-1's layer 0 has no input_layernorm


def _draw_eagle3(head: _RandomHead) -> None:
    """EAGLE-3: fc over three target hidden states, one midlayer over [embedding, hidden], its own lm_head over the
    draft vocabulary and the d2t / t2d maps between the two vocabularies."""
    cfg, h, v, w = head.cfg, head.h, head.v, head.w
    vd = cfg["draft_vocab_size"]
    w["fc.weight"] = head.rnd(h, 3 * cfg.get("target_hidden_size", h))
    if cfg.get("bias"):
        w["fc.bias"] = head.rnd(h)
    head.layer("midlayer.", 2 * h, input_norm=True)
    w["midlayer.hidden_norm.weight"] = head.norm(h)
    w["norm.weight"] = head.norm(h)
    w["lm_head.weight"] = head.rnd(vd, h)
    chosen = torch.arange(v) if vd >= v else torch.randperm(v, generator=head.g)[:vd].sort().values
    w["d2t"] = chosen - torch.arange(len(chosen))  # offsets: target_id = draft_id + d2t[draft_id]
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[chosen] = True
    w["t2d"] = t2d


def _save(path: str, cfg: dict, weights: dict[str, torch.Tensor]) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file({k: x.contiguous() for k, x in weights.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
