"""--enable-deterministic-inference end to end on realistic logits, in bf16: plain decoding at batch 1 equals plain
batched, eager, a small prefill chunk, and every drafter (chains, trees, adaptive), token for token over 192 tokens;
seeded sampling gives the same tokens however requests were batched; a self-drafting model accepts every draft.
The control runs the same comparisons without the flag and records how the default mode differs.

The subject is the real default model (SmolLM2-135M-Instruct, from $HYPERDRAFT_CACHE: see DEVELOPERS.md for how it
reaches a GPU machine) on MT-bench first turns. Without it, an unsharpened random Llama (initializer range 0.02, so
its top logits nearly tie) on random prompts. Run: `python3 -m pytest tests/gpu/test_deterministic_engine.py -q -s`.
Every comparison is written to $OUT/deterministic_engine.json (or /tmp).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from hyperdraft import SamplingParams
from hyperdraft.models.default_model import DEFAULT_MODEL
from hyperdraft.options import cache_dir
from hyperdraft.testing.fidelity import CONFIGS, Subject, compare, generate, random_heads
from hyperdraft.testing.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NEW_TOKENS = 192
NUM_PROMPTS = 8
REPORT = os.path.join(os.environ.get("OUT", "/tmp"), "deterministic_engine.json")
ENGINE = dict(device="cuda", dtype="bfloat16", max_total_tokens=1 << 15, cuda_graph_max_bs=16)
GREEDY = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True)


def _report(entry: dict) -> None:
    data = json.load(open(REPORT)) if os.path.exists(REPORT) else []
    data.append(entry)
    json.dump(data, open(REPORT, "w"), indent=1)


@pytest.fixture(scope="module")
def subject(tmp_path_factory) -> Subject:
    root = tmp_path_factory.mktemp("deterministic")
    real = cache_dir() / DEFAULT_MODEL
    if real.is_file():
        from benchmarks.common import mt_bench_first_turns

        target, prompts = str(real), dict(prompts=mt_bench_first_turns()[:NUM_PROMPTS])
    else:
        target = make_tiny_model(str(root / "llama"), "llama", seed=3, hidden_size=256, intermediate_size=512,
                                 num_hidden_layers=4, initializer_range=0.02)
        g = torch.Generator().manual_seed(0)
        prompts = dict(input_ids=[torch.randint(0, 384, (n,), generator=g).tolist()
                                  for n in (3, 17, 40, 64, 90, 130, 9, 200)][:NUM_PROMPTS])
    return Subject(target, prompts, random_heads(target, str(root)))


def _is_real(subject: Subject) -> bool:
    return subject.target.endswith(".gguf")


def _run(subject, deterministic, name_or_config, sampling, batched=True):
    config = CONFIGS[name_or_config] if isinstance(name_or_config, str) else name_or_config
    run = generate(subject, deterministic, config, sampling, batched, **ENGINE)
    assert run.pool_free, "KV pages still held after the run"
    return run


@pytest.fixture(scope="module")
def greedy_reference(subject):
    """Deterministic plain decoding, one request at a time."""
    return _run(subject, True, {}, [GREEDY] * subject.count, batched=False).outputs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_deterministic_greedy_equals_plain_batch_one(subject, greedy_reference, name):
    run = _run(subject, True, name, [GREEDY] * subject.count)
    result = compare(greedy_reference, run.outputs)
    _report({"mode": "deterministic", "config": name, "real_model": _is_real(subject), **result,
             "acceptance_rate": run.state.get("spec_acceptance_rate"), "numerics": run.state["numerics"]})
    assert run.state["numerics"] == "bfloat16 deterministic"
    assert result["identical"] == result["total"], f"{name}: {result}"
    if name.startswith("self-draft") and "tree" not in name:  # the draft is the target: it predicts every token
        assert run.state["spec_acceptance_rate"] == 1.0, run.state["spec_acceptance_rate"]


def test_deterministic_with_the_kv_store_inside_attention(subject, greedy_reference):
    """RuntimeOptions.kv_in_attention (decodes, verifies and draft steps store their K/V inside the attention
    launch) keeps deterministic mode bit for bit plain decoding at batch one; the reference ran without it."""
    from hyperdraft.options import RuntimeOptions

    options = RuntimeOptions.from_env(kv_in_attention=True, deterministic=True)
    for name in ("plain batched", "NGRAM chain 4", "self-draft chain 5", "EAGLE3 chain 3"):
        run = generate(subject, True, CONFIGS[name], [GREEDY] * subject.count, runtime_options=options, **ENGINE)
        assert run.pool_free, "KV pages still held after the run"
        result = compare(greedy_reference, run.outputs)
        _report({"mode": "deterministic, kv_in_attention", "config": name, **result})
        assert result["identical"] == result["total"], f"{name}: {result}"


def test_seeded_sampling_is_the_same_however_batched(subject):
    sampling = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_new_tokens=NEW_TOKENS, ignore_eos=True)
                for i in range(subject.count)]
    reference = _run(subject, True, {}, sampling, batched=False).outputs
    for name in ("plain batched", "NGRAM chain 4", "self-draft chain 5"):
        result = compare(reference, _run(subject, True, name, sampling).outputs)
        _report({"mode": "deterministic", "config": name + ", sampled (T 0.8, top-p 0.95, seeded)", **result})
        assert result["identical"] == result["total"], f"{name}: {result}"


def test_default_mode_control(subject):
    """The same comparisons without the flag: recorded; on the real model the default mode must differ somewhere
    (the issue measured 1 of 20 MT-bench answers identical), which shows these comparisons can fail."""
    reference = _run(subject, False, {}, [GREEDY] * subject.count, batched=False).outputs
    identical = 0
    for name in ("plain batched", "self-draft chain 5"):
        run = _run(subject, False, name, [GREEDY] * subject.count)
        result = compare(reference, run.outputs)
        identical += result["identical"]
        _report({"mode": "default", "config": name, "real_model": _is_real(subject), **result,
                 "acceptance_rate": run.state.get("spec_acceptance_rate"), "numerics": run.state["numerics"]})
        assert run.state["numerics"] == "bfloat16 default"
    if _is_real(subject):
        assert identical < 2 * subject.count, "the default mode matched everywhere: the control shows nothing"
