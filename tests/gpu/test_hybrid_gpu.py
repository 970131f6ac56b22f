"""Hybrid (Qwen3.5) models on CUDA with the torch state backend (no Triton kernels or graphs for them yet): fp32
greedy equals transformers on the GPU, NGRAM and MTP speculation equal speculation off, and bf16 runs. Not part of CI:
`python3 -m pytest tests/gpu/test_hybrid_gpu.py -q`."""

from __future__ import annotations

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.testing.tiny import make_tiny_model
from helpers.hybrid_fixtures import with_mtp_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NEW = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_gpu")
    target = make_tiny_model(str(root / "t"), "qwen3_5", seed=0)
    return {"target": target, "mtp": with_mtp_weights(target, str(root / "m"))}


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 384, (n,), generator=g).tolist() for n in (1, 7, 33, 64, 5)]


def _greedy(llm):
    params = SamplingParams(temperature=0, max_new_tokens=NEW, ignore_eos=True)
    return [o.token_ids for o in llm.generate(input_ids=_prompts(), sampling_params=params, use_tqdm=False)]


def test_fp32_greedy_equals_transformers_on_cuda(models):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).cuda()
    refs = []
    for p in _prompts():
        out = hf.generate(torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), device="cuda"),
                          max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    llm = LLM(models["target"], device="cuda", dtype="float32", max_running_requests=8, chunked_prefill_size=16,
              max_total_tokens=4096)
    assert _greedy(llm) == refs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculation_equals_plain_on_cuda(models, dtype):
    base = dict(device="cuda", dtype=dtype, max_running_requests=8, max_total_tokens=4096)
    plain = _greedy(LLM(models["mtp"], **base))
    for extra in (dict(speculative_algorithm="NGRAM", speculative_num_steps=3),
                  dict(speculative_algorithm="NEXTN", speculative_num_steps=3),
                  dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=2,
                       speculative_num_draft_tokens=5)):
        got = _greedy(LLM(models["mtp"], **base, **extra))
        if dtype == "float32":
            assert got == plain, extra
        else:  # bf16 verify widths round differently (issue 24): report, do not assert
            print(dtype, extra, sum(g == p for g, p in zip(got, plain)), "of", len(plain), "identical")
