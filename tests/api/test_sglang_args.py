"""SGLang launch commands carried over: its other spellings of flag values, --trust-remote-code, and server info
that reports the arguments as the engine resolved them (CPU, fp32)."""

from __future__ import annotations

import argparse

import pytest
import transformers

from conftest import generate_ids, greedy, hf_greedy, random_prompts
from hyperdraft.config import EngineArgs, add_engine_args, engine_args_from_namespace
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model

PROMPTS = random_prompts([4, 9], seed=3)


def _cli(*flags: str) -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_args_from_namespace(parser.parse_args(list(flags)))


@pytest.mark.parametrize("field,spelled,canonical", [
    ("dtype", "half", "float16"), ("dtype", "float", "float32"), ("attention_backend", "torch_native", "torch")])
def test_sglang_value_spellings(field, spelled, canonical):
    assert getattr(EngineArgs(**{field: spelled}), field) == canonical
    assert getattr(_cli("--" + field.replace("_", "-"), spelled), field) == canonical


def test_unknown_value_spellings_are_still_refused():
    with pytest.raises(ValueError, match=r"^dtype must be one of \('auto', 'float32', 'bfloat16', 'float16'\), got 'fp8'"):
        EngineArgs(dtype="fp8")
    with pytest.raises(SystemExit):
        _cli("--attention-backend", "fa3")


def test_torch_native_runs_the_torch_backend(llama_path, make_llm):
    llm = make_llm(llama_path, attention_backend="torch_native", dtype="float")
    assert (llm.engine.args.attention_backend, llm.engine.args.dtype) == ("torch", "float32")
    assert [o.token_ids for o in generate_ids(llm, PROMPTS, greedy(6))] == hf_greedy(llama_path, PROMPTS, 6)


def test_trust_remote_code_reaches_the_tokenizer(llama_path, make_llm, monkeypatch):
    seen = []
    load = transformers.AutoTokenizer.from_pretrained

    def recording(path, **kwargs):  # observes the call, loads as before
        seen.append(kwargs.get("trust_remote_code"))
        return load(path, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recording)
    make_llm(llama_path)
    make_llm(llama_path, trust_remote_code=True)
    assert seen == [False, True]
    assert _cli("--trust-remote-code").trust_remote_code is True


def test_server_info_reports_resolved_arguments(llama_path, make_llm, tmp_path):
    """SGLang's server_info gives its arguments after its hooks filled them in; the values the user left unset were
    None here before."""
    info = make_llm(llama_path, speculative_algorithm="NGRAM", max_total_tokens=512).get_server_info()
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == (7, 1, 8)
    assert info["max_running_requests"] == 256 and info["context_length"] > 0
    state = info["internal_states"][0]
    assert (state["speculative_num_steps"], state["speculative_num_draft_tokens"]) == (7, 8)
    target = make_tiny_model(str(tmp_path / "target"), "llama", num_hidden_layers=4)  # EAGLE-3 reads 3 layers
    head = write_random_eagle_checkpoint(str(tmp_path / "head"), target, kind="eagle3", draft_vocab_size=200)
    info = make_llm(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                    max_total_tokens=512, max_running_requests=3).get_server_info()
    # SGLang's auto-choice for an EAGLE head on a Llama target
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == (5, 4, 8)
    assert info["max_running_requests"] == 3 and info["speculative_draft_model_path"] == head
    assert make_llm(llama_path).get_server_info()["speculative_num_steps"] is None  # no speculation: nothing to fill


def test_disable_overlap_schedule_queues_nothing_ahead(llama_path, make_llm):
    """SGLang's --disable-overlap-schedule: the host reads each step before more is queued, here the three ahead
    switches off; --enable-mixed-chunk is accepted and changes nothing (chunks always share the decodes' forward)."""
    args = _cli("--disable-overlap-schedule", "--enable-mixed-chunk")
    assert args.disable_overlap_schedule and args.enable_mixed_chunk
    llm = make_llm(llama_path, disable_overlap_schedule=True, enable_mixed_chunk=True, speculative_algorithm="NGRAM",
                   speculative_num_steps=3)
    options = llm.engine.options
    assert not (options.decode_ahead or options.draft_ahead or options.round_ahead)
    default = make_llm(llama_path).engine.options
    assert default.decode_ahead and default.draft_ahead and default.round_ahead
    assert [o.token_ids for o in generate_ids(llm, PROMPTS, greedy(8))] == hf_greedy(llama_path, PROMPTS, 8)


def test_speculative_attention_mode_is_accepted_and_checked(llama_path, make_llm):
    """SGLang's --speculative-attention-mode prefill|decode picks which of its backends runs the verify: accepted, and
    the output stays plain decoding's (one attention kernel serves every verify here); another value is refused by
    name."""
    assert _cli("--speculative-attention-mode", "decode").speculative_attention_mode == "decode"
    assert _cli().speculative_attention_mode == "prefill"
    with pytest.raises(SystemExit):
        _cli("--speculative-attention-mode", "extend")
    with pytest.raises(ValueError, match=r"speculative_attention_mode must be one of \('prefill', 'decode'\)"):
        EngineArgs(speculative_attention_mode="extend")
    llm = make_llm(llama_path, speculative_algorithm="NGRAM", speculative_num_steps=3,
                   speculative_attention_mode="decode")
    assert llm.get_server_info()["speculative_attention_mode"] == "decode"
    assert [o.token_ids for o in generate_ids(llm, PROMPTS, greedy(8))] == hf_greedy(llama_path, PROMPTS, 8)


def test_cuda_graph_bs_from_the_command_line():
    assert _cli("--cuda-graph-bs", "8", "1", "2", "4").cuda_graph_bs == (1, 2, 4, 8)
    assert _cli().cuda_graph_bs is None
