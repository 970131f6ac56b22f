"""--enable-deterministic-inference outside the GPU: the flag reaches the engine's options, models it cannot serve
are refused with the field named, the CPU runs unchanged, and the engine reports its numerics. The batch
invariance itself is tested on a GPU (tests/gpu/test_deterministic_kernels.py, test_deterministic_engine.py)."""

from __future__ import annotations

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.cli import build_parser
from hyperdraft.config import engine_args_from_namespace
from hyperdraft.engine.numerics import numerics_mode
from hyperdraft.options import RuntimeOptions
from hyperdraft.testing.tiny import make_tiny_model
from tests.conftest import assert_kv_accounted


def test_flag_parses_to_the_engine_options(llama_path):
    ns = build_parser().parse_args(["generate", "--model", llama_path, "--enable-deterministic-inference"])
    args = engine_args_from_namespace(ns)
    assert args.enable_deterministic_inference is True
    assert RuntimeOptions.from_args(args, environ={}).deterministic is True
    plain = engine_args_from_namespace(build_parser().parse_args(["generate", "--model", llama_path]))
    assert RuntimeOptions.from_args(plain, environ={}).deterministic is False


def test_moe_models_are_refused(tmp_path):
    path = make_tiny_model(str(tmp_path / "next"), "qwen3_next", with_tokenizer=False)
    with pytest.raises(ValueError, match="enable_deterministic_inference supports dense models.*MoE"):
        LLM(path, device="cpu", max_total_tokens=512, enable_deterministic_inference=True)


def test_cpu_runs_unchanged_and_reports_its_numerics(llama_path):
    prompts = [[1, 5, 9, 3], [7, 2], [4] * 11]
    sp = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    outs = {}
    for flag in (False, True):
        llm = LLM(llama_path, device="cpu", max_total_tokens=512, enable_deterministic_inference=flag,
                  speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_num_draft_tokens=4)
        outs[flag] = [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=sp, use_tqdm=False)]
        assert llm.engine.options.deterministic is flag
        assert llm.engine.internal_state()["numerics"] == "float32"
        assert_kv_accounted(llm.engine)
        llm.shutdown()
    assert outs[True] == outs[False]


def test_numerics_mode_names_dtype_and_mode():
    on, off = RuntimeOptions(deterministic=True), RuntimeOptions()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert numerics_mode(cuda, torch.bfloat16, on) == "bfloat16 deterministic"
    assert numerics_mode(cuda, torch.bfloat16, off) == "bfloat16 default"
    assert numerics_mode(cpu, torch.bfloat16, on) == "bfloat16 default"  # no invariant kernels on the CPU
    assert numerics_mode(cuda, torch.float32, on) == numerics_mode(cpu, torch.float32, off) == "float32"
