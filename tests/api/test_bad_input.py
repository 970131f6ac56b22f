"""Bad input raises ValueError naming the offending field, and leaves the engine serving everyone else correctly."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from conftest import VOCAB_SIZE, generate_ids, greedy, hf_greedy, random_prompts, run_until_done
from hyperdraft import LLM, SamplingParams
from hyperdraft.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from hyperdraft.models.config import SUPPORTED_ARCHITECTURES

CONTEXT = 64
GOOD = random_prompts([5, 20, 11, 40], seed=50)
N = 8


@pytest.fixture(scope="module")
def good_ref(llama_path):
    return hf_greedy(llama_path, GOOD, N)


# (generate kwargs, sampling params kwargs, regex the message must match)
BAD_REQUESTS = {
    "empty-input-ids": (dict(input_ids=[[]]), {}, r"input_ids/prompt"),
    "empty-prompt": (dict(prompts=[""]), {}, r"prompt"),
    "max-new-tokens-0": (dict(input_ids=[[1, 2]]), dict(max_new_tokens=0), r"max_new_tokens"),
    "max-new-tokens-negative": (dict(input_ids=[[1, 2]]), dict(max_new_tokens=-1), r"max_new_tokens"),
    "max-new-tokens-float": (dict(input_ids=[[1, 2]]), dict(max_new_tokens=2.5), r"max_new_tokens"),
    "top-p-0": (dict(input_ids=[[1, 2]]), dict(top_p=0.0), r"top_p"),
    "top-p-1.5": (dict(input_ids=[[1, 2]]), dict(top_p=1.5), r"top_p"),
    "temperature-negative": (dict(input_ids=[[1, 2]]), dict(temperature=-0.5), r"temperature"),
    "temperature-nan": (dict(input_ids=[[1, 2]]), dict(temperature=float("nan")), r"temperature"),
    "top-k-negative": (dict(input_ids=[[1, 2]]), dict(top_k=-2), r"top_k"),
    "min-p-above-1": (dict(input_ids=[[1, 2]]), dict(min_p=1.5), r"min_p"),
    "repetition-penalty-0": (dict(input_ids=[[1, 2]]), dict(repetition_penalty=0.0), r"repetition_penalty"),
    # logits / 5e-324 is inf in float32, and the logprobs became NaN
    "repetition-penalty-denormal": (dict(input_ids=[[1, 2]]), dict(repetition_penalty=5e-324),
                                    r"repetition_penalty must be in \[0.01, 2\]"),
    "repetition-penalty-inf": (dict(input_ids=[[1, 2]]), dict(repetition_penalty=float("inf")), r"repetition_penalty"),
    "temperature-inf": (dict(input_ids=[[1, 2]]), dict(temperature=float("inf")), r"temperature must be a finite"),
    "frequency-penalty-3": (dict(input_ids=[[1, 2]]), dict(frequency_penalty=3.0), r"frequency_penalty"),
    "presence-penalty-minus-3": (dict(input_ids=[[1, 2]]), dict(presence_penalty=-3.0), r"presence_penalty"),
    "stop-token-out-of-vocab": (dict(input_ids=[[1, 2]]), dict(stop_token_ids=[VOCAB_SIZE]), r"stop_token_ids"),
    "stop-empty-string": (dict(input_ids=[[1, 2]]), dict(stop=[""]), r"stop"),
    "stop-not-a-string": (dict(input_ids=[[1, 2]]), dict(stop=5), r"^stop must be a non-empty string or a list"),
    "stop-token-ids-not-a-list": (dict(input_ids=[[1, 2]]), dict(stop_token_ids=3), r"^stop_token_ids must be a list"),
    "seed-not-int": (dict(input_ids=[[1, 2]]), dict(seed="7"), r"seed"),
    # a stop list's count and lengths bound what every token costs the step (110,000 strings held a server 45 s)
    "stop-too-many": (dict(input_ids=[[1, 2]]), dict(stop=["ab"] * (MAX_STOP_STRINGS + 1)),
                      rf"^stop must be .* at most {MAX_STOP_STRINGS} of them, .*, got \['ab', .*\.\.\.$"),
    "stop-too-long": (dict(input_ids=[[1, 2]]), dict(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]),
                      rf"^stop must be a non-empty string .* each at most {MAX_STOP_STRING_CHARS} characters"),
    "stop-token-ids-too-many": (dict(input_ids=[[1, 2]]), dict(stop_token_ids=[3] * (MAX_STOP_TOKEN_IDS + 1)),
                                rf"^stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids"),
    # the flags were taken by truthiness, and a None skip_special_tokens failed the whole step in the stop check
    "skip-special-tokens-none": (dict(input_ids=[[1, 2]]), dict(stop=["zz"], skip_special_tokens=None),
                                 r"^skip_special_tokens must be true or false, got None"),
    "ignore-eos-string": (dict(input_ids=[[1, 2]]), dict(ignore_eos="false"), r"^ignore_eos must be true or false"),
    "return-logprob-string": (dict(input_ids=[[1, 2]]), dict(return_logprob="no"), r"^return_logprob must be true"),
    "prompt-at-context": (dict(input_ids=[[1] * CONTEXT]), {}, r"context_length"),
    "prompt-over-context": (dict(input_ids=[[3] * (CONTEXT + 37)]), {}, r"context_length"),
    "text-prompt-over-context": (dict(prompts=["The quick brown fox jumps over the lazy dog. " * 20]), {},
                                 r"context_length"),
    "token-id-out-of-vocab": (dict(input_ids=[[1, VOCAB_SIZE]]), {}, r"input_ids"),
    "token-id-negative": (dict(input_ids=[[-1, 2]]), {}, r"input_ids"),
    "token-id-float": (dict(input_ids=[[1.0, 2]]), {}, r"input_ids"),
    "token-id-bool": (dict(input_ids=[[1, True]]), {}, r"^input_ids must be integers"),  # was read as token 1
}


def _start_good(llm) -> list:
    """Queue the good requests and run two steps, so some are mid-flight when the bad one arrives."""
    reqs = [llm.engine.add_request(input_ids=p, params=greedy(N)) for p in GOOD]
    llm.engine.step()
    llm.engine.step()
    assert any(r.output_ids for r in reqs) and not all(r.finished for r in reqs)
    return reqs


def _finish_good(llm, reqs, good_ref) -> None:
    run_until_done(llm, reqs)
    assert [r.output_ids for r in reqs] == good_ref
    assert all(r.finish_reason == "length" for r in reqs)
    # And the engine serves new requests correctly too.
    assert [o.token_ids for o in generate_ids(llm, GOOD, greedy(N))] == good_ref


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_via_generate(llama_path, make_llm, good_ref, case):
    kwargs, params, field = BAD_REQUESTS[case]
    llm = make_llm(llama_path, context_length=CONTEXT, page_size=4)
    reqs = _start_good(llm)
    in_engine = len(llm.engine.scheduler.waiting) + len(llm.engine.scheduler.running)
    with pytest.raises(ValueError, match=field):
        llm.generate(**kwargs, sampling_params=SamplingParams(**params), use_tqdm=False)
    # A batch where only the last request is bad queues nothing at all.
    key, bad = next(iter(kwargs.items()))
    good_first = ["Hello"] if key == "prompts" else [GOOD[0]]
    with pytest.raises(ValueError, match=field):
        llm.generate(**{key: good_first + bad}, sampling_params=[greedy(N), SamplingParams(**params)], use_tqdm=False)
    assert len(llm.engine.scheduler.waiting) + len(llm.engine.scheduler.running) == in_engine
    _finish_good(llm, reqs, good_ref)


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_via_add_request(llama_path, make_llm, good_ref, case):
    kwargs, params, field = BAD_REQUESTS[case]
    llm = make_llm(llama_path, context_length=CONTEXT, page_size=4)
    reqs = _start_good(llm)
    in_engine = len(llm.engine.scheduler.waiting) + len(llm.engine.scheduler.running)
    key, (bad,) = next(iter(kwargs.items()))
    arg = dict(prompt=bad) if key == "prompts" else dict(input_ids=bad)
    with pytest.raises(ValueError, match=field):
        llm.engine.add_request(params=SamplingParams(**params), **arg)
    assert len(llm.engine.scheduler.waiting) + len(llm.engine.scheduler.running) == in_engine
    _finish_good(llm, reqs, good_ref)


def test_stop_strings_without_a_tokenizer(llama_path, make_llm, good_ref):
    """With skip_tokenizer_init there is no text to look for stop strings in: they were accepted and ignored."""
    llm = make_llm(llama_path, page_size=4, skip_tokenizer_init=True)
    reqs = _start_good(llm)
    with pytest.raises(ValueError, match=r"^stop strings need the tokenizer.*stop must be None"):
        llm.engine.add_request(input_ids=[1, 2], params=greedy(N, stop=["de"]))
    with pytest.raises(ValueError, match=r"^stop strings need the tokenizer"):
        llm.generate(input_ids=[GOOD[0], [1, 2]], sampling_params=[greedy(N), greedy(N, stop=["de"])], use_tqdm=False)
    _finish_good(llm, reqs, good_ref)


def test_longest_prompt_that_fits_the_context(llama_path, make_llm):
    """The boundary of the context check: CONTEXT - 1 prompt tokens are accepted and yield exactly one token."""
    llm = make_llm(llama_path, context_length=CONTEXT)
    prompt = random_prompts([CONTEXT - 1], seed=51)[0]
    out = generate_ids(llm, [prompt], greedy(10))[0]
    assert out.token_ids == hf_greedy(llama_path, [prompt], 1)[0]
    assert out.finish_reason == "length"


@pytest.mark.parametrize("call,field", [
    (lambda llm: llm.generate(input_ids=[[1]], prompts=["x"]), r"exactly one of prompts or input_ids"),
    (lambda llm: llm.generate(use_tqdm=False), r"exactly one of prompts or input_ids"),
    (lambda llm: llm.generate(input_ids=[1, 2, 3]), r"input_ids"),
    (lambda llm: llm.generate(input_ids=[[1], [2]], sampling_params=[greedy(2)] * 3), r"sampling_params"),
    (lambda llm: llm.engine.add_request(prompt=None), r"prompt"),
    # a dict (as LLM.generate takes) failed as an AttributeError naming no field
    (lambda llm: llm.engine.add_request(input_ids=[1, 2], params={"temperature": 0.0}),
     r"^params must be a SamplingParams .*, got dict"),
    (lambda llm: SamplingParams.from_dict({"max_new_tokens": 3, "temprature": 0.5}), r"temprature"),
    # a caller's rid equal to a live request's: abort(rid) stopped both
    (lambda llm: llm.engine.add_request(input_ids=[1, 2], params=greedy(2), rid=llm.engine.scheduler.running[0].rid),
     r"^rid must be unique among live requests; 'req-\d+' is waiting or running"),
    (lambda llm: llm.engine.add_request(input_ids=[1, 2], params=greedy(2), rid=7), r"^rid must be a string, got int"),
    (lambda llm: llm.engine.add_request(input_ids=[1, 2], params={}), r"^params must be a SamplingParams"),
])
def test_bad_api_use(llama_path, make_llm, good_ref, call, field):
    llm = make_llm(llama_path, page_size=4)
    reqs = _start_good(llm)
    with pytest.raises(ValueError, match=field):
        call(llm)
    _finish_good(llm, reqs, good_ref)


def test_a_callers_rid_and_the_engines_own_never_coincide(llama_path, make_llm, good_ref):
    """A caller naming its request as the engine numbers its own ("req-N"): the engine skips that number, so no two
    live requests share a rid, and an ended request's rid may be used again."""
    llm = make_llm(llama_path, page_size=4)
    engine = llm.engine
    taken = engine.add_request(input_ids=[1, 2], params=greedy(N), rid="req-0")
    reqs = _start_good(llm)
    assert len({r.rid for r in (taken, *reqs)}) == len(reqs) + 1 and "req-0" not in {r.rid for r in reqs}
    assert engine.abort("req-0") is taken and not any(r.finished for r in reqs)
    again = engine.add_request(input_ids=[1, 2], params=greedy(N), rid="req-0")
    _finish_good(llm, reqs, good_ref)
    run_until_done(llm, [again])
    assert again.finish_reason == "length"


@pytest.fixture
def foo_arch_path(llama_path, tmp_path):
    path = str(tmp_path / "foo")
    shutil.copytree(llama_path, path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["FooForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def test_unknown_architecture_lists_supported(llama_path, make_llm, good_ref, foo_arch_path):
    llm = make_llm(llama_path, page_size=4)
    reqs = _start_good(llm)
    with pytest.raises(ValueError, match="FooForCausalLM") as info:
        LLM(foo_arch_path, device="cpu")
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(info.value)
    _finish_good(llm, reqs, good_ref)


@pytest.mark.parametrize("engine_args,field", [
    (dict(model="/nonexistent/model/dir"), r"^model path '/nonexistent/model/dir' does not exist$"),
    (dict(model="LLAMA/config.json"), r"^model path '.*config.json' is a file, not a model: .* ends in .gguf$"),
    (dict(), r"model_path"),
    (dict(model="LLAMA", foo_bar=1), r"foo_bar"),
    (dict(model="LLAMA", page_size=0), r"page_size"),
    (dict(model="LLAMA", page_size=-4), r"page_size"),
    (dict(model="LLAMA", max_total_tokens=0), r"max_total_tokens"),
    (dict(model="LLAMA", max_running_requests=0), r"max_running_requests"),
    (dict(model="LLAMA", chunked_prefill_size=0), r"chunked_prefill_size"),
    (dict(model="LLAMA", context_length=1), r"context_length"),
    (dict(model="LLAMA", dtype="int8"), r"dtype"),
    (dict(model="LLAMA", mem_fraction_static=1.5), r"mem_fraction_static"),
    (dict(model="LLAMA", attention_backend="flash"), r"attention_backend"),
    (dict(model="LLAMA", model_path="LLAMA"), r"model_path"),  # given twice through the alias
    (dict(model="LLAMA", random_seed="7"), r"^random_seed must be an integer"),
    (dict(model="LLAMA", log_level="loud"), r"^log_level must be one of debug, info, warning, error, critical"),
])
def test_bad_engine_args(llama_path, make_llm, good_ref, engine_args, field):
    llm = make_llm(llama_path, page_size=4)
    reqs = _start_good(llm)
    args = {k: (v.replace("LLAMA", llama_path) if isinstance(v, str) else v) for k, v in engine_args.items()}
    with pytest.raises(ValueError, match=field):
        LLM(device="cpu", **args)
    _finish_good(llm, reqs, good_ref)


def test_sampling_params_as_dicts_and_their_errors(llama_path, make_llm, good_ref):
    """SGLang's offline generate takes sampling_params as a dict or a list of dicts: the same results as
    SamplingParams; a misspelled field, a value of another type, or a prompt that is not text is a ValueError naming
    what is wrong, and the requests already running finish as before."""
    llm = make_llm(llama_path, context_length=CONTEXT, page_size=4)
    reqs = _start_good(llm)
    one = dict(temperature=0.0, max_new_tokens=N, ignore_eos=True)
    assert [o.token_ids for o in llm.generate(input_ids=GOOD, sampling_params=one, use_tqdm=False)] == good_ref
    per_request = [dict(one) for _ in GOOD]
    assert [o.token_ids for o in llm.generate(input_ids=GOOD, sampling_params=per_request, use_tqdm=False)] == good_ref
    for bad, message in [({"temprature": 0.0}, r"unknown sampling parameter\(s\) \['temprature'\]"),
                         (5, r"^sampling_params must be a SamplingParams or a dict"),
                         ([one, "greedy"], r"^sampling_params must be")]:
        with pytest.raises(ValueError, match=message):
            llm.generate(input_ids=GOOD[:2], sampling_params=bad, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompts must be a string or a list of strings"):
        llm.generate(prompts=["Hello", None], use_tqdm=False)
    _finish_good(llm, reqs, good_ref)


def test_max_running_requests_past_the_pool_is_capped_to_its_pages(llama_path, make_llm, caplog):
    """A request holds a page at least, so rows past the pool's pages could never run; sizing per-row buffers for
    them ran out of host memory at max_running_requests=10**9."""
    llm = make_llm(llama_path, page_size=4, max_total_tokens=256, max_running_requests=10**9)
    assert llm.engine.max_rows == 64 and "capped" in caplog.text
    assert [o.token_ids for o in generate_ids(llm, GOOD, greedy(N))] == hf_greedy(llama_path, GOOD, N)


def test_a_context_past_the_models_positions_is_warned_of(llama_path, make_llm, caplog):
    """The model was trained to max_position_embeddings; a longer context_length runs (as asked) with a warning
    naming both, where it used to run silently; within it, nothing is said."""
    positions = make_llm(llama_path).engine.model_config.max_position_embeddings
    assert "max_position_embeddings" not in caplog.text
    llm = make_llm(llama_path, context_length=positions + 64)
    assert llm.engine.context_len == positions + 64
    assert f"context_length={positions + 64} is longer than the model's max_position_embeddings={positions}" in caplog.text


def test_model_dir_without_weights(llama_path, make_llm, tmp_path, good_ref):
    path = str(tmp_path / "noweights")
    shutil.copytree(llama_path, path)
    os.remove(os.path.join(path, "model.safetensors"))
    llm = make_llm(llama_path, page_size=4)
    reqs = _start_good(llm)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(path, device="cpu")
    _finish_good(llm, reqs, good_ref)
