"""GPU smoke tests: greedy equality with transformers on CUDA, in fp32 and bf16; spec on == spec off.

Run on a GPU machine: `python3 -m pytest tests/gpu -q -s`. Not part of CI.

In fp32 the token ids must be identical. In bf16 two implementations may round differently and flip an argmax
where the top two logits nearly tie; such a divergence is accepted only if, at the first differing position,
transformers' own top-2 logit gap is within BF16_TIE_GAP. Every mismatch is written to $OUT (or /tmp) as JSON.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.testing.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BF16_TIE_GAP = 0.125  # a few bf16 ulps at logit magnitudes of ~10
REPORT = os.path.join(os.environ.get("OUT", "/tmp"), "gpu_equality.json")
NEW_TOKENS = 32


def _report(entry: dict) -> None:
    data = json.load(open(REPORT)) if os.path.exists(REPORT) else []
    data.append(entry)
    json.dump(data, open(REPORT, "w"), indent=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_models")
    from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint

    paths = {kind: make_tiny_model(str(root / kind), kind, seed=1) for kind in ("llama", "qwen2", "qwen3", "mqa")}
    paths["llama6"] = make_tiny_model(str(root / "llama6"), "llama", seed=1, num_hidden_layers=6)
    paths["eagle3"] = write_random_eagle_checkpoint(str(root / "eagle3"), paths["llama6"], kind="eagle3", draft_vocab_size=200)
    return paths


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 7, 33, 64, 100, 150, 200, 5)]


def _hf_greedy(path, prompts, dtype):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda()
    # ignore_eos semantics: EOS may be generated and does not stop. (min_new_tokens would instead forbid EOS.)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    outs, gaps = [], []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        # An explicit mask: otherwise generate() masks out prompt tokens equal to pad_token_id.
        res = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          do_sample=False, output_scores=True, return_dict_in_generate=True)
        outs.append(res.sequences[0, len(p):].tolist())
        top2 = torch.stack(res.scores, 0)[:, 0].float().topk(2, -1).values  # [steps, 2]
        gaps.append((top2[:, 0] - top2[:, 1]).tolist())
    return outs, gaps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mqa"])
def test_greedy_matches_transformers_on_cuda(models, kind, dtype):
    path = models[kind]
    llm = LLM(path, device="cuda", dtype=dtype, page_size=16, chunked_prefill_size=64, max_total_tokens=1 << 16)
    prompts = _prompts(llm.engine.model_config.vocab_size)
    sp = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    ours = [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=sp, use_tqdm=False)]
    ref, gaps = _hf_greedy(path, prompts, getattr(torch, dtype))
    assert llm.engine.flush_cache(), "prefix cache not flushable"  # cached pages are not leaked ones
    assert llm.engine.kv_free_slots == llm.engine.kv_capacity_slots
    llm.shutdown()
    mismatches = []
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            pos = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            mismatches.append({"prompt": i, "position": pos, "hf_top2_gap": gaps[i][pos]})
    _report({"test": "greedy_vs_transformers", "kind": kind, "dtype": dtype, "prompts": len(prompts),
             "mismatched_prompts": len(mismatches), "mismatches": mismatches})
    if dtype == "float32":
        assert not mismatches
    else:
        assert all(m["hf_top2_gap"] <= BF16_TIE_GAP for m in mismatches), mismatches


SPEC_CASES = {
    "NGRAM": ("llama", dict(speculative_algorithm="NGRAM", speculative_num_steps=3)),
    "STANDALONE": ("llama", dict(speculative_algorithm="STANDALONE", speculative_draft_model="qwen3", speculative_num_steps=3)),
    "STANDALONE-self-tree": ("llama", dict(speculative_algorithm="STANDALONE", speculative_draft_model="llama",
                                           speculative_num_steps=4, speculative_eagle_topk=4, speculative_num_draft_tokens=8)),
    "EAGLE3-tree": ("llama6", dict(speculative_algorithm="EAGLE3", speculative_draft_model="eagle3")),
    "EAGLE3-chain": ("llama6", dict(speculative_algorithm="EAGLE3", speculative_draft_model="eagle3", speculative_num_steps=3,
                                    speculative_eagle_topk=1)),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("algo", list(SPEC_CASES))
def test_spec_on_equals_spec_off_on_cuda(models, algo, dtype):
    target, spec = SPEC_CASES[algo]
    path = models[target]
    spec = {k: (models[v] if k == "speculative_draft_model" else v) for k, v in spec.items()}
    base = LLM(path, device="cuda", dtype=dtype, page_size=4, max_total_tokens=1 << 16)
    fast = LLM(path, device="cuda", dtype=dtype, page_size=4, max_total_tokens=1 << 16, **spec)
    prompts = _prompts(base.engine.model_config.vocab_size) * 2
    sp = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    a = [o.token_ids for o in base.generate(input_ids=prompts, sampling_params=sp, use_tqdm=False)]
    b = [o.token_ids for o in fast.generate(input_ids=prompts, sampling_params=sp, use_tqdm=False)]
    same = sum(x == y for x, y in zip(a, b))
    _report({"test": "spec_on_vs_off", "algo": algo, "dtype": dtype, "prompts": len(prompts), "identical": same})
    assert fast.engine.flush_cache(), "prefix cache not flushable"  # cached pages are not leaked ones
    assert fast.engine.kv_free_slots == fast.engine.kv_capacity_slots
    base.shutdown()
    fast.shutdown()
    if dtype == "float32":
        assert same == len(prompts)
