"""Load Llama- and Qwen2-architecture GGUF files (llama.cpp's format) as hyperdraft models.

A .gguf file carries the config (as `llama.*` or `qwen2.*` metadata), the weights (possibly quantized) and the
tokenizer. The config becomes an HF-style dict for model_config_from_dict, the weights are dequantized to fp32 with
`gguf.quants.dequantize` and renamed to Hugging Face's module names, and the tokenizer is rebuilt by
transformers' own GGUF conversion (chat template included).

The catch: llama.cpp's HF->GGUF converter permutes the rows of a Llama's attn_q and attn_k so that its RoPE, which
rotates adjacent pairs (2i, 2i+1), matches HF's rotate-half RoPE (pairs i, i + d/2). The loader undoes that permutation,
so the decoder keeps its rotate-half RoPE. llama.cpp stores Llama 3 RoPE scaling not as metadata but as a
`rope_freqs` tensor of per-frequency divisors; it becomes the "freq_factors" rope type.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import math
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hyperdraft.models.gguf_file import GGUFFile, read_gguf
from hyperdraft.options import cache_dir

# GGUF architecture -> (HF architecture, model_type). llama.cpp permutes attn_q/attn_k rows for Llama only: its
# Qwen2 converter keeps HF's order (Qwen2 RoPE is rotate-half in llama.cpp too).
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}
SUPPORTED_GGUF_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)
PERMUTED_QK_ARCHITECTURES = ("llama",)
SUPPORTED_GGML_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_gguf(path: Any) -> bool:
    """True for an existing file whose name ends in .gguf."""
    return isinstance(path, (str, os.PathLike)) and str(path).lower().endswith(".gguf") and os.path.isfile(path)


_last_reader: dict = {}  # one parsed file, so load_model parses its GGUF once for the config and the weights


def _open(path: str) -> GGUFFile:
    """path's parsed header and mapped tensors; a corrupt, truncated or non-GGUF file raises ValueError."""
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} does not exist")
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_mtime_ns, st.st_size)
    if key in _last_reader:
        return _last_reader[key]
    try:
        reader = read_gguf(path)
    except Exception as e:  # ValueError, struct.error, UnicodeDecodeError, ... on bad bytes
        raise ValueError(f"{path!r} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    _last_reader.clear()
    _last_reader[key] = reader
    return reader


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def _check_architecture(reader, path: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} of {path!r} is not supported; "
                         f"supported GGUF architectures: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    return arch


def _dequantize(t) -> torch.Tensor:
    """One GGUF tensor as an fp32 torch tensor in PyTorch's [rows, cols] order."""
    from gguf.quants import dequantize

    kind = t.tensor_type.name
    if kind not in SUPPORTED_GGML_TYPES:
        raise ValueError(f"GGUF tensor {t.name} has GGML type {kind}, which is not supported; "
                         f"supported types: {', '.join(SUPPORTED_GGML_TYPES)}")
    values = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a copy: the reader maps read-only
    shape = tuple(reversed(t.shape))  # GGUF lists dimensions innermost first
    return torch.from_numpy(values).reshape(shape)


def _rope_scaling(reader, arch: str, tensors: dict, head_dim: int) -> dict | None:
    if "rope_freqs.weight" in tensors:  # how llama.cpp's converter writes Llama 3 scaling
        factors = _dequantize(tensors["rope_freqs.weight"]).flatten()
        if factors.numel() != head_dim // 2 or not torch.isfinite(factors).all() or (factors <= 0).any():
            raise ValueError(f"GGUF tensor rope_freqs.weight must hold {head_dim // 2} positive divisors (one per "
                             f"RoPE frequency of head dimension {head_dim}), got {factors.numel()} values")
        return {"rope_type": "freq_factors", "factors": tuple(float(x) for x in factors.tolist())}
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor_key = f"{arch}.rope.scaling.factor" if f"{arch}.rope.scaling.factor" in reader.metadata \
        else f"{arch}.rope.scale_linear"
    factor = _field(reader, factor_key)
    if kind in (None, "none") and factor in (None, 1.0):
        return None
    if kind not in (None, "linear"):
        raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported; supported: none, linear, rope_freqs factors")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 0:
        raise ValueError(f"GGUF metadata {factor_key} must be a positive number for linear RoPE scaling, "
                         f"got {factor!r}")
    return {"rope_type": "linear", "factor": float(factor)}


@dataclass(frozen=True)
class _ArchMetadata:
    """The `{arch}.*` metadata keys of one file, each read with the check its use needs."""

    reader: GGUFFile
    arch: str
    path: str

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.reader.metadata

    def get(self, key: str, default: Any = None, required: bool = True) -> Any:
        value = _field(self.reader, f"{self.arch}.{key}", default)
        if value is None and required:
            raise ValueError(f"GGUF file {self.path!r} lacks the metadata key {self.arch}.{key}")
        if isinstance(value, list):
            raise ValueError(f"GGUF metadata {self.arch}.{key} varies per layer, which is not supported")
        return value

    def count(self, key: str, default: Any = None) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"GGUF metadata {self.arch}.{key} must be a positive integer, got {value!r}")
        return value

    def number(self, key: str, default: Any = None) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"GGUF metadata {self.arch}.{key} must be a positive number, got {value!r}")
        return float(value)


def _attention_shape(meta: _ArchMetadata) -> tuple[int, int, int, int]:
    """(hidden size, query heads, key/value heads, head dimension), checked against each other."""
    arch = meta.arch
    hidden, heads = meta.count("embedding_length"), meta.count("attention.head_count")
    kv_heads = meta.count("attention.head_count_kv", heads)
    if heads % kv_heads:
        raise ValueError(f"GGUF metadata {arch}.attention.head_count={heads} is not a multiple of "
                         f"{arch}.attention.head_count_kv={kv_heads}")
    if not meta.has("attention.key_length") and hidden % heads:
        raise ValueError(f"GGUF metadata {arch}.embedding_length={hidden} is not a multiple of "
                         f"{arch}.attention.head_count={heads}, and {arch}.attention.key_length is not given")
    head_dim = meta.count("attention.key_length", hidden // heads)
    if meta.count("attention.value_length", head_dim) != head_dim or meta.count("rope.dimension_count",
                                                                                  head_dim) != head_dim:
        raise ValueError(f"GGUF file {meta.path!r}: value length or RoPE dimension differs from the head dimension "
                         f"{head_dim} (partial rotary embeddings are not supported)")
    return hidden, heads, kv_heads, head_dim


def _config_dict(reader, path: str) -> dict:
    arch = _check_architecture(reader, path)
    meta = _ArchMetadata(reader, arch, path)
    tensors = {t.name: t for t in reader.tensors}
    hidden, heads, kv_heads, head_dim = _attention_shape(meta)
    if "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[-1])
    else:
        vocab = int(meta.get("vocab_size", None, False) or len(_field(reader, "tokenizer.ggml.tokens", [])))
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch][0]],
        "model_type": GGUF_ARCHITECTURES[arch][1],
        "hidden_size": hidden,
        "intermediate_size": meta.count("feed_forward_length"),
        "num_hidden_layers": meta.count("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.number("rope.freq_base", 10000.0),
        "max_position_embeddings": meta.count("context_length", 4096),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": "float32",
    }
    rope = _rope_scaling(reader, arch, tensors, head_dim)
    if rope is not None:
        config["rope_scaling"] = rope
    _check_tensor_list(config, tensors, path, arch)
    return config


def _expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, for every weight and bias such a model can hold."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    per_layer = {
        "self_attn.q_proj": ((q, h), (q,)), "self_attn.k_proj": ((kv, h), (kv,)),
        "self_attn.v_proj": ((kv, h), (kv,)), "self_attn.o_proj": ((h, q), (h,)),
        "mlp.gate_proj": ((inter, h), (inter,)), "mlp.up_proj": ((inter, h), (inter,)),
        "mlp.down_proj": ((h, inter), (h,)), "input_layernorm": ((h,), None), "post_attention_layernorm": ((h,), None),
    }
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(config["num_hidden_layers"]):
        for module, (weight, bias) in per_layer.items():
            shapes[f"model.layers.{i}.{module}.weight"] = weight
            if bias is not None:
                shapes[f"model.layers.{i}.{module}.bias"] = bias
    return shapes


def _check_tensor_list(config: dict, tensors: dict, path: str, arch: str) -> None:
    """The metadata's sizes must match the tensors before a model is built from them: a header alone could
    otherwise ask for any number of layers or any width, and allocate it."""
    blocks = config["num_hidden_layers"]
    layers = {int(m.group(1)) for m in map(_BLOCK.fullmatch, tensors) if m}
    if len(layers) != blocks or max(layers) != blocks - 1:  # checked first: the shapes' list grows with blocks
        raise ValueError(f"GGUF metadata {arch}.block_count={blocks}, but the file holds tensors for "
                         f"{len(layers)} layers (blk.{min(layers, default=0)} to blk.{max(layers, default=-1)})")
    expected = _expected_shapes(config)
    found = set()
    for t in tensors.values():
        if t.name == "rope_freqs.weight":
            continue
        name = hf_name(t.name)
        if name is None or name not in expected:
            raise ValueError(f"GGUF tensor {t.name!r} has no place in this {GGUF_ARCHITECTURES[arch][0]} model "
                             f"({arch}.block_count={config['num_hidden_layers']})")
        shape = tuple(reversed(t.shape))
        if shape != expected[name]:
            raise ValueError(
                f"GGUF tensor {t.name} has shape {shape}, but the metadata ({arch}.embedding_length="
                f"{config['hidden_size']}, feed_forward_length={config['intermediate_size']}, attention.head_count="
                f"{config['num_attention_heads']}, head_count_kv={config['num_key_value_heads']}, head dimension "
                f"{config['head_dim']}, vocabulary {config['vocab_size']}) implies {expected[name]}")
        found.add(name)
    missing = [n for n in expected if n.endswith(".weight") and n not in found
               and not (n == "lm_head.weight" and config["tie_word_embeddings"])]
    if missing:
        raise ValueError(f"GGUF file {path!r} lacks weights: {missing[:5]}"
                         f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}")


def gguf_config_dict(path: str) -> dict:
    """An HF-style config dict (for model_config_from_dict) from a Llama GGUF file's metadata."""
    return _config_dict(_open(path), path)


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, or None for a name this loader does not know."""
    m = _BLOCK.fullmatch(gguf_name)
    if m:
        part = _LAYER_NAMES.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    stem, _, suffix = gguf_name.rpartition(".")
    return f"{_TOP_NAMES[stem]}.{suffix}" if stem in _TOP_NAMES and suffix in ("weight", "bias") else None


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K permutation: per head, rows [head_dim/2, 2] -> [2, head_dim/2] (pairs -> halves)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_gguf_weights(model: torch.nn.Module, path: str) -> None:
    """Dequantize path's tensors into model (a DecoderLM built from gguf_config_dict(path))."""
    reader = _open(path)
    arch = _check_architecture(reader, path)
    cfg = model.config
    params = dict(model.named_parameters())
    loaded = set()
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # already in the config's rope scaling
        name = hf_name(t.name)
        if name is None or name not in params or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            raise ValueError(f"GGUF tensor {t.name!r} has no place in this {GGUF_ARCHITECTURES[arch][0]} model")
        w = _dequantize(t)
        if arch in PERMUTED_QK_ARCHITECTURES and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
            if w.shape[0] != heads * cfg.head_dim:
                raise ValueError(f"GGUF tensor {t.name} has {w.shape[0]} rows, expected {heads} heads x {cfg.head_dim}")
            w = unpermute_rows(w, heads)
        if w.shape != params[name].shape:
            raise ValueError(f"GGUF tensor {t.name} has shape {tuple(w.shape)}, model expects {tuple(params[name].shape)}")
        with torch.no_grad():
            params[name].copy_(w)
        loaded.add(name)
    _last_reader.clear()  # the weights are in: release the file's mapping and parsed metadata
    missing = set(params) - loaded - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"GGUF file {path!r} lacks weights: {sorted(missing)[:5]}")


def load_gguf_tokenizer(path: str):
    """The tokenizer embedded in a GGUF file, converted by transformers (chat template kept). The conversion parses
    the whole vocabulary out of the file's metadata (11 s for SmolLM2's on a CI core), so its result is saved under
    the cache directory, keyed by the file's path, size and mtime (a reload takes 0.3 s), and kept per process;
    each caller gets its own copy, as tokenizers keep per-call state."""
    st = os.stat(path)
    return copy.deepcopy(_converted_tokenizer(os.path.realpath(path), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=2)
def _converted_tokenizer(path: str, mtime_ns: int, size: int):
    from transformers import AutoTokenizer

    key = hashlib.sha256(f"{path}\0{size}\0{mtime_ns}".encode()).hexdigest()[:16]
    saved = cache_dir() / "gguf-tokenizers" / f"{os.path.basename(path)}-{key}"
    if (saved / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(saved)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    staging = saved.with_name(f"{saved.name}.{os.getpid()}.partial")
    try:  # written aside and renamed, so a concurrent or interrupted save never leaves half a tokenizer
        tokenizer.save_pretrained(staging)
        os.replace(staging, saved)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # a read-only or full cache: convert again next time
    return tokenizer
