"""--tp-size 2 on two GPUs: NCCL for the model's collectives, captured inside the CUDA graphs, a gloo group beside it
for the lockstep commands. fp32 tiny models: greedy output of TP 2 equals TP 1 for plain decoding (graphs and
eager), NGRAM, STANDALONE, EAGLE and EAGLE-3 (chains and trees), adaptive goodput speculation, and a Qwen3.5 hybrid
(its Gated DeltaNet split by key-head groups) and a Qwen3-Next sparse model (experts split by their intermediate
columns), plain and with their MTP heads; seeded sampling equals too; every rank's pool ends free, and the ranks agree on their pool sizes and tiers. The small all-reduces go
through the push kernel (kernels/all_reduce.py, the default); with --disable-custom-all-reduce (all NCCL) plain,
eager, EAGLE-3 and STANDALONE cases still equal TP 1.

Each TP 2 engine runs in a fresh process: torch's symmetric memory maps the push kernel's buffers for one engine per
process (a later engine in the same process falls back to NCCL, tested below), and the test process builds many.

Run on a machine with two GPUs: `python3 -m pytest tests/gpu/test_tensor_parallel_gpu.py -q`. Not part of CI.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from hyperdraft import LLM, SamplingParams
from hyperdraft.options import RuntimeOptions
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")

NEW_TOKENS = [24, 7, 31, 12, 40, 5]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_gpu")
    llama6 = make_tiny_model(str(root / "llama6"), "llama", seed=2, num_hidden_layers=6)
    zero_only = root / "zero_only.json"  # adaptive step 0 only: EAGLE rounds queue the next verify and catch-up ahead
    zero_only.write_text(json.dumps({"1": {"candidate_steps": [0]}}))
    goodput = root / "goodput.json"
    goodput.write_text(json.dumps({"strategy": "goodput", "goodput": {"warmup": 2, "decide_every": 2,
                                                                      "explore_every": 4}, "1": [1, 3, 5], "8": [0, 1, 3]}))
    from helpers.hybrid_fixtures import with_mtp_weights

    hybrid = with_mtp_weights(make_tiny_model(str(root / "qwen3_5"), "qwen3_5", seed=3), str(root / "qwen3_5_mtp"))
    moe = with_mtp_weights(make_tiny_model(str(root / "qwen3_next"), "qwen3_next", seed=4), str(root / "qwen3_next_mtp"))
    return {"llama": make_tiny_model(str(root / "llama"), "llama", seed=0), "qwen3_5": hybrid, "qwen3_next": moe,
            "qwen3": make_tiny_model(str(root / "qwen3"), "qwen3", seed=1), "llama6": llama6,
            "eagle3": write_random_eagle_checkpoint(str(root / "e3"), llama6, kind="eagle3", draft_vocab_size=200),
            "eagle": write_random_eagle_checkpoint(str(root / "e1"), llama6, kind="eagle"), "goodput": str(goodput),
            "zero_only": str(zero_only)}


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 80, (n,), generator=g).tolist()
    return [torch.randint(5, 380, (k,), generator=g).tolist() for k in lengths]


def _engine_outputs(path, prompts, params, **engine_args) -> tuple[list, list[dict], bool]:
    """(outputs, every rank's state, whether the push all-reduce ran) of one engine in this process."""
    llm = LLM(path, device="cuda", dtype="float32", max_running_requests=8, chunked_prefill_size=32, dist_timeout=120,
              max_total_tokens=4096, **engine_args)
    try:
        outs = [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)]
        return outs, llm.engine.rank_states(), llm.engine.lockstep.tp.push is not None
    finally:
        llm.shutdown()


def _save(out_path: str, fn, *args, **kwargs) -> None:
    torch.save(fn(*args, **kwargs), out_path)


def _in_fresh_process(fn, *args, **kwargs):
    """fn(*args, **kwargs) in a new process (spawned), whose result comes back through a file."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.pt")
        proc = mp.get_context("spawn").Process(target=_save, args=(out_path, fn, *args), kwargs=kwargs)
        proc.start()
        try:
            proc.join(timeout=600)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join()
        assert proc.exitcode == 0, f"the engine's process exited with {proc.exitcode}"
        return torch.load(out_path)


def _outputs(path, prompts, params, **engine_args) -> tuple[list, list[dict], bool]:
    if engine_args.get("tp_size", 1) == 1:
        return _engine_outputs(path, prompts, params, **engine_args)
    return _in_fresh_process(_engine_outputs, path, prompts, params, **engine_args)


CASES = {
    "plain-graphs": ("qwen3", {}),
    "plain-eager": ("qwen3", dict(disable_cuda_graph=True)),
    "plain-replicated-kv": ("llama", dict(page_size=4)),
    "ngram": ("llama", dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)),
    "standalone-chain": ("qwen3", dict(speculative_algorithm="STANDALONE", speculative_draft_model="llama",
                                       speculative_num_steps=3, speculative_eagle_topk=1)),  # draft-ahead
    "standalone-tree": ("qwen3", dict(speculative_algorithm="STANDALONE", speculative_draft_model="llama",
                                      speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)),
    "eagle3-chain": ("llama6", dict(speculative_algorithm="EAGLE3", speculative_draft_model="eagle3",
                                    speculative_num_steps=3, speculative_eagle_topk=1)),
    "eagle3-tree": ("llama6", dict(speculative_algorithm="EAGLE3", speculative_draft_model="eagle3", page_size=4)),
    "eagle3-chain-eager": ("llama6", dict(speculative_algorithm="EAGLE3", speculative_draft_model="eagle3",
                                          speculative_num_steps=3, speculative_eagle_topk=1, disable_cuda_graph=True)),
    "eagle-tree": ("llama6", dict(speculative_algorithm="EAGLE", speculative_draft_model="eagle",
                                  speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=6)),
    "ngram-goodput": ("llama", dict(speculative_algorithm="NGRAM", speculative_adaptive=True,
                                    speculative_adaptive_config="goodput")),
    "eagle3-step-zero": ("llama6", dict(speculative_algorithm="EAGLE3", speculative_draft_model="eagle3",
                                        speculative_adaptive=True, speculative_adaptive_config="zero_only",
                                        speculative_num_steps=0)),
    "hybrid-plain": ("qwen3_5", {}),
    "hybrid-mtp-chain": ("qwen3_5", dict(speculative_algorithm="NEXTN", speculative_num_steps=3,
                                         speculative_eagle_topk=1)),
    "hybrid-mtp-tree": ("qwen3_5", dict(speculative_algorithm="NEXTN", speculative_num_steps=3,
                                        speculative_eagle_topk=2, speculative_num_draft_tokens=5)),
    "moe-plain": ("qwen3_next", {}),  # sparse MLPs split by expert columns (grouped Triton experts per rank)
    "moe-mtp-chain": ("qwen3_next", dict(speculative_algorithm="NEXTN", speculative_num_steps=3,
                                         speculative_eagle_topk=1)),
}


def _tp2_against_tp1(models, case: str, **tp2_args) -> tuple[list[dict], bool]:
    """CASES[case] greedily at TP 1 and at TP 2 (with tp2_args): equal outputs, every rank's pool free -> (the ranks'
    states, whether TP 2 pushed its small all-reduces)."""
    kind, extra = CASES[case]
    extra = {k: (models[v] if k in ("speculative_draft_model", "speculative_adaptive_config") else v)
             for k, v in extra.items()}
    prompts = _prompts(len(NEW_TOKENS), seed=len(case))
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in NEW_TOKENS]
    want, _, _ = _outputs(models[kind], prompts, params, **extra)
    got, states, pushed = _outputs(models[kind], prompts, params, tp_size=2, **tp2_args, **extra)
    assert got == want
    for s in states:
        assert s["kv_free_tokens"] + s.get("cache_tokens", 0) == s["kv_capacity_tokens"], s
    return states, pushed


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_greedy_equals_tp1(models, case):
    states, pushed = _tp2_against_tp1(models, case)
    assert pushed  # the default on two GPUs that reach each other's memory
    assert len(states) == 2
    for s in states:
        assert s["num_running_reqs"] == s["num_waiting_reqs"] == 0, s
    assert states[0]["kv_capacity_tokens"] == states[1]["kv_capacity_tokens"]
    assert states[0].get("speculative_adaptive_slots") == states[1].get("speculative_adaptive_slots")


PUSH = RuntimeOptions.from_env(push_all_reduce=True)


@pytest.mark.parametrize("case", ["plain-graphs", "plain-eager", "eagle3-chain", "standalone-tree"])
def test_tp2_with_nccl_all_reduces_only_equals_tp1(models, case):
    """The other all-reduce path: --disable-custom-all-reduce sends every all-reduce through NCCL (the cases above
    push the small ones, kernels/all_reduce.py, the default on two GPUs that reach each other's memory)."""
    _, pushed = _tp2_against_tp1(models, case, disable_custom_all_reduce=True)
    assert not pushed


def _engines_one_after_another(path: str, prompts, params) -> list[tuple[list, bool, bool]]:
    """In this process, three bf16 TP 2 engines in turn: NCCL only, the default, the default again -> per engine
    (outputs, whether it pushed, every rank's pool free)."""
    results = []
    for options in (RuntimeOptions.from_env(push_all_reduce=False), PUSH, PUSH):
        llm = LLM(path, device="cuda", dtype="bfloat16", max_running_requests=4, chunked_prefill_size=1024,
                  dist_timeout=120, max_total_tokens=8192, tp_size=2, runtime_options=options)
        try:
            outs = [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)]
            free = all(s["kv_free_tokens"] + s.get("cache_tokens", 0) == s["kv_capacity_tokens"]
                       for s in llm.engine.rank_states())
            results.append((outs, llm.engine.lockstep.tp.push is not None, free))
        finally:
            llm.shutdown()
    return results


def test_push_engines_one_after_another_in_bf16_equal_nccl(tmp_path):
    """What a notebook does: in one process a TP 2 engine with NCCL's all-reduces, then one with the push kernel, then
    a third, which falls back to NCCL (torch's symmetric memory maps buffers for one engine per process) instead of
    hanging in its rendezvous, as it did. bf16, a model wide enough that prefill chunks go through NCCL and decode rows
    through the push kernel, and whose row-parallel layers (K of 1024 and 2048 per rank) run the nvcc GEMV right before
    each push: that order hung an 8B engine while the push kernel was launched with PDL (kernels/all_reduce.py). Two
    parts summed in fp32 and rounded once are NCCL's bits, so greedy outputs must be equal; a hang fails."""
    path = make_tiny_model(str(tmp_path / "wide"), "llama", seed=6, hidden_size=2048, intermediate_size=4096,
                           num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                           max_position_embeddings=2048)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 380, (n,), generator=g).tolist() for n in (700, 40, 513, 9)]  # 700 x 2048 > a slot
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (20, 33, 8, 27)]
    (nccl, nccl_pushed, nccl_free), (push, pushed, push_free), (again, again_pushed, again_free) = \
        _in_fresh_process(_engines_one_after_another, path, prompts, params)
    assert (nccl_pushed, pushed, again_pushed) == (False, True, False)
    assert nccl_free and push_free and again_free
    assert push == nccl and again == nccl


@pytest.mark.parametrize("case", ["eagle3-chain", "eagle-tree"])
def test_tp2_with_the_head_split_equals_tp1(models, case):
    """RuntimeOptions.split_draft_head: the head's layers split over the ranks, its all-reduces in its graphs."""
    _, pushed = _tp2_against_tp1(models, case, runtime_options=RuntimeOptions.from_env(split_draft_head=True))
    assert pushed


def test_tp2_seeded_sampling_equals_tp1(models):
    prompts = _prompts(6, seed=11)
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, ignore_eos=True, seed=i) for i in range(6)]
    want, _, _ = _outputs(models["llama"], prompts, params)
    got, _, _ = _outputs(models["llama"], prompts, params, tp_size=2)
    assert got == want


def test_a_dead_rank_stops_the_engine_with_an_error(models):
    llm = LLM(models["llama"], device="cuda", dtype="float32", tp_size=2, dist_timeout=30, max_total_tokens=4096)
    try:
        llm.generate(input_ids=[[1, 2, 3]], sampling_params=SamplingParams(temperature=0.0, max_new_tokens=2),
                     use_tqdm=False)
        follower = llm.engine.lockstep.followers[0]
        follower.kill()
        follower.join(timeout=10)
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited"):
            llm.generate(input_ids=[[4, 5, 6]], sampling_params=SamplingParams(temperature=0.0, max_new_tokens=2),
                         use_tqdm=False)
    finally:
        llm.shutdown()


def test_more_ranks_than_gpus_is_a_clear_error(models):
    last = torch.cuda.device_count() - 1
    with pytest.raises(ValueError, match=f"tp_size=2 over nnodes=1 needs one GPU per rank from cuda:{last}"):
        LLM(models["llama"], device=f"cuda:{last}", dtype="float32", tp_size=2)
