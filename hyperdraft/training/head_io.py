"""What train-draft writes: the head in the published EAGLE-3 layout (the files our loader and SGLang's read), and
a training checkpoint to resume from.

Layout: config.json (LlamaForCausalLMEagle3; draft_vocab_size, target_hidden_size,
eagle_config.eagle_aux_hidden_state_layer_ids) and model.safetensors with fc, midlayer.*, norm, lm_head, d2t, t2d.
The embedding is the target's, shared at load time, so it is not written.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from hyperdraft.models.config import ModelConfig

CHECKPOINT = "checkpoint.pt"


def head_config(target: ModelConfig, draft_vocab_size: int, aux_layer_ids: tuple[int, ...],
                intermediate_size: int | None = None) -> dict:
    """An EAGLE-3 head's config.json for this target: one Llama layer of the target's width and RoPE, its MLP as wide
    as the target's unless intermediate_size says otherwise (the layout's loaders read the width from here)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": _rope_scaling(target),
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": target.hidden_size,
        "tie_word_embeddings": False,
        "bias": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)},
    }


def _rope_scaling(target: ModelConfig) -> dict | None:
    scaling = {k: (list(v) if isinstance(v, tuple) else v) for k, v in target.rope_scaling_dict.items()}
    return scaling or None


def save_head(out_dir: str, config: dict, head: torch.nn.Module, dtype: torch.dtype) -> None:
    """config.json + model.safetensors; floating tensors stored as dtype (the target's)."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = {name: (t.to(dtype) if t.is_floating_point() else t).detach().contiguous().cpu()
               for name, t in head.state_dict().items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def save_checkpoint(out_dir: str, state: dict) -> None:
    """Written aside and renamed: an interrupted save leaves the previous checkpoint."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, CHECKPOINT)
    torch.save(state, path + ".partial")
    os.replace(path + ".partial", path)


def load_checkpoint(out_dir: str) -> dict:
    path = os.path.join(out_dir, CHECKPOINT)
    if not os.path.isfile(path):
        raise ValueError(f"--resume: {path} does not exist (train without --resume first)")
    return torch.load(path, map_location="cpu", weights_only=False)
