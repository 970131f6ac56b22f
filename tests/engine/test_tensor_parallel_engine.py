"""--tp-size 2 on the CPU: two processes (gloo), the model split over them, the engines in lockstep
(engine/lockstep.py). Greedy and seeded sampled outputs equal tp_size 1's, for plain decoding, NGRAM, STANDALONE
(its draft replicated on both ranks), EAGLE and EAGLE-3 (the head whole on every rank, with whole copies of the
target's embedding and lm_head), chains and trees, at page sizes 1 and 4 with chunked prefill; every rank's K/V
pool ends free; a rank that dies stops the engine with an error instead of a hang; bad settings are clear errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.engine.lockstep import free_address
from hyperdraft.models.config import load_model_config
from hyperdraft.models.eagle import load_eagle_config
from hyperdraft.options import RuntimeOptions
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model
from helpers.spec_fixtures import greedy, mixed_prompts
from tests.conftest import assert_engine_clean

NEW_TOKENS = [12, 5, 20, 9, 16, 3]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    from helpers.hybrid_fixtures import near_bigram_with_mtp, with_mtp_weights

    llama6 = make_tiny_model(str(root / "llama6"), "llama", seed=2, num_hidden_layers=6)
    hybrid = with_mtp_weights(make_tiny_model(str(root / "qwen3_5"), "qwen3_5", seed=3), str(root / "qwen3_5_mtp"))
    three_heads = make_tiny_model(str(root / "llama3h"), "llama", seed=4, hidden_size=96, num_attention_heads=3,
                                  num_key_value_heads=1)  # its heads do not divide over two ranks
    return {"llama": make_tiny_model(str(root / "llama"), "llama", seed=0), "llama3h": three_heads,
            "qwen3": make_tiny_model(str(root / "qwen3"), "qwen3", seed=1), "llama6": llama6, "qwen3_5": hybrid,
            # a near-bigram Qwen3.5 whose MTP drafts are often accepted (the random head's hardly ever)
            "qwen3_5_accepting": near_bigram_with_mtp("qwen3_5", str(root / "accepting")),
            "eagle3": write_random_eagle_checkpoint(str(root / "e3"), llama6, kind="eagle3", draft_vocab_size=200),
            "eagle": write_random_eagle_checkpoint(str(root / "e1"), llama6, kind="eagle")}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _outputs(path, prompts, params, **engine_args):
    outs, states, _ = _outputs_inspected(None, path, prompts, params, **engine_args)
    return outs, states


def _outputs_inspected(inspect, path, prompts, params, **engine_args):
    """-> (outputs, every rank's state, inspect(llm) taken from rank 0 after the run, before shutdown)."""
    llm = LLM(path, device="cpu", dtype="float32", max_running_requests=4, chunked_prefill_size=24, dist_timeout=120,
              **engine_args)
    try:
        outs = [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)]
        seen = inspect(llm) if inspect is not None else None
        states = llm.engine.rank_states()
        assert_engine_clean(llm)
    finally:
        llm.shutdown()
    return outs, states, seen


def _check_pools_free(states, tp_size):
    assert len(states) == tp_size
    for s in states:  # every rank: nothing running, every page free or held by the prefix cache only
        assert s["num_running_reqs"] == s["num_waiting_reqs"] == 0, s
        assert s["kv_free_tokens"] + s.get("cache_tokens", 0) == s["kv_capacity_tokens"], s


@pytest.mark.parametrize("kind,page_size,extra", [
    ("qwen3", 4, {}),
    ("llama", 4, dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)),
    ("qwen3", 1, dict(speculative_algorithm="NGRAM", speculative_ngram_match_type="PROB",
                      speculative_ngram_max_bfs_breadth=3, speculative_num_draft_tokens=6)),
    ("qwen3", 4, dict(speculative_algorithm="STANDALONE", speculative_draft_model="llama", speculative_num_steps=3,
                      speculative_eagle_topk=2, speculative_num_draft_tokens=6)),
    ("llama6", 1, dict(speculative_algorithm="EAGLE3", speculative_draft_model="eagle3", speculative_num_steps=3,
                       speculative_eagle_topk=1)),
    ("llama6", 4, dict(speculative_algorithm="EAGLE3", speculative_draft_model="eagle3")),
    ("llama6", 4, dict(speculative_algorithm="EAGLE", speculative_draft_model="eagle", speculative_num_steps=3,
                       speculative_eagle_topk=2, speculative_num_draft_tokens=6)),
    ("qwen3_5", 4, {}),
    ("qwen3_5", 1, dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=2,
                        speculative_num_draft_tokens=5)),
    ("qwen3_5_accepting", 4, dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=2,
                                  speculative_num_draft_tokens=5)),
], ids=["plain-qwen3-page4", "ngram", "ngram-trie-tree", "standalone-tree", "eagle3-chain",
        "eagle3-tree", "eagle-tree", "hybrid-qwen3.5", "hybrid-mtp-tree", "hybrid-mtp-tree-accepting"])
def test_tp2_greedy_equals_tp1(models, kind, page_size, extra):
    """Llama's one K/V head is replicated on both ranks; Qwen3's two are split. Page sizes 1 and 4, chains and trees
    (each case starts a process: a few seconds). On the accepting hybrid checkpoint, drafts are accepted (asserted):
    every rank advances its heads' recurrent states over the same accepted paths."""
    extra = {k: (models[v] if k == "speculative_draft_model" else v) for k, v in extra.items()}
    prompts = mixed_prompts(len(NEW_TOKENS), seed=4, max_len=60)
    params = [greedy(n) for n in NEW_TOKENS]
    want, _ = _outputs(models[kind], prompts, params, page_size=page_size, **extra)
    accepted = lambda llm: llm.get_server_info()["internal_states"][0].get("spec_acceptance_by_position")  # noqa: E731
    got, states, by_position = _outputs_inspected(accepted, models[kind], prompts, params, page_size=page_size,
                                                  tp_size=2, **extra)
    assert got == want
    _check_pools_free(states, 2)
    if kind == "qwen3_5_accepting":
        assert by_position[0] > 0.1, by_position  # a first draft accepted in about a fifth of the rounds


def _near_tie_eagle3(root):
    """A target whose logits are all zero (greedy: always token 0) and an EAGLE-3 head whose lm_head rows 0 and 7 differ
    by 3e-7 relative: which one it drafts rests on the last bits of its products."""
    from safetensors.torch import load_file, save_file

    target = make_tiny_model(str(root / "t"), "llama", seed=7, with_tokenizer=False, vocab_size=4000, hidden_size=512,
                             intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                             head_dim=64)
    weights = load_file(f"{target}/model.safetensors")
    weights["model.norm.weight"].zero_()
    save_file(weights, f"{target}/model.safetensors", metadata={"format": "pt"})
    head = write_random_eagle_checkpoint(str(root / "e3"), target, kind="eagle3", draft_vocab_size=None, seed=1)
    weights = load_file(f"{head}/model.safetensors")
    lm = weights["lm_head.weight"]
    lm[0] *= 10
    lm[7] = lm[0] * (1 + 3e-7 * torch.randn(lm.shape[1], generator=torch.Generator().manual_seed(0)))
    save_file(weights, f"{head}/model.safetensors", metadata={"format": "pt"})
    return target, head


def test_every_rank_runs_as_many_threads_so_near_tied_drafts_agree(tmp_path):
    """The head runs whole on every rank, and CPU products round by thread count: rank 0 kept all of a 2-thread
    process's threads where the follower took half, the two drafted different tokens at a near-tie, and the group
    failed (a gloo size mismatch). Every rank now runs the same share (lockstep.rank_threads)."""
    target, head = _near_tie_eagle3(tmp_path)
    prompts = mixed_prompts(6, seed=0, max_len=40)
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head, speculative_num_steps=3,
                speculative_eagle_topk=1, skip_tokenizer_init=True)
    torch.set_num_threads(2)  # as a 2-core process starts (the autouse fixture gives the rest of this file one)
    got, states = _outputs(target, prompts, [greedy(24)] * 6, tp_size=2, **spec)
    assert got == [[0] * 24] * 6
    assert states[0]["intra_op_threads"] == states[1]["intra_op_threads"] == 1
    _check_pools_free(states, 2)


def test_adaptive_goodput_tiers_agree_on_every_rank(models, tmp_path):
    """The goodput strategy picks tiers from measured step times, and each rank's clock differs: every rank feeds
    rank 0's times, so their tier states (cost fits included) stay equal, and so do their verify shapes."""
    cfg = tmp_path / "goodput.json"
    cfg.write_text(json.dumps({"strategy": "goodput", "goodput": {"warmup": 2, "decide_every": 2, "explore_every": 4},
                               "1": [1, 3, 5], "4": [0, 1, 3]}))
    prompts = [[5, 6, 7] * 6, [9, 8] * 8, [1, 2, 3, 4] * 4, [20, 21] * 9]
    params = [greedy(24) for _ in prompts]
    spec = dict(speculative_algorithm="NGRAM", speculative_adaptive=True, speculative_adaptive_config=str(cfg))
    want, _ = _outputs(models["llama"], prompts, params, **spec)
    got, states = _outputs(models["llama"], prompts, params, tp_size=2, **spec)
    assert got == want
    _check_pools_free(states, 2)
    slots = [s["speculative_adaptive_slots"] for s in states]
    assert slots[0]["4"]["cost_fit"] and slots[0]["4"]["decisions"] > 0
    assert slots[0] == slots[1]


def test_step_zero_as_plain_decodes_on_every_rank(models, tmp_path):
    """NGRAM's step-0 steps run as plain decode steps (speculative/worker.py) on every rank; with tiers 3, 0, 3, 0 the
    ranks switch between those and rounds together, and TP 2 equals TP 1."""
    cfg = tmp_path / "zero_three.json"
    cfg.write_text(json.dumps({"ema_alpha": 1.0, "warmup_batches": 0, "update_interval": 1,
                               "1": {"candidate_steps": [0, 3], "down_hysteresis": 10.0}}))
    prompts = [[5, 6, 7] * 6, [9, 8] * 8, [1, 2, 3, 4] * 4, [20, 21] * 9]
    params = [greedy(24) for _ in prompts]
    spec = dict(speculative_algorithm="NGRAM", speculative_adaptive=True, speculative_adaptive_config=str(cfg),
                speculative_num_steps=0)
    want, _ = _outputs(models["llama"], prompts, params)
    got, states, tiers = _outputs_inspected(  # rank 0's tiers
        lambda llm: llm.get_server_info()["internal_states"][0]["spec_steps_per_tier"], models["llama"], prompts,
        params, tp_size=2, **spec)
    assert got == want
    _check_pools_free(states, 2)
    assert tiers.get("0", 0) > 5 and tiers.get("3", 0) > 5, tiers
    slots = [s["speculative_adaptive_slots"] for s in states]
    assert slots[0] == slots[1], slots  # every rank switched with rank 0


@pytest.mark.parametrize("park", [False, True], ids=["rounds", "parked"])
def test_eagle_step_zero_on_every_rank(models, monkeypatch, tmp_path, park):
    """rounds (park_head off): an EAGLE-3 head's step-0 rounds queue their next verify (speculative/verify_ahead.py), a
    forward with the target's all-reduces: every rank queues, uses and drops it in the same steps (emulated graphs).
    parked: step 0 from 3 requests runs as plain decodes, queued ahead on every rank, the head's inputs kept by slot;
    rounds of 3 once two requests are left unpark it. Either way TP 2 gives TP 1's output with every pool free."""
    monkeypatch.setenv("HYPERDRAFT_EMULATE_CUDA_GRAPH", "1")  # the spawned ranks inherit it
    monkeypatch.setenv("HYPERDRAFT_PARK_HEAD", "1" if park else "0")
    cfg = tmp_path / "ladder.json"
    cfg.write_text(json.dumps({"1": {"candidate_steps": [3]}, "3": {"candidate_steps": [0]}} if park
                              else {"1": {"candidate_steps": [0]}}))
    prompts = mixed_prompts(4, seed=7, max_len=30)
    params = [greedy(n) for n in (16, 9, 16, 12)]  # the batch changes: queued verifies are dropped too
    args = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=models["eagle3"], cuda_graph_max_bs=4,
                speculative_adaptive=True, speculative_adaptive_config=str(cfg), speculative_num_steps=0)
    want, _ = _outputs(models["llama6"], prompts, params, **args)
    assert want == _outputs(models["llama6"], prompts, params)[0]  # greedy: plain decoding's tokens
    def queued(llm):
        worker = llm.engine.worker
        if park:
            return worker.plain.ahead_used, worker.plain.ahead_discarded
        return worker.verify_ahead.used, worker.verify_ahead.dropped

    got, states, counts = _outputs_inspected(queued, models["llama6"], prompts, params, tp_size=2, **args)
    assert got == want
    _check_pools_free(states, 2)
    assert counts[0] > (2 if park else 5) and counts[1] > 0, counts


def test_flush_cache_empties_every_ranks_ngram_history(models):
    """Every rank drafts for itself, so a flush (recorded, replayed by the followers) must empty every rank's NGRAM
    history: a follower still drafting the first run's answers would verify other tokens than rank 0."""
    prompts = [[5, 6, 7] * 6, [9, 8] * 8, [1, 2, 3, 4] * 4]
    params = [greedy(20) for _ in prompts]
    want, _ = _outputs(models["llama"], prompts, params)

    def run_again(llm):
        assert llm.flush_cache()
        return [o.token_ids for o in llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)]

    got, states, again = _outputs_inspected(run_again, models["llama"], prompts, params, tp_size=2,
                                            speculative_algorithm="NGRAM", speculative_num_steps=4)
    assert got == want and again == want
    _check_pools_free(states, 2)


def test_rank_states_after_a_flush_or_an_abort_are_every_ranks_current_ones(models):
    """A flush or an abort is recorded on rank 0 and reached the followers only with the next step, so rank_states()
    right after one showed the followers as before it: a prefix cache still holding tokens, a request still running."""
    llm = LLM(models["llama"], device="cpu", dtype="float32", tp_size=2, dist_timeout=120)
    try:
        llm.generate(input_ids=[[5, 6, 7, 8] * 5], sampling_params=greedy(4), use_tqdm=False)
        assert llm.flush_cache()
        assert [s.get("cache_tokens", 0) for s in llm.engine.rank_states()] == [0, 0]
        req = llm.engine.add_request(input_ids=[1, 2, 3], params=greedy(50))
        llm.engine.step()
        llm.engine.abort(req.rid)
        states = llm.engine.rank_states()
        assert [s["num_running_reqs"] for s in states] == [0, 0]
        assert states[0] == states[1]
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


def test_two_nodes_give_one_nodes_output(models):
    """nnodes 2, one rank each, on this machine: "node 1" is `hyperdraft serve --node-rank 1` in its own process
    (it hosts rank 1 and serves nothing), node 0 the LLM; it equals TP 1, and node 1 exits cleanly when node 0 stops."""
    prompts = mixed_prompts(4, seed=6, max_len=40)
    params = [greedy(n) for n in NEW_TOKENS[:4]]
    want, _ = _outputs(models["qwen3"], prompts, params)
    address = free_address()
    node1 = subprocess.Popen([sys.executable, "-m", "hyperdraft", "serve", "--model", models["qwen3"], "--device", "cpu",
                              "--dtype", "float32", "--max-running-requests", "4", "--chunked-prefill-size", "24",
                              "--dist-timeout", "120", "--tp-size", "2", "--nnodes", "2", "--node-rank", "1",
                              "--dist-init-addr", address])
    try:
        got, states = _outputs(models["qwen3"], prompts, params, tp_size=2, nnodes=2, dist_init_addr=address)
        assert node1.wait(timeout=60) == 0
    finally:
        node1.kill()
    assert got == want
    _check_pools_free(states, 2)


@pytest.mark.parametrize("draft,tree,split", [("llama", False, True), ("llama", True, True), ("llama3h", False, False)],
                         ids=["split-chain", "split-tree", "indivisible-whole"])
def test_a_standalone_draft_split_or_whole_gives_tp1s_output(models, draft, tree, split):
    """By default (RuntimeOptions.split_draft_model) the STANDALONE draft is split over the ranks like the target
    (its heads and MLP columns, its own all-reduces and K/V pool per rank); a draft whose heads do not divide over
    them stays whole on each, as it does with the option off."""
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model=models[draft], speculative_num_steps=3,
                speculative_eagle_topk=2 if tree else 1, speculative_num_draft_tokens=6 if tree else 4)
    prompts = mixed_prompts(len(NEW_TOKENS), seed=7, max_len=60)
    params = [greedy(n) for n in NEW_TOKENS]
    want, _ = _outputs(models["qwen3"], prompts, params, page_size=4, **spec)
    got, states, draft_cfg = _outputs_inspected(lambda llm: llm.engine.worker.proposer.runner.model.config,
                                                models["qwen3"], prompts, params, page_size=4, tp_size=2, **spec)
    assert draft_cfg.num_heads * (2 if split else 1) == load_model_config(models[draft]).num_heads
    assert got == want
    _check_pools_free(states, 2)


@pytest.mark.parametrize("algo,tree", [("EAGLE3", False), ("EAGLE3", True), ("EAGLE", True)],
                         ids=["eagle3-chain", "eagle3-tree", "eagle-tree"])
def test_a_split_draft_head_gives_tp1s_output(models, algo, tree):
    """With RuntimeOptions.split_draft_head an EAGLE / EAGLE-3 head's layers split over the ranks like the target's
    (its attention heads and MLP columns, its own all-reduces, a K/V pool of its share of the heads; its one K/V head
    replicated), fc, embedding and lm_head whole: the output is still TP 1's, pools end free. A random head's drafts
    are rejected whatever they are, so its numerics are checked apart (tests/models/test_tensor_parallel.py)."""
    spec = dict(speculative_algorithm=algo, speculative_draft_model=models[algo.lower()], speculative_num_steps=3,
                speculative_eagle_topk=2 if tree else 1, speculative_num_draft_tokens=6 if tree else 4)
    prompts = mixed_prompts(len(NEW_TOKENS), seed=9, max_len=60)
    params = [greedy(n) for n in NEW_TOKENS]
    want, _ = _outputs(models["llama6"], prompts, params, **spec)
    got, states, (head_cfg, borrowed) = _outputs_inspected(
        lambda llm: (llm.engine.worker.proposer.head.config, set(llm.engine.worker.proposer.head._shared)),
        models["llama6"], prompts, params, tp_size=2, runtime_options=RuntimeOptions.from_env(split_draft_head=True),
        **spec)
    whole = load_eagle_config(models[algo.lower()])
    assert (head_cfg.num_attention_heads * 2, head_cfg.intermediate_size * 2) == (whole.num_attention_heads,
                                                                                  whole.intermediate_size)
    # the head keeps whole copies of the split target's tables only where it has none of its own (EAGLE-3's
    # checkpoint brings an lm_head over its draft vocabulary)
    assert borrowed == ({"embed_tokens"} if algo == "EAGLE3" else {"embed_tokens", "lm_head"})
    assert got == want
    _check_pools_free(states, 2)


def test_tp2_seeded_sampling_equals_tp1(models):
    prompts = mixed_prompts(6, seed=5, max_len=30)
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, ignore_eos=True, seed=i) for i in range(6)]
    want, _ = _outputs(models["llama"], prompts, params)
    got, _ = _outputs(models["llama"], prompts, params, tensor_parallel_size=2)
    assert got == want


@pytest.mark.parametrize("spec", [
    dict(speculative_algorithm="EAGLE3", speculative_draft_model="eagle3", speculative_num_steps=3,
         speculative_eagle_topk=1),
    dict(speculative_algorithm="STANDALONE", speculative_draft_model="llama", speculative_num_steps=3,
         speculative_eagle_topk=2, speculative_num_draft_tokens=6),
], ids=["eagle3-chain", "standalone-tree"])
def test_tp2_sampling_round_graphs_equal_tp1(models, monkeypatch, spec):
    """Rounds drawn from q or penalised run as one graph, captured on the first round of each SamplingKey: under
    tensor parallelism every rank captures it in the same step (emulated graphs here), and TP 2 gives TP 1's seeded
    outputs with every pool free. A chain round's next verify, queued with its next draft
    (speculative/verify_ahead.py), is a target forward with all-reduces: every rank queues, uses and drops it in the
    same steps."""
    monkeypatch.setenv("HYPERDRAFT_EMULATE_CUDA_GRAPH", "1")  # the spawned ranks inherit it
    spec = {k: (models[v] if k == "speculative_draft_model" else v) for k, v in spec.items()}
    target = "llama6" if spec["speculative_algorithm"] == "EAGLE3" else "qwen3"
    prompts = mixed_prompts(6, seed=6, max_len=30)
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_k=20), dict(temperature=1.0, repetition_penalty=1.2),
             dict(temperature=0.0, frequency_penalty=0.5)]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, seed=i, **kinds[i % len(kinds)]) for i in range(6)]
    args = dict(spec, speculative_use_rejection_sampling=True, cuda_graph_max_bs=4)
    want, _ = _outputs(models[target], prompts, params, **args)
    got, states, (replays, queued) = _outputs_inspected(  # rank 0's round graphs and queued verifies used
        lambda llm: (llm.engine.worker.proposer.draft_loop.replays, llm.engine.worker.verify_ahead.used),
        models[target], prompts, params, tp_size=2, **args)
    assert got == want
    _check_pools_free(states, 2)
    assert sum(n for k, n in replays.items() if k.sampling is not None) > 0, replays
    if spec["speculative_eagle_topk"] == 1:  # trees drawn from q are drafted step by step: nothing queued ahead
        assert queued > 0, "no queued verify served a round on rank 0"


def test_a_dead_rank_stops_the_engine_with_an_error(models):
    llm = LLM(models["llama"], device="cpu", dtype="float32", tp_size=2, dist_timeout=30)
    try:
        llm.generate(input_ids=[[1, 2, 3]], sampling_params=greedy(2), use_tqdm=False)
        follower = llm.engine.lockstep.followers[0]
        follower.kill()
        follower.join(timeout=10)
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited"):
            llm.generate(input_ids=[[4, 5, 6]], sampling_params=greedy(2), use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("args,match", [
    (dict(tp_size=0), "tp_size must be an integer >= 1"),
    (dict(tp_size=2, nnodes=2), "dist_init_addr must be node 0's HOST:PORT"),
    (dict(tp_size=2, nnodes=3, dist_init_addr="127.0.0.1:1"), "nnodes must be an integer >= 1 dividing tp_size=2"),
    (dict(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="127.0.0.1:1"), r"node_rank must be an integer in \[0, nnodes=2\)"),
    (dict(tp_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1"), "node_rank=1: this machine only hosts"),
    (dict(tp_size=3), "tp_size=3 must divide the model's num_attention_heads=4"),
])
def test_bad_tensor_parallel_settings_are_clear_errors(models, args, match):
    with pytest.raises(ValueError, match=match):
        LLM(models["llama"], device="cpu", **args)


@pytest.mark.parametrize("spec", [{}, dict(speculative_algorithm="NEXTN", speculative_num_steps=3)], ids=["plain", "mtp"])
def test_a_qwen3_next_moe_split_equals_tp1(tmp_path, spec):
    """Qwen3-Next's sparse MLPs split by every expert's intermediate columns (the router whole on each rank, one
    all-reduce per layer), its dense layers and Gated DeltaNet as Qwen3.5's; the MTP head (itself sparse) runs whole.
    Chunked prefill, a shared prefix (state snapshots), greedy: TP 2 gives TP 1's tokens."""
    from helpers.hybrid_fixtures import with_mtp_weights

    path = make_tiny_model(str(tmp_path / "n"), "qwen3_next", seed=1)
    if spec:
        path = with_mtp_weights(path, str(tmp_path / "n_mtp"))
    stem = mixed_prompts(1, seed=3, min_len=20, max_len=20)[0]
    prompts = mixed_prompts(4, seed=4, max_len=50) + [stem + [5, 6, 7], stem + [8, 9]]
    params = [greedy(n) for n in (12, 5, 9, 16, 7, 10)]
    want, _ = _outputs(path, prompts, params, **spec)
    got, states = _outputs(path, prompts, params, tp_size=2, **spec)
    assert got == want
    _check_pools_free(states, 2)


def test_an_indivisible_moe_model_is_refused_before_any_process_starts(tmp_path):
    moe = make_tiny_model(str(tmp_path / "n"), "qwen3_next", seed=1, moe_intermediate_size=15)
    with pytest.raises(ValueError, match="tp_size=2 must divide the model's moe_intermediate_size=15"):
        LLM(moe, device="cpu", tp_size=2)
    import torch.distributed as dist

    assert not dist.is_initialized()


def test_a_follower_that_dies_while_building_is_named(models, monkeypatch):
    """Rank 0 only sees its collective break (gloo: connection closed); the error names the rank that exited and its
    code, and the group is left so another engine can start."""
    import torch.distributed as dist

    import hyperdraft.engine.engine as engine_module
    from helpers.tp_faults import follow_then_exit

    monkeypatch.setattr(engine_module, "follow", follow_then_exit)
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 exited \(code 3\) while building its engine"):
        LLM(models["llama"], device="cpu", tp_size=2, dist_timeout=60)
    assert not dist.is_initialized()


def test_followers_see_the_environment_of_their_start(models, monkeypatch):
    """CPU followers fork from a server that started with the first tensor-parallel engine (engine/lockstep.py); a
    variable set after that still reaches the next engine's followers (the follower stand-in exits with code 4
    without it)."""
    import hyperdraft.engine.engine as engine_module
    from helpers.tp_faults import FOLLOWER_MARK, follow_if_marked

    first, _ = _outputs(models["llama"], [[1, 2, 3]], [greedy(4)], tp_size=2)  # the server exists from here on
    monkeypatch.setenv(*FOLLOWER_MARK)
    monkeypatch.setattr(engine_module, "follow", follow_if_marked)
    second, states = _outputs(models["llama"], [[1, 2, 3]], [greedy(4)], tp_size=2)
    assert second == first
    _check_pools_free(states, 2)


def test_an_engine_that_fails_to_build_ends_its_followers(models, tmp_path):
    """The draft path is checked after the follower started: rank 0 ends it and leaves the group, so this process
    can build another tensor-parallel engine."""
    import torch.distributed as dist

    with pytest.raises(ValueError):
        LLM(models["llama"], device="cpu", tp_size=2, speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(tmp_path / "missing"))
    assert not dist.is_initialized()
    got, _ = _outputs(models["llama"], [[1, 2, 3]], [greedy(4)], tp_size=2)
    want, _ = _outputs(models["llama"], [[1, 2, 3]], [greedy(4)])
    assert got == want


_NEXTN3 = dict(speculative_algorithm="NEXTN", speculative_num_steps=3)


@pytest.mark.parametrize("model,spec", [("qwen3_5", {}), ("qwen3_5", _NEXTN3), ("qwen3_5_accepting", _NEXTN3)],
                         ids=["plain", "mtp", "mtp-accepting"])
def test_tp2_hybrid_state_snapshots_equal_tp1(models, model, spec):
    """A hybrid model's prefix cache under TP 2: every rank snapshots its own heads' states (with MTP, also a
    position's K/V and the head's pending hidden state) and restores them on a hit (a shared 36-token prefix: the
    first request computes it, the second cuts its first chunk there, the rest start from the snapshot); outputs
    equal TP 1 and the hits are the same."""
    stem = mixed_prompts(1, seed=8, min_len=36, max_len=36)[0]
    prompts = [stem + tail for tail in mixed_prompts(5, seed=9, min_len=3, max_len=9)]
    params = greedy(6)
    runs = []
    for tp_size in (1, 2):
        llm = LLM(models[model], device="cpu", dtype="float32", tp_size=tp_size, dist_timeout=120, **spec)
        try:
            outs = llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
            runs.append([(o.token_ids, o.meta_info["cached_tokens"], o.meta_info.get("spec_accepted_tokens"))
                         for o in outs])
            states = llm.engine.rank_states()
            assert_engine_clean(llm)
        finally:
            llm.shutdown()
    assert runs[1] == runs[0]
    assert [cached for _, cached, _ in runs[1]][2:] == [36] * 3  # (MTP: 35 tokens of pages + the snapshot's one)
    if model == "qwen3_5_accepting":  # drafts accepted after the restored snapshots too
        assert sum(bool(accepted) for _, _, accepted in runs[1][2:]) >= 2, runs[1]
    _check_pools_free(states, 2)


def test_the_push_all_reduce_is_chosen_only_where_its_kernel_runs():
    """On by default (RuntimeOptions.push_all_reduce) but only where its kernel can run: one node, more than one rank,
    and on the CPU only under Triton's interpreter; SGLang's --disable-custom-all-reduce and the option turn it off."""
    from hyperdraft.config import EngineArgs, add_engine_args, engine_args_from_namespace
    from hyperdraft.engine.lockstep import push_wanted
    from hyperdraft.options import triton_interpreted

    cpu, on = torch.device("cpu"), RuntimeOptions.from_env({})
    assert on.push_all_reduce and not RuntimeOptions.from_env({"HYPERDRAFT_PUSH_ALL_REDUCE": "0"}).push_all_reduce
    assert push_wanted(EngineArgs(model_path="m", tp_size=2), on, 1, cpu) == triton_interpreted()
    two_nodes = EngineArgs(model_path="m", tp_size=2, nnodes=2, dist_init_addr="10.0.0.1:29500")
    for args in (EngineArgs(model_path="m", tp_size=1), two_nodes,
                 EngineArgs(model_path="m", tp_size=2, disable_custom_all_reduce=True)):
        assert not push_wanted(args, on, 0, cpu), args
    assert not push_wanted(EngineArgs(model_path="m", tp_size=2), RuntimeOptions.from_env(push_all_reduce=False), 0,
                           cpu)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from_namespace(parser.parse_args(["--model", "m", "--disable-custom-all-reduce"])) \
        .disable_custom_all_reduce
