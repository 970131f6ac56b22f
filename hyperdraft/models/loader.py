"""Load a Hugging Face directory (config.json plus one or several *.safetensors shards) or a Llama .gguf file, and
its tokenizer."""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from hyperdraft.distributed.tensor_parallel import SINGLE, TensorParallel
from hyperdraft.models.config import ModelConfig, load_model_config
from hyperdraft.models.cpu_linear import fuse_projections
from hyperdraft.models.decoder import DecoderLM
from hyperdraft.models.gguf import is_gguf, load_gguf_tokenizer, load_gguf_weights
from hyperdraft.models.hybrid import HybridLM, is_packed_gdn_projection, unpack_gdn_projections
from hyperdraft.models.moe import pack_experts
from hyperdraft.models.tensor_parallel import rank_config, shard_state

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name == "auto":
        dtype = DTYPES[cfg.dtype]
        # Half precision matmuls are slow or missing on CPU; auto means "what the checkpoint and device suit".
        return torch.float32 if device.type == "cpu" else dtype
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; allowed values: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def safetensors_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, s) for s in shards]
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"model path {model_path!r} has no *.safetensors weights")
    return files


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a file that is not one (cut short by a killed write, say) is a ValueError that
    names it, where the reader's own error named no file and escaped the CLI as a traceback."""
    try:
        return load_file(path)
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's name as this package's modules spell it: a multimodal Qwen3.5 keeps its language model
    under model.language_model."""
    return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name


def load_weights(model: torch.nn.Module, model_path: str) -> None:
    params = dict(model.named_parameters())
    cfg = model.config
    tied = cfg.tie_word_embeddings
    loaded = set()
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt") as f:
            for stored in f.keys():
                name = checkpoint_name(stored)
                if tied and name == "lm_head.weight":
                    continue
                if is_packed_gdn_projection(name, cfg):
                    pieces = unpack_gdn_projections(name, f.get_tensor(stored), cfg)
                elif name in params:
                    pieces = [(name, f.get_tensor(stored))]
                else:
                    continue  # rotary inv_freq buffers of old checkpoints, a vision tower, MTP layers (own loader)
                for name, tensor in pieces:
                    if tensor.shape != params[name].shape:
                        raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, "
                                         f"model expects {tuple(params[name].shape)}")
                    with torch.no_grad():
                        params[name].copy_(tensor)
                    loaded.add(name)
    missing = set(params) - loaded - ({"lm_head.weight"} if tied else set())
    if missing:
        raise ValueError(f"checkpoint {model_path!r} lacks weights: {sorted(missing)[:5]}")


def fill_dummy_weights(module: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes (load_format="dummy"): a forward costs what it costs with real weights.
    Norm weights are ones and the rest N(0, 0.02), so activations stay finite through deep stacks in bf16."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if not param.is_floating_point():
                continue
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)


def load_model(model_path: str, dtype: str, device: torch.device, load_format: str = "auto",
               tp: TensorParallel = SINGLE) -> DecoderLM | HybridLM:
    """The model at model_path; under tensor parallelism (tp.size > 1) this rank's part of it. Random weights
    (load_format "dummy") are drawn for the part alone, so a model too big for one device can be benchmarked split."""
    cfg = load_model_config(model_path)
    part_cfg = rank_config(cfg, tp)  # refuses a model that cannot split before anything loads
    if tp.size > 1 and load_format != "dummy":
        return split_model(load_model(model_path, dtype, device, load_format), tp)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    with torch.device("meta"):
        model = HybridLM(part_cfg, tp) if cfg.is_hybrid else DecoderLM(part_cfg, tp=tp)
    if load_format == "dummy":  # allocated in the final dtype: a 70B part in float32 would not fit an 80 GB GPU
        model = model.to(torch_dtype)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if load_format == "dummy":
        fill_dummy_weights(model)
    else:
        (load_gguf_weights if is_gguf(model_path) else load_weights)(model, model_path)
    model.to(torch_dtype)
    fuse_projections(model.model.layers)  # q/k/v and gate/up as one product each (models/cpu_linear.py)
    if cfg.moe is not None:
        pack_experts(model.model.layers)  # the routed experts' weights as two stacks (models/moe.py)
    return model.eval().requires_grad_(False)


def split_model(whole: DecoderLM | HybridLM, tp: TensorParallel) -> DecoderLM | HybridLM:
    """This rank's part of a loaded dense or hybrid model: its own config, its slices of every weight (models/tensor_parallel.py).
    The whole model is loaded first on every rank (twice the memory while splitting): one loader serves Hugging Face
    and GGUF checkpoints alike."""
    cfg, param = whole.config, next(whole.parameters())
    with torch.device("meta"):
        part = HybridLM(rank_config(cfg, tp), tp) if cfg.is_hybrid else DecoderLM(rank_config(cfg, tp), tp=tp)
    part = part.to_empty(device=param.device)
    if cfg.tie_word_embeddings:
        part.lm_head.weight = part.model.embed_tokens.weight
    shard_state(part, whole, cfg, tp)
    part.to(param.dtype)
    fuse_projections(part.model.layers)
    if cfg.moe is not None:
        pack_experts(part.model.layers)  # the part's own stacks: without them a CUDA graph captures the torch reference
    return part.eval().requires_grad_(False)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer of a Hugging Face directory or a .gguf file; a ValueError naming the path when there is none."""
    from transformers import AutoTokenizer

    try:
        if is_gguf(path):
            return load_gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many types for a missing tokenizer
        raise ValueError(f"cannot load a tokenizer from {path!r} ({e}); pass skip_tokenizer_init=True to run from "
                         "token ids") from e
