"""What train-draft writes: the head in the published EAGLE-3 layout (the files our loader and SGLang's read), and
a training checkpoint to resume from; and a published head read back, to start a new run from (--init).

Layout: config.json (LlamaForCausalLMEagle3; draft_vocab_size, target_hidden_size,
eagle_config.eagle_aux_hidden_state_layer_ids) and model.safetensors with fc, midlayer.*, norm, lm_head, d2t, t2d.
The embedding is the target's, shared at load time, so it is not written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from hyperdraft.models.config import ModelConfig
from hyperdraft.models.eagle import Eagle3Head, default_aux_layer_ids, load_eagle_config
from hyperdraft.models.loader import read_safetensors
from hyperdraft.training.draft_vocab import DraftVocab

CHECKPOINT = "checkpoint.pt"
HELD_OUT = "held_out_prompts.json"


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
    """config.json + model.safetensors; floating tensors stored as dtype (the target's). Each file is written aside
    and renamed, so a run killed while publishing leaves the head published before (the weights were rewritten in
    place, and a kill left a truncated file where a usable head had been); a head whose weights are not finite (the
    training diverged) is refused, not published."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = {name: (t.to(dtype) if t.is_floating_point() else t).detach().contiguous().cpu()
               for name, t in head.state_dict().items()}
    diverged = sorted(n for n, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all()))
    if diverged:
        raise ValueError(f"training diverged: the head's {diverged[:3]} hold NaN or inf, so it is not published "
                         "(lower --lr)")
    weights, config_path = os.path.join(out_dir, "model.safetensors"), os.path.join(out_dir, "config.json")
    save_file(tensors, weights + ".partial")
    with open(config_path + ".partial", "w") as f:  # torch_dtype: what the weights are stored in (loaders that read
        json.dump({**config, "torch_dtype": str(dtype).removeprefix("torch.")}, f, indent=2)  # it run the head so)
    os.replace(weights + ".partial", weights)  # a run's config is the same every epoch: the weights decide
    os.replace(config_path + ".partial", config_path)


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
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError) as e:  # cut short: torch's own message names no file
        raise ValueError(f"--resume: {path} cannot be read ({e}); remove it to train from the start") from None


@dataclass(frozen=True)
class PublishedHead:
    """A head in the published layout, as a new run starts from it: what it reads, how wide it is, what it scores."""

    aux_layer_ids: tuple[int, ...]
    intermediate_size: int
    vocab: DraftVocab  # the target ids its lm_head rows score
    tensors: dict[str, torch.Tensor]  # model.safetensors, as written
    held_out: frozenset[str] | None = None  # its run's held-out prompts (plan.prompt_key); None: not recorded

    def refuse_other(self, aux_layer_ids: tuple[int, ...] | None, intermediate_size: int | None,
                     draft_vocab_size: int | None) -> None:
        """What the head fixes must not be asked otherwise (None: not asked)."""
        asked = {"aux_layer_ids": (tuple(sorted(aux_layer_ids)) if aux_layer_ids else None, self.aux_layer_ids),
                 "head_intermediate_size": (intermediate_size, self.intermediate_size),
                 "draft_vocab_size": (draft_vocab_size, int(self.vocab.target_ids.numel()))}
        for name, (value, own) in asked.items():
            if value is not None and value != own:
                raise ValueError(f"{name} {list(value) if isinstance(value, tuple) else value} differs from the "
                                 f"--init head's {list(own) if isinstance(own, tuple) else own} (leave it out: the "
                                 "head fixes it)")

    def load_into(self, head: Eagle3Head) -> None:
        """The tensors into a head built to this one's shape (cast to its dtype); every tensor must find its place."""
        missing, unexpected = head.load_state_dict(self.tensors, strict=False)
        if missing or unexpected:
            raise ValueError(f"init: the head's tensors do not match the layout (missing {missing}, unexpected "
                             f"{unexpected})")
        head.finish_loading()


def read_head(head_dir: str, target: ModelConfig) -> PublishedHead:
    """head_dir's config (parsed as the engine parses a draft's) and tensors, refused unless an EAGLE-3 head of this
    target; aux layers the config does not name are the ones the engine would read."""
    cfg = load_eagle_config(head_dir)
    if cfg.kind != "eagle3":
        raise ValueError(f"init: {head_dir} is a {cfg.architecture} head; train-draft trains EAGLE-3 heads")
    for name, have, want in (("hidden_size", cfg.hidden_size, target.hidden_size),
                             ("vocab_size", cfg.vocab_size, target.vocab_size)):
        if have != want:
            raise ValueError(f"init: {head_dir} has {name}={have}, the target {want}")
    tensors = read_safetensors(os.path.join(head_dir, "model.safetensors"))
    try:  # no d2t: the whole vocabulary
        vocab = DraftVocab.from_d2t(tensors.get("d2t", torch.zeros(target.vocab_size, dtype=torch.int64)))
    except ValueError as e:
        raise ValueError(f"init: {head_dir}'s d2t: {e}") from None
    aux_layer_ids = cfg.eagle_aux_hidden_state_layer_ids or default_aux_layer_ids(target.num_layers)
    if not all(0 <= i < target.num_layers for i in aux_layer_ids):  # it failed at the first batch, naming a shape
        raise ValueError(f"init: {head_dir} reads target layers {list(aux_layer_ids)}; the target has "
                         f"num_layers={target.num_layers}")
    held_path = os.path.join(head_dir, HELD_OUT)
    held_out = None
    if os.path.isfile(held_path):
        with open(held_path) as f:
            held_out = frozenset(json.load(f))
    return PublishedHead(tuple(aux_layer_ids), cfg.intermediate_size, vocab, tensors, held_out)


def write_held_out(out_dir: str, keys: frozenset[str]) -> None:
    """The run's held-out prompts (plan.prompt_key), beside the head: a run started from it (--init) holds out the
    same ones, never prompts the head trained on."""
    with open(os.path.join(out_dir, HELD_OUT), "w") as f:
        json.dump(sorted(keys), f)
