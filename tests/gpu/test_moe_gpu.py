"""Qwen3-Next on CUDA: the grouped expert kernels against the stacked reference (fp32 and bf16, decode-sized and
prefill-sized batches, K and E of the real model's ratio), greedy output equals transformers in fp32, and CUDA graphs
on equal off with MTP (the kernels read the routing on the device, so graphs hold them)."""

from __future__ import annotations

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.kernels.moe import moe_experts, moe_experts_reference
from hyperdraft.testing.tiny import make_tiny_model
from helpers.hybrid_fixtures import with_mtp_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_reference(tokens, dtype):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    experts_n, topk, hidden, inter = 64, 10, 256, 96
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    gate_up = (torch.randn(experts_n, 2 * inter, hidden, generator=gen, device="cuda") * 0.05).to(dtype)
    down = (torch.randn(experts_n, hidden, inter, generator=gen, device="cuda") * 0.05).to(dtype)
    scores = torch.rand(tokens, experts_n, generator=gen, device="cuda")
    weights, experts = scores.softmax(-1).topk(topk, dim=-1)
    ref = moe_experts_reference(x.float(), experts, weights, gate_up.float(), down.float())
    got = moe_experts(x, experts, weights.to(dtype), gate_up, down)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), ref, **tol)


@pytest.fixture(scope="module")
def next_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("next_gpu")
    return with_mtp_weights(make_tiny_model(str(root / "t"), "qwen3_next", seed=5), str(root / "m"))


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 384, (n,), generator=g).tolist() for n in (1, 7, 33, 64, 5)]


def _greedy(llm):
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    return [o.token_ids for o in llm.generate(input_ids=_prompts(), sampling_params=params, use_tqdm=False)]


def test_qwen3_next_fp32_greedy_equals_transformers_on_cuda(next_model):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(next_model, dtype=torch.float32).cuda()
    refs = []
    for p in _prompts():
        out = hf.generate(torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), device="cuda"),
                          max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    llm = LLM(next_model, device="cuda", dtype="float32", max_running_requests=8, max_total_tokens=4096)
    assert llm.engine.runner.model.model.layers[0].mlp.stack is not None
    assert _greedy(llm) == refs


@pytest.mark.parametrize("extra", [dict(), dict(speculative_algorithm="NEXTN", speculative_num_steps=3),
                                   dict(speculative_algorithm="NEXTN", speculative_num_steps=3,
                                        speculative_eagle_topk=2, speculative_num_draft_tokens=5)],
                         ids=["plain", "mtp-chain", "mtp-tree"])
def test_qwen3_next_graphs_and_speculation_equal_eager_plain(next_model, extra):
    base = dict(device="cuda", dtype="float32", max_running_requests=8, max_total_tokens=4096)
    eager_plain = _greedy(LLM(next_model, disable_cuda_graph=True, **base))
    llm = LLM(next_model, **base, **extra)
    assert _greedy(llm) == eager_plain
    assert llm.engine.runner.graphs.num_replays > 0
