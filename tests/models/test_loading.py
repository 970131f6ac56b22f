"""Checkpoint loading: sharded safetensors with an index, explicit dtypes, frozen configs."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from hyperdraft.models.decoder import rope_inv_freq
from hyperdraft.models.loader import load_model
from tests.conftest import greedy, hf_greedy


@pytest.fixture(scope="module")
def sharded_path(llama_path, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sharded"))
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    model.save_pretrained(path, max_shard_size="100KB")
    for name in os.listdir(llama_path):
        if name.startswith("tokenizer"):
            with open(os.path.join(llama_path, name), "rb") as src, open(os.path.join(path, name), "wb") as dst:
                dst.write(src.read())
    return path


def test_sharded_checkpoint_has_several_shards_and_an_index(sharded_path):
    shards = [f for f in os.listdir(sharded_path) if f.endswith(".safetensors")]
    assert len(shards) > 1
    assert os.path.isfile(os.path.join(sharded_path, "model.safetensors.index.json"))


def test_sharded_checkpoint_generates_like_transformers(sharded_path, make_llm):
    prompts = [[5, 6, 7], list(range(20, 90)), [1]]
    llm = make_llm(sharded_path)
    outs = llm.generate(input_ids=prompts, sampling_params=greedy(16), use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy(sharded_path, prompts, 16)


def test_sharded_and_single_file_weights_are_identical(sharded_path, llama_path):
    a = load_model(sharded_path, "float32", torch.device("cpu")).state_dict()
    b = load_model(llama_path, "float32", torch.device("cpu")).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype, expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                             ("float16", torch.float16), ("auto", torch.float32)])
def test_dtype_choice(llama_path, dtype, expected):
    model = load_model(llama_path, dtype, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {expected}
    assert model.inv_freq.dtype == torch.float32  # RoPE frequencies stay fp32 whatever the weights
    assert torch.equal(model.inv_freq, rope_inv_freq(model.config))  # exact, though built on meta and cast


def test_rope_frequencies_survive_meta_builds_casts_and_moves():
    """RotaryFrequencies: a plain buffer would come back rounded from `.to(bfloat16)` and uninitialised from
    `to_empty`; these keep rope_inv_freq's fp32 values and follow only the module's device."""
    from hyperdraft.models.config import model_config_from_dict
    from hyperdraft.models.decoder import RotaryFrequencies

    cfg = model_config_from_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
                                  "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 32,
                                  "rope_theta": 500000.0})
    with torch.device("meta"):
        rotary = RotaryFrequencies(cfg)
    rotary = rotary.to_empty(device="cpu").to(torch.bfloat16)
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, rope_inv_freq(cfg))
    assert rotary.to("meta").inv_freq.is_meta


def test_model_config_is_frozen(llama_path):
    model = load_model(llama_path, "float32", torch.device("cpu"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.config.hidden_size = 1  # type: ignore[misc]


def test_a_fresh_process_builds_its_first_engine_without_torch_dynamo(llama_path):
    """Module tables are allocated, not drawn (models/tensor_parallel.py empty_embedding): nn.Embedding's normal_ init
    under the device context a model is built in imports torch._dynamo on first use, ~3 s of every fresh process's
    first engine (the CLI's, the server's). A new interpreter, so nothing else imported it first."""
    import subprocess
    import sys

    script = ("import sys; from hyperdraft import LLM; "
              f"llm = LLM({llama_path!r}, device='cpu', dtype='float32', max_total_tokens=256, "
              "skip_tokenizer_init=True); llm.shutdown(); print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout
