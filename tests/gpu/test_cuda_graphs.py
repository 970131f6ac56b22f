"""CUDA graphs on a GPU: graphs on == graphs off == spec off, for every drafter, chain and tree, with batches that
start above cuda_graph_max_bs (eager fallback) and shrink into it (graph replays at padded sizes).

fp32: token ids must be identical. bf16 in deterministic mode (batch-invariant kernels): graphs on == off ==
spec off, bit for bit. bf16 in the default mode promises neither: a graph replays a batch padded to its captured
size and its attention splits keys by static bounds, and the default kernels are not batch invariant, so a row may
round differently from the eager step; a different draft then changes the verify's shapes, and a near tie can flip
(seen for the EAGLE-3 tree from e4f4fd3, also with every Triton kernel off). Both rates are reported in
$OUT/cuda_graphs_bf16.json.

Run: `PYTHONPATH=. python3 -m pytest tests/gpu/test_cuda_graphs.py -q -s`. Not part of CI.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.options import RuntimeOptions
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

NEW_TOKENS = [2, 17, 5, 11, 24, 8, 14, 3, 20, 9]
REPORT = os.path.join(os.environ.get("OUT", "/tmp"), "cuda_graphs_bf16.json")
CASES = {
    "plain": {},
    "ngram": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5),
    # SGLang 0.5.23's trie tree: node counts differ per request, padded to the captured tree width
    "ngram-trie": dict(speculative_algorithm="NGRAM", speculative_ngram_match_type="PROB",
                       speculative_ngram_max_bfs_breadth=3, speculative_num_draft_tokens=6),
    "standalone-chain": dict(speculative_algorithm="STANDALONE", speculative_num_steps=3, draft="draft"),
    "standalone-tree": dict(speculative_algorithm="STANDALONE", speculative_num_steps=3, speculative_eagle_topk=2,
                            speculative_num_draft_tokens=6, draft="draft"),
    "eagle3-chain": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=1,
                         draft="eagle3", target="target6"),
    "eagle3-tree": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=2,
                        speculative_num_draft_tokens=6, draft="eagle3", target="target6"),
    "adaptive": dict(speculative_algorithm="STANDALONE", speculative_adaptive=True, draft="draft"),
    # An 8-token vocabulary: the random head's drafts are accepted often, so catch-ups of 2..4 positions are padded
    # into the catch-up graphs (the 384-token cases above almost always catch up one position).
    "eagle3-small-chain": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=1,
                               draft="small_eagle3", target="small"),
    "eagle3-small-tree": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=2,
                              speculative_num_draft_tokens=6, draft="small_eagle3", target="small"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("graph_gpu")
    target = make_tiny_model(str(root / "target"), "llama", seed=0)
    target6 = make_tiny_model(str(root / "target6"), "llama", seed=1, num_hidden_layers=6)
    small = make_tiny_model(str(root / "small"), "llama", seed=3, num_hidden_layers=6, vocab_size=8, with_tokenizer=False)
    return {"target": target, "target6": target6, "small": small,
            "small_eagle3": write_random_eagle_checkpoint(str(root / "se3"), small, kind="eagle3", draft_vocab_size=6,
                                                          seed=3),
            "draft": make_tiny_model(str(root / "draft"), "qwen3", seed=2, with_tokenizer=False, hidden_size=32,
                                     intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=16),
            "eagle3": write_random_eagle_checkpoint(str(root / "e3"), target6, kind="eagle3")}


def _prompts(vocab: int = 384) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = [1, 60, 7, 33, 12, 50, 3, 21, 44, 9]
    out = []
    for i, n in enumerate(lengths):
        if i % 2 == 0:  # repetitive: NGRAM finds matches
            pattern = torch.randint(0, vocab, (3,), generator=g).tolist()
            out.append((pattern * n)[:n])
        else:
            out.append(torch.randint(0, vocab, (n,), generator=g).tolist())
    return out


def _run(path, dtype, params: list[SamplingParams] | None = None, **args):
    llm = LLM(path, device="cuda", dtype=dtype, attention_backend="triton", max_total_tokens=8192,
              skip_tokenizer_init=True, **args)
    params = params or [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in NEW_TOKENS]
    prompts = _prompts(llm.engine.model_config.vocab_size)
    outs = [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)]
    engine = llm.engine
    assert engine.flush_cache(), "prefix cache not flushable"  # cached pages are not leaked ones
    assert engine.kv_free_slots == engine.kv_capacity_slots and not engine.has_unfinished()
    graphs = engine.runner.graphs
    replays = 0 if graphs is None else graphs.num_replays
    proposer = getattr(engine.worker, "proposer", None)
    draft_graphs = getattr(getattr(proposer, "runner", None), "graphs", None)
    draft_shapes = set() if draft_graphs is None else {shape for (shape, _), n in draft_graphs.replays.items() if n}
    loop = getattr(proposer, "draft_loop", None)  # greedy rounds: one graph per round (speculative/drafting/graphs.py)
    loop_keys = set() if loop is None else {k for k, n in loop.replays.items() if n}  # RoundKeys
    llm.shutdown()
    return outs, replays, draft_shapes, loop_keys


_SPEC_OFF: dict = {}


MODES = {"float32": ("float32", False), "bfloat16-deterministic": ("bfloat16", True), "bfloat16": ("bfloat16", False)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(CASES))
def test_graphs_on_equals_off(models, name, mode):
    dtype, deterministic = MODES[mode]
    case = dict(CASES[name], enable_deterministic_inference=deterministic)
    target = models[case.pop("target", "target")]
    if "draft" in case:
        case["speculative_draft_model_path"] = models[case.pop("draft")]
    key = (target, mode)
    if key not in _SPEC_OFF:
        _SPEC_OFF[key] = _run(target, dtype, disable_cuda_graph=True, enable_deterministic_inference=deterministic)[0]
    eager = _run(target, dtype, disable_cuda_graph=True, **case)[0]
    graphed, replays, draft_shapes, loop_keys = _run(target, dtype, cuda_graph_max_bs=4, **case)
    assert replays > 0, "no forward ran through a graph"
    if "tree" in name or "chain" in name:  # whole greedy rounds, catch-up included, one graph each
        assert any(k.tier.is_tree == ("tree" in name) for k in loop_keys), f"no round ran as one graph: {loop_keys}"
    if "small" in name:  # catch-ups padded to the captured width
        assert any(k.width > 1 for k in loop_keys), loop_keys
    if mode != "bfloat16":
        assert graphed == eager, f"{name} {mode}: graphs on != graphs off"
        assert graphed == _SPEC_OFF[key], f"{name} {mode}: spec on != spec off"
    if dtype == "bfloat16":
        data = json.load(open(REPORT)) if os.path.exists(REPORT) else {}
        data[f"{name} {mode}"] = {"graphs_on_identical_to_off": sum(a == b for a, b in zip(graphed, eager)),
                                  "identical_to_spec_off": sum(a == b for a, b in zip(graphed, _SPEC_OFF[key])),
                                  "requests": len(graphed)}
        json.dump(data, open(REPORT, "w"), indent=1)


@pytest.mark.parametrize("mode", ["float32", "bfloat16-deterministic"])
@pytest.mark.parametrize("name", ["plain", "eagle3-tree", "adaptive"])
def test_sglang_cuda_graph_bs_replays_equal_eager(models, name, mode):
    """--cuda-graph-bs 2 3 6 on real graphs: batches of 1 replay padded to 2, 4 and 5 to 6, 7+ run eagerly; the
    ten requests (NEW_TOKENS) pass through every one of those sizes as they finish (the captured sizes themselves are
    checked on the CPU, tests/engine/test_graph_runner.py)."""
    dtype, deterministic = MODES[mode]
    case = dict(CASES[name], enable_deterministic_inference=deterministic)
    target = models[case.pop("target", "target")]
    if "draft" in case:
        case["speculative_draft_model_path"] = models[case.pop("draft")]
    eager = _run(target, dtype, disable_cuda_graph=True, **case)[0]
    graphed, replays, _, _ = _run(target, dtype, cuda_graph_bs=[6, 2, 3], **case)
    assert replays > 0, "no forward ran through a graph"
    assert graphed == eager, f"{name} {mode}: --cuda-graph-bs graphs != eager"


SAMPLING_KINDS = {  # requests whose rounds read sampling rows: drafts drawn from q, or penalised
    "drawn": [dict(temperature=0.0), dict(temperature=0.8, top_k=5), dict(temperature=1.0, top_p=0.9),
              dict(temperature=0.7, min_p=0.1)],
    "penalised": [dict(temperature=0.0, repetition_penalty=1.3), dict(temperature=0.8, frequency_penalty=0.4),
                  dict(temperature=0.0, presence_penalty=0.5), dict(temperature=0.9, top_k=5, repetition_penalty=1.2)],
}


@pytest.mark.parametrize("dtype,ahead", [("float32", False), ("bfloat16", False), ("float32", True)])
@pytest.mark.parametrize("kind", list(SAMPLING_KINDS))
@pytest.mark.parametrize("name", ["eagle3-chain", "standalone-tree"])
def test_sampling_round_graphs_equal_step_by_step(models, monkeypatch, name, kind, dtype, ahead):
    """Drafts drawn from q (rejection sampling; seeded greedy and sampled requests, top-k, top-p, min-p and
    penalties among them): whole-round graphs, captured on first use per SamplingKey, give the outputs of the same
    rounds drafted step by step through per-step graphs (sampling_round_graphs off), bit for bit: the same kernels at
    the same padded shapes, and counter-based uniforms. Draft-ahead pads its catch-ups wider, so q may differ in the
    last bits: compared in fp32 only, where a flipped draw would take a near-tie at float32 resolution."""
    monkeypatch.setenv("HYPERDRAFT_DRAFT_AHEAD", "1" if ahead else "0")
    case = dict(CASES[name], speculative_use_rejection_sampling=True)
    target = models[case.pop("target", "target")]
    case["speculative_draft_model_path"] = models[case.pop("draft")]
    kinds = SAMPLING_KINDS[kind]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, seed=100 + i, **kinds[i % len(kinds)])
              for i, n in enumerate(NEW_TOKENS)]
    graphed, _, _, loop_keys = _run(target, dtype, params=params, cuda_graph_max_bs=4, **case)
    assert any(k.sampling is not None for k in loop_keys), f"no sampling round ran as one graph: {loop_keys}"
    monkeypatch.setenv("HYPERDRAFT_DRAFT_AHEAD", "0")
    monkeypatch.setenv("HYPERDRAFT_SAMPLING_ROUND_GRAPH", "0")
    stepped, _, _, stepped_keys = _run(target, dtype, params=params, cuda_graph_max_bs=4, **case)
    assert not any(k.sampling is not None for k in stepped_keys)
    assert graphed == stepped, f"{name} {kind} {dtype}: sampling round graphs != step by step"


def test_every_batch_size_of_a_shape_shares_one_set_of_outputs(models):
    """The target's and the draft head's graphs of one shape write their outputs into the largest graph's buffers
    (graph_runner.py says why): every captured size's logits start at the same address."""
    llm = LLM(models["target6"], device="cuda", dtype="float32", max_total_tokens=8192, skip_tokenizer_init=True,
              cuda_graph_max_bs=16, speculative_algorithm="EAGLE3", speculative_draft_model_path=models["eagle3"],
              speculative_num_steps=3, speculative_eagle_topk=1)
    for graphs in (llm.engine.runner.graphs, llm.engine.worker.proposer.runner.graphs):
        by_shape: dict = {}
        for (shape, bs), out in graphs.outputs.items():
            by_shape.setdefault(shape, set()).add(out.logits.data_ptr())
        assert by_shape and all(len(ptrs) == 1 for ptrs in by_shape.values()), by_shape
        assert any(len(graphs.sizes[shape]) > 1 for shape in by_shape)
    llm.shutdown()


@pytest.mark.parametrize("name", ["plain", "ngram", "ngram-trie", "eagle3-chain", "eagle3-tree"])
def test_prompts_admitted_beside_running_requests(models, name):
    """Three requests at a time (fp32): every later prompt is admitted while others decode or speculate, and its tail
    replays a captured prompt-tail extend beside the decodes' or the verify's graph (runner/prompt_tails.py). Token
    ids equal plain decoding without graphs."""
    case = dict(CASES[name])
    target = models[case.pop("target", "target")]
    if "draft" in case:
        case["speculative_draft_model_path"] = models[case.pop("draft")]
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in NEW_TOKENS]

    def run(**args):
        llm = LLM(target, device="cuda", dtype="float32", attention_backend="triton", max_total_tokens=8192,
                  skip_tokenizer_init=True, max_running_requests=3, **args)
        prompts = _prompts(llm.engine.model_config.vocab_size)
        outs = [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)]
        graphs = llm.engine.runner.graphs
        tails = 0 if graphs is None else sum(n for key, n in graphs.replays.items() if key[0].one_logit)
        assert llm.engine.flush_cache() and llm.engine.kv_free_slots == llm.engine.kv_capacity_slots
        llm.shutdown()
        return outs, tails

    reference, _ = run(disable_cuda_graph=True)
    graphed, tails = run(cuda_graph_max_bs=4, **case)
    assert tails > 0, "no prompt tail ran as a captured extend"
    assert graphed == reference, f"{name}: graphs with prompt tails beside running requests != plain decoding"


@pytest.mark.parametrize("mode", ["float32", "bfloat16-deterministic"])
@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE", "EAGLE3"])
def test_step_zero_as_plain_decodes_in_graphs(models, algo, mode, tmp_path):
    """Adaptive step 0 runs as the plain worker's step (speculative/worker.py): its decodes replay the decode graph and
    queue the next decode ahead; an EAGLE-3 head parks (its inputs kept by slot from those decodes, consumed by the
    next round). Tiers 3, 0, 3, 0 (a huge down-hysteresis, then the probe) make every round follow a plain step, whose
    queued decode it must throw away. Token for token spec off: fp32, and bf16 in deterministic mode (bitwise)."""
    dtype, deterministic = MODES[mode]
    cfg = tmp_path / "zero_three.json"
    cfg.write_text(json.dumps({"ema_alpha": 1.0, "warmup_batches": 0, "update_interval": 1,
                               "1": {"candidate_steps": [0, 3], "down_hysteresis": 10.0}}))
    case = dict(speculative_algorithm=algo, speculative_adaptive=True, speculative_adaptive_config=str(cfg),
                speculative_num_steps=0, enable_deterministic_inference=deterministic)
    target = models["target6" if algo == "EAGLE3" else "target"]
    if algo != "NGRAM":
        case["speculative_draft_model_path"] = models["draft" if algo == "STANDALONE" else "eagle3"]
    key = (target, mode)
    if key not in _SPEC_OFF:
        _SPEC_OFF[key] = _run(target, dtype, disable_cuda_graph=True, enable_deterministic_inference=deterministic)[0]
    llm = LLM(target, device="cuda", dtype=dtype, attention_backend="triton", max_total_tokens=8192,
              skip_tokenizer_init=True, cuda_graph_max_bs=4, **case)
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in NEW_TOKENS]
    outs = [o.token_ids for o in llm.generate(input_ids=_prompts(), sampling_params=params, use_tqdm=False)]
    worker = llm.engine.worker
    tiers = worker.metrics.summary()["spec_steps_per_tier"]
    discarded = worker.plain.ahead_discarded
    assert llm.engine.flush_cache() and llm.engine.kv_free_slots == llm.engine.kv_capacity_slots  # the prefix cache
    # holds finished requests' pages until flushed
    llm.shutdown()
    assert outs == _SPEC_OFF[key], f"{algo} {mode}: step 0 as plain decodes changed the output"
    assert tiers.get("0", 0) > 5 and tiers.get("3", 0) > 5, tiers
    assert discarded > 0, "no queued decode was thrown away: the plain steps never queued one"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eagle_step_zero_verifies_ahead_in_graphs(models, dtype, tmp_path):
    """EAGLE-3 at adaptive step 0 (a ladder of step 0 only), head not parked: each round queues the next round's verify
    (speculative/verify_ahead.py), a replay of the one-token graph, used when the next step is a step-0 round of the
    same requests. fp32: token for token spec off; bf16: bitwise the same engine with queuing off (same graphs)."""
    cfg = tmp_path / "zero_only.json"
    cfg.write_text(json.dumps({"1": {"candidate_steps": [0]}}))
    case = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=models["eagle3"], cuda_graph_max_bs=4,
                max_running_requests=4, speculative_adaptive=True, speculative_adaptive_config=str(cfg), speculative_num_steps=0)
    target = models["target6"]
    outs = {}
    for ahead in (True, False):
        llm = LLM(target, device="cuda", dtype=dtype, attention_backend="triton", max_total_tokens=8192,
                  skip_tokenizer_init=True, runtime_options=RuntimeOptions.from_env(decode_ahead=ahead, park_head=False), **case)
        params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in NEW_TOKENS]
        outs[ahead] = [o.token_ids for o in llm.generate(input_ids=_prompts(), sampling_params=params, use_tqdm=False)]
        used = llm.engine.worker.verify_ahead.used
        assert llm.engine.flush_cache() and llm.engine.kv_free_slots == llm.engine.kv_capacity_slots
        llm.shutdown()
        assert (used > 5) == ahead, used
    assert outs[True] == outs[False], f"{dtype}: a queued verify changed the output"
    if dtype == "float32":
        assert outs[True] == _run(target, dtype, disable_cuda_graph=True)[0], "spec on != spec off"


def test_parked_head_states_kept_inside_the_decode_graph(models, tmp_path):
    """A parked EAGLE-3 head's input states are kept by the step-0 decode graph itself (GraphRunner.capture's sink):
    after every step, each parked request's kept states equal those an eager engine keeps after the decode, fp32, at
    every position since it parked (batches padded to captured sizes, decodes queued ahead, requests finishing)."""
    cfg = tmp_path / "zero_only.json"
    cfg.write_text(json.dumps({"1": {"candidate_steps": [0]}}))
    case = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=models["eagle3"], speculative_adaptive=True,
                speculative_adaptive_config=str(cfg), speculative_num_steps=0, max_running_requests=4)
    llms = [LLM(models["target6"], device="cuda", dtype="float32", attention_backend="triton", max_total_tokens=8192,
                skip_tokenizer_init=True, **case, **graphs) for graphs in (dict(cuda_graph_max_bs=4),
                                                                            dict(disable_cuda_graph=True))]
    engines = [llm.engine for llm in llms]
    for engine in engines:
        for ids, n in zip(_prompts()[:3], (20, 9, 14)):
            engine.add_request(input_ids=ids, params=SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
    graphed, eager = engines
    compared = 0
    while graphed.has_unfinished():
        for engine in engines:
            engine.step()
        twins = {r.rid: r for r in eager.scheduler.running}
        for req in graphed.scheduler.running:
            kept = [e.worker.proposer.slot_hidden for e in engines]
            if not kept[0].is_parked(req):
                continue
            twin = twins[req.rid]
            positions = list(range(req.draft_num_computed, req.num_computed))
            mine = kept[0].gather([req.row] * len(positions), positions)
            theirs = kept[1].gather([twin.row] * len(positions), positions)
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
            compared += len(positions)
    assert graphed.worker.runner.graphs.sinks, "no decode graph was captured with the head's sink"
    assert compared > 30, compared
    for llm in llms:
        llm.shutdown()


ROUND_AHEAD_CASES = {
    "eagle3-small-chain": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=1,
                               draft="small_eagle3", target="small"),
    "standalone-chain": dict(speculative_algorithm="STANDALONE", speculative_num_steps=3, draft="draft"),
    "eagle3-chain-sampled": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=1,
                                 speculative_use_rejection_sampling=True, draft="eagle3", target="target6"),
    "eagle3-small-tree": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=2,
                              speculative_num_draft_tokens=6, draft="small_eagle3", target="small"),
    "standalone-tree": dict(speculative_algorithm="STANDALONE", speculative_num_steps=3, speculative_eagle_topk=2,
                            speculative_num_draft_tokens=6, draft="draft"),
    "ngram-chain": dict(speculative_algorithm="NGRAM", speculative_num_steps=3, draft=None),  # the device lookup
}


@pytest.mark.parametrize("mode", ["float32", "bfloat16-deterministic"])
@pytest.mark.parametrize("name", list(ROUND_AHEAD_CASES))
def test_drafted_rounds_verify_ahead_in_graphs(models, name, mode):
    """A drafted round, chain or tree, queues the next round's verify with its next draft
    (speculative/verify_ahead.py): rows placed on the device by each request's accept count, a replay of the verify
    graph. Round-ahead on equals off bit
    for bit (fp32 and deterministic bf16, greedy or seeded sampling), greedy equals spec off, and queued verifies
    served rounds."""
    dtype, deterministic = MODES[mode]
    case = dict(ROUND_AHEAD_CASES[name])
    target = models[case.pop("target", "target")]
    draft = case.pop("draft")
    case = dict(case, speculative_draft_model_path=models[draft] if draft else None, cuda_graph_max_bs=4,
                max_running_requests=4, enable_deterministic_inference=deterministic)
    sampled = case.get("speculative_use_rejection_sampling", False)
    params = [SamplingParams(temperature=0.8 if sampled else 0, top_k=20, seed=i, max_new_tokens=n, ignore_eos=True)
              for i, n in enumerate(NEW_TOKENS)]
    outs, used = {}, {}
    for ahead in (True, False):
        llm = LLM(target, device="cuda", dtype=dtype, attention_backend="triton", max_total_tokens=8192,
                  skip_tokenizer_init=True, runtime_options=RuntimeOptions.from_env(round_ahead=ahead), **case)
        prompts = _prompts(llm.engine.model_config.vocab_size)
        outs[ahead] = [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)]
        used[ahead] = llm.engine.worker.verify_ahead.used
        assert llm.engine.flush_cache() and llm.engine.kv_free_slots == llm.engine.kv_capacity_slots
        llm.shutdown()
    assert used[True] > 0 and used[False] == 0, used
    assert outs[True] == outs[False], f"{name} {mode}: a queued verify changed the output"
    if not sampled:
        key = (target, mode)
        if key not in _SPEC_OFF:
            _SPEC_OFF[key] = _run(target, dtype, disable_cuda_graph=True, enable_deterministic_inference=deterministic)[0]
        assert outs[True] == _SPEC_OFF[key], "spec on != spec off"
