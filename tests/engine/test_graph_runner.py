"""CUDA-graph bookkeeping, tested on CPU through emulation (HYPERDRAFT_EMULATE_CUDA_GRAPH=1).

Emulated graphs keep everything a real graph has except the capture itself: static input buffers sized per shape,
padding up to the next captured batch size, padding rows reset on every replay, and static OUTPUT buffers that
each replay overwrites in place. So a consumer that reads from the wrong path, or keeps a view of a graph output
past the next forward, gives wrong tokens here as it would on a GPU.

Each case runs batches that start above cuda_graph_max_bs (eager) and shrink below it as requests finish (graph
replays at padded sizes), and checks greedy output token for token against plain decoding without graphs.
"""

from __future__ import annotations

import pytest
import torch

from hyperdraft.core.forward_batch import ForwardMode, build_forward_batch, ForwardInput
from hyperdraft.models.decoder import rotated
from hyperdraft.runner.graph_runner import GraphRunner, GraphShape, default_batch_sizes
from hyperdraft.runner.prompt_tails import tail_shapes
from hyperdraft import LLM
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model
from helpers.spec_fixtures import _single_torch_thread, gen, greedy, llm_factory, mixed_prompts, spec_models  # noqa: F401

NEW_TOKENS = [2, 17, 5, 11, 24, 8, 14, 3, 20, 9]  # requests finish at different steps: batch sizes 10 .. 1
_REF: dict = {}

CASES = {
    "plain": {},
    "ngram": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5),
    "standalone-chain": dict(speculative_algorithm="STANDALONE", speculative_num_steps=3, draft="draft_wide_noisy"),
    "standalone-tree": dict(speculative_algorithm="STANDALONE", speculative_num_steps=3, speculative_eagle_topk=2,
                            speculative_num_draft_tokens=6, draft="draft_wide_noisy"),
    "eagle3-chain": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=1, draft="eagle3",
                         target="target6"),
    "eagle3-tree": dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=2,
                        speculative_num_draft_tokens=6, draft="eagle3", target="target6"),
    "adaptive": dict(speculative_algorithm="STANDALONE", speculative_adaptive=True, draft="draft_wide_noisy"),
}

EMULATE_GRAPHS_ENV = "HYPERDRAFT_EMULATE_CUDA_GRAPH"  # a RuntimeOptions override (hyperdraft/options.py)


@pytest.fixture(scope="module")
def models(spec_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("graph_models")
    target6 = make_tiny_model(str(root / "target6"), "llama", num_hidden_layers=6)  # EAGLE-3 reads 3 target layers
    return dict(spec_models, target6=target6, eagle3=write_random_eagle_checkpoint(str(root / "e3"), target6, kind="eagle3"))


@pytest.fixture
def emulated_graphs(monkeypatch):
    monkeypatch.setenv(EMULATE_GRAPHS_ENV, "1")


def _engine_args(models, case: dict, **extra) -> dict:
    args = {k: v for k, v in case.items() if k not in ("draft", "target")}
    if "draft" in case:
        args["speculative_draft_model_path"] = models[case["draft"]]
    return {**args, **extra}


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_graphs_match_eager_and_spec_off(models, llm_factory, emulated_graphs, name, page_size):
    prompts, params = mixed_prompts(len(NEW_TOKENS), seed=31, max_len=60), [greedy(n) for n in NEW_TOKENS]
    target = CASES[name].get("target", "target")
    if target not in _REF:
        _REF[target] = gen(LLM(models[target], device="cpu", dtype="float32"), prompts, params)
    refs = _REF[target]
    llm = llm_factory(models[target], page_size=page_size, cuda_graph_max_bs=4, **_engine_args(models, CASES[name]))
    outs = gen(llm, prompts, params)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.token_ids == r.token_ids, f"{name} request {i}"
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.num_replays > 0, "no forward ran through a graph"
    assert max(graphs.batch_sizes) == 4
    proposer = getattr(llm.engine.worker, "proposer", None)
    draft_runner = getattr(proposer, "runner", None)
    if draft_runner is not None:  # greedy rounds, chains and beams, run as one graph each (tests/test_graph_draft.py)
        assert draft_runner.graphs is not None and proposer.draft_loop is not None
        ran = {k.tier for k, n in proposer.draft_loop.replays.items() if n}
        assert any(tier.is_tree == ("tree" in name) for tier in ran), ran


def test_disable_cuda_graph(models, llm_factory, emulated_graphs):
    llm = llm_factory(models["target"], disable_cuda_graph=True)
    assert llm.engine.runner.graphs is None


def test_without_emulation_cpu_runs_eagerly(models, llm_factory):
    assert llm_factory(models["target"]).engine.runner.graphs is None


def test_verify_graph_buffers_follow_each_tier(models, llm_factory, emulated_graphs):
    # Adaptive (SGLang's default ladder, chains, steps 0 for large batches): one shape per tier, captured only for the
    # batch sizes whose slot can run that tier; the largest shape's buffers exist from the start.
    llm = llm_factory(models["target"], cuda_graph_max_bs=16, max_running_requests=16,
                      **_engine_args(models, CASES["adaptive"]))
    graphs, tiers = llm.engine.runner.graphs, llm.engine.worker.tiers
    expected = {}
    for tier in llm.engine.spec.adaptive.candidate_union():
        sizes = tiers.graph_sizes_for_steps(tier.steps)
        if sizes:  # steps 0 = no speculation: a one-token decode graph
            expected[GraphShape(tier.num_draft_tokens if tier.steps else 1, 0)] = sizes
    expected.update(tail_shapes(graphs.batch_sizes))  # prompt tails beside a round run as their own extend
    assert graphs.sizes == expected
    widest = max(expected, key=lambda s: s.tokens_per_req)
    assert graphs.inputs[widest].input_ids.shape[0] == max(expected[widest]) * widest.tokens_per_req


def test_padding_rows_are_reset_between_replays(models, llm_factory, emulated_graphs):
    """A batch of 4 then a batch of 3 padded to 4: the padding row must write to slot 0 (the padding page), never
    to the slot the previous batch's 4th request used."""
    llm = llm_factory(models["target"], cuda_graph_max_bs=4, max_total_tokens=256)
    engine = llm.engine
    graphs: GraphRunner = engine.runner.graphs
    rows = [engine.page_table.acquire_row() for _ in range(4)]
    try:
        for r in rows:
            assert engine.page_table.reserve(r, 8)
        inputs = [ForwardInput(r, 3, [5], 1) for r in rows]
        four = build_forward_batch(ForwardMode.DECODE, inputs, engine.page_table, engine.device)
        three = build_forward_batch(ForwardMode.DECODE, inputs[:3], engine.page_table, engine.device)
        assert graphs.match(four, ())[1] == 4 and graphs.match(three, ())[1] == 4
        engine.runner.forward(four)
        slot_of_fourth = four.out_slots[3].item()
        before = engine.runner.pool.k[:, slot_of_fourth].clone()
        out = engine.runner.forward(three)
        static = graphs.inputs[GraphShape(1, 0)]
        assert static.out_slots[3].item() == 0 and static.req_rows[3].item() == 0
        assert torch.equal(engine.runner.pool.k[:, slot_of_fourth], before)
        assert out.logits.shape[0] == 3 and out.hidden.shape[0] == 3
    finally:
        for r in rows:
            engine.page_table.release_row(r)


def test_batches_that_do_not_fit_run_eagerly(models, llm_factory, emulated_graphs):
    llm = llm_factory(models["target"], cuda_graph_max_bs=2, max_total_tokens=256)
    engine = llm.engine
    graphs = engine.runner.graphs
    rows = [engine.page_table.acquire_row() for _ in range(3)]
    try:
        for r in rows:
            assert engine.page_table.reserve(r, 8)
        decode3 = build_forward_batch(ForwardMode.DECODE, [ForwardInput(r, 3, [5], 1) for r in rows], engine.page_table,
                                      engine.device)
        ragged = build_forward_batch(ForwardMode.EXTEND, [ForwardInput(rows[0], 0, [1, 2, 3], 1),
                                                          ForwardInput(rows[1], 3, [5], 1)], engine.page_table, engine.device)
        assert graphs.match(decode3, ()) is None  # above the largest captured size
        assert graphs.match(ragged, ()) is None  # a prefill chunk beside a decode
        assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
        assert default_batch_sizes(256)[-6:] == [176, 192, 208, 224, 240, 256] and 128 in default_batch_sizes(256)
    finally:
        for r in rows:
            engine.page_table.release_row(r)


def test_segment_cuts_and_after_layer_hook(tmp_path):
    """Graph segments cut at layer boundaries: the cut points, and a layer hook that sees every layer once and
    leaves the forward's outputs unchanged (what segmented capture relies on)."""
    from hyperdraft.runner.graph_runner import segment_cuts
    from hyperdraft.models.loader import load_model
    from hyperdraft.testing.tiny import make_tiny_model

    assert segment_cuts(32) == (2, 8) and segment_cuts(2) == (1,) and segment_cuts(1) == () and segment_cuts(12) == (1, 3)
    model = load_model(make_tiny_model(str(tmp_path / "m"), "llama", with_tokenizer=False, num_hidden_layers=3),
                       "float32", torch.device("cpu"))
    ids, pos = torch.randint(0, model.config.vocab_size, (5,)), torch.arange(5)

    def causal(_layer, q, k, v, rope=None):
        q, k = rotated(q, k, rope)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1)
        scores = (q.transpose(0, 1) @ k.transpose(1, 2)).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -1e30)
        return (scores.softmax(-1) @ v).transpose(0, 1)

    with torch.inference_mode():
        plain, _ = model(ids, pos, causal, ())
        seen = []
        hooked, _ = model(ids, pos, causal, (), after_layer=seen.append)
    assert seen == [1, 2, 3]
    assert torch.equal(plain, hooked)


@pytest.mark.parametrize("max_total_tokens", [None, 200])
def test_decode_ahead_changes_nothing(models, llm_factory, emulated_graphs, monkeypatch, max_total_tokens):
    """Decode-ahead (engine/model_worker.py): an all-decode step queues the next step's decode before it waits for
    its results. Requests finishing early (EOS or a stop token: not known ahead), sampled ones (seeded: positions
    must advance), penalised ones (the queued step's counts include the token just sampled), prefill chunks joining,
    an abort between two steps and, with a small pool, retractions all make the next batch differ from the queued one. Tokens equal those of decode-ahead off and of no graphs at all, and
    the pool ends empty (llm_factory checks)."""
    from hyperdraft import SamplingParams

    prompts = mixed_prompts(8, seed=5, max_len=40)
    penalties = {2: dict(frequency_penalty=0.7), 5: dict(presence_penalty=0.5, repetition_penalty=1.3)}
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_new_tokens=30, ignore_eos=i < 2,
                             stop_token_ids=[7, 11] if i == 3 else None, **penalties.get(i, {})) for i in range(8)]

    def run(ahead: str, graphs: bool = True, moved: str = "1"):
        monkeypatch.setenv("HYPERDRAFT_DECODE_AHEAD", ahead)
        monkeypatch.setenv("HYPERDRAFT_MOVE_AHEAD_BATCH", moved)
        if not graphs:
            monkeypatch.delenv(EMULATE_GRAPHS_ENV)
        llm = llm_factory(models["target"], cuda_graph_max_bs=8, chunked_prefill_size=24, max_total_tokens=max_total_tokens)
        engine = llm.engine
        reqs = [engine.add_request(input_ids=p, params=sp) for p, sp in zip(prompts[:6], params[:6])]
        step = 0
        while engine.has_unfinished():
            engine.step()
            step += 1
            if step == 4:  # joins running decodes as prefill chunks
                reqs += [engine.add_request(input_ids=p, params=sp) for p, sp in zip(prompts[6:], params[6:])]
            if step == 9:  # between two steps, as a server's disconnect would
                engine.abort(reqs[1].rid)
        return engine, [r.output_ids for r in reqs], sum(r.num_retractions for r in reqs)

    engine, outs, retractions = run("1")
    worker = engine.worker
    assert worker.ahead_used > 10 and worker.ahead_discarded > 0
    assert worker.ahead_moved == worker.ahead_used + worker.ahead_discarded + (worker.ahead is not None)  # all moved
    assert (retractions > 0) == (max_total_tokens is not None)
    assert run("0")[1] == outs
    host_packed, host_outs, _ = run("1", moved="0")
    assert host_packed.worker.ahead_moved == 0 and host_outs == outs
    assert run("1", graphs=False)[1] == outs


def test_graph_bound_follows_free_memory():
    """Without --cuda-graph-max-bs a GPU captures up to 256 rows, fewer when the largest graph's activations would
    take more than half the free memory; a verify's rows per request count."""
    from hyperdraft.runner.graph_runner import MAX_GRAPH_BS, activation_row_bytes, graph_max_bs

    row = activation_row_bytes(576, 1536, 49152, 2)  # SmolLM2 in bf16: about 0.3 MB a row, the logits mostly
    assert 250_000 < row < 400_000
    assert graph_max_bs(8 << 30, row, 1) == MAX_GRAPH_BS
    assert graph_max_bs(8 << 30, row, 8) == MAX_GRAPH_BS
    assert graph_max_bs(256 << 20, row, 8) == (128 << 20) // (8 * row) < 64
    assert graph_max_bs(0, row, 1) == 1


@pytest.mark.parametrize("page_size", [1, 4])
def test_prompt_tails_replay_captured_extends(models, llm_factory, emulated_graphs, page_size):
    """Prompts that arrive a few at a time, then second turns over their cached first turns: each prompt's last
    chunk (one logit) runs a captured extend, padded to its width with tokens past the prompt. Greedy outputs equal
    an engine without graphs or cache, token for token, and the pool ends free (llm_factory checks)."""
    first = mixed_prompts(5, seed=8, min_len=3, max_len=90)
    llm = llm_factory(models["target"], page_size=page_size, cuda_graph_max_bs=4)
    ref = LLM(models["target"], device="cpu", dtype="float32", page_size=page_size, disable_radix_cache=True)
    outs = [gen(llm, [p], [greedy(9)])[0].token_ids for p in first[:3]] + [
        o.token_ids for o in gen(llm, first[3:], [greedy(9)] * 2)]
    assert outs == [o.token_ids for o in gen(ref, first, [greedy(9)] * 5)]
    second = [p + o + [7, 11, 13][: 1 + i % 3] for i, (p, o) in enumerate(zip(first, outs))]  # turn 2 over turn 1
    params = [greedy(n) for n in (6, 10, 4, 8, 12)]
    assert [o.token_ids for o in gen(llm, second, params)] == [o.token_ids for o in gen(ref, second, params)]
    graphs = llm.engine.runner.graphs
    tails = {key: n for key, n in graphs.replays.items() if key[0].one_logit}
    assert sum(tails.values()) >= 3, f"no prompt tail replayed a captured extend: {dict(graphs.replays)}"
    assert {key[0].tokens_per_req for key in tails} >= {16}, tails


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("name", ["ngram", "standalone-chain", "eagle3-chain", "eagle3-tree"])
def test_prompt_tails_beside_a_round_run_as_their_own_forward(models, llm_factory, emulated_graphs, monkeypatch, name,
                                                             page_size):
    """Four requests run at a time, so every later prompt is admitted while others speculate, two at once where two
    requests finish together: their prefills,
    instead of riding along with the verify (an eager forward), replay a captured prompt-tail extend of their own,
    and the drafter extends over its real rows. Greedy outputs equal plain decoding without graphs, token for
    token; an EAGLE head is handed, for every prefill chunk, the target hidden rows the same speculation hands it
    without graphs (padding rows left out); the pool ends free (llm_factory checks)."""
    handed = _record_prefill_hidden(monkeypatch)
    prompts, params = mixed_prompts(8, seed=5, min_len=3, max_len=100), [greedy(n) for n in (4, 4, 30, 30, 7, 7, 9, 3)]
    target = CASES[name].get("target", "target")
    ref = LLM(models[target], device="cpu", dtype="float32", disable_cuda_graph=True, disable_radix_cache=True)
    llm = llm_factory(models[target], page_size=page_size, cuda_graph_max_bs=4, max_running_requests=4,
                      **_engine_args(models, CASES[name]))
    assert [o.token_ids for o in gen(llm, prompts, params)] == [o.token_ids for o in gen(ref, prompts, params)]
    if name.startswith("eagle3"):
        with_graphs = dict(handed)
        handed.clear()
        eager = llm_factory(models[target], page_size=page_size, disable_cuda_graph=True, max_running_requests=4,
                            **_engine_args(models, CASES[name]))
        gen(eager, prompts, params)
        assert with_graphs.keys() == handed.keys() and len(handed) >= len(prompts)
        for chunk, rows in with_graphs.items():  # fp32 summation order differs with the batch: ~1e-5
            assert rows.shape == handed[chunk].shape and torch.allclose(rows, handed[chunk], atol=2e-3, rtol=1e-4)
    graphs = llm.engine.runner.graphs
    tails = {key: n for key, n in graphs.replays.items() if key[0].one_logit}
    assert sum(tails.values()) >= 2, f"no prompt tail beside a round replayed its extend: {dict(graphs.replays)}"
    if name.startswith("eagle3"):  # a random head accepts nothing: requests 0 and 1 finish together
        assert any(bs >= 2 for _, bs in tails), tails
    assert {key[0].tokens_per_req for key in tails} >= {128}, tails  # the 100-token prompt, padded to 128


@pytest.mark.parametrize("name", ["ngram", "eagle3-chain"])
def test_prompt_tails_alone_in_a_speculative_step_replay_their_extend(models, llm_factory, emulated_graphs,
                                                                      monkeypatch, name):
    """One request at a time, as a chat at batch 1: each prompt arrives with nothing running, and its prefill replays
    a captured prompt-tail extend instead of an eager forward. Greedy outputs equal plain decoding without graphs,
    and an EAGLE head is handed the hidden rows it is handed without graphs."""
    handed = _record_prefill_hidden(monkeypatch)
    prompts = mixed_prompts(4, seed=9, min_len=5, max_len=120)
    target = CASES[name].get("target", "target")
    ref = LLM(models[target], device="cpu", dtype="float32", disable_cuda_graph=True, disable_radix_cache=True)
    llm = llm_factory(models[target], cuda_graph_max_bs=4, **_engine_args(models, CASES[name]))
    for p in prompts:
        assert gen(llm, [p], [greedy(6)])[0].token_ids == gen(ref, [p], [greedy(6)])[0].token_ids
    tails = sum(n for key, n in llm.engine.runner.graphs.replays.items() if key[0].one_logit)
    assert tails >= len(prompts), f"prompts alone did not replay a captured extend: {tails}"
    if name.startswith("eagle3"):
        with_graphs = dict(handed)
        handed.clear()
        eager = llm_factory(models[target], disable_cuda_graph=True, **_engine_args(models, CASES[name]))
        for p in prompts:
            gen(eager, [p], [greedy(6)])
        assert with_graphs.keys() == handed.keys()
        for chunk, rows in with_graphs.items():
            assert torch.allclose(rows, handed[chunk], atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("page_size", [1, 4])
def test_prompt_tails_beside_plain_decodes_run_as_their_own_forward(models, llm_factory, emulated_graphs, page_size):
    """Plain decoding, six requests at a time (more than a captured prompt-tail batch holds): a prompt admitted while
    others decode runs as a captured prompt-tail extend of its own beside the decodes' graph, instead of one eager
    forward of the whole batch. Greedy outputs equal an engine without graphs, token for token."""
    prompts = mixed_prompts(10, seed=6, min_len=3, max_len=100)
    params = [greedy(n) for n in (4, 9, 30, 30, 25, 20, 7, 2, 9, 3)]
    ref = LLM(models["target"], device="cpu", dtype="float32", disable_cuda_graph=True, disable_radix_cache=True)
    llm = llm_factory(models["target"], page_size=page_size, cuda_graph_max_bs=8, max_running_requests=6)
    assert [o.token_ids for o in gen(llm, prompts, params)] == [o.token_ids for o in gen(ref, prompts, params)]
    graphs = llm.engine.runner.graphs
    tails = sum(n for key, n in graphs.replays.items() if key[0].one_logit)
    assert tails >= 3, f"no prompt tail beside decodes replayed its extend: {dict(graphs.replays)}"


def _record_prefill_hidden(monkeypatch) -> dict[tuple, torch.Tensor]:
    """Spy on EagleProposer.extend -> {a prefill chunk's tokens: the target hidden rows it was handed}."""
    from hyperdraft.speculative.proposers.eagle import EagleProposer

    handed: dict[tuple, torch.Tensor] = {}
    original = EagleProposer.extend

    def spy(self, items, target_hidden):
        start = 0
        for it in items:
            s = it.req.num_computed
            handed[tuple(it.req.token_ids(0, s + it.num_tokens))] = target_hidden[start : start + it.num_tokens].clone()
            start += it.num_tokens
        return original(self, items, target_hidden)

    monkeypatch.setattr(EagleProposer, "extend", spy)
    return handed


def test_prompt_tails_near_the_context_end_run_eagerly(models, llm_factory, emulated_graphs):
    """A prompt whose padded tail would pass the end of its row's page-table entries is not padded: it runs eagerly,
    and its output still equals an engine without graphs."""
    prompt = mixed_prompts(1, seed=2, min_len=36, max_len=36)
    llm = llm_factory(models["target"], cuda_graph_max_bs=4, context_length=48)
    room = llm.engine.page_table.max_pages_per_row * llm.engine.page_table.page_size
    assert room < 64  # the 36-token prompt would be padded to 64
    ref = LLM(models["target"], device="cpu", dtype="float32", context_length=48, disable_cuda_graph=True)
    assert [o.token_ids for o in gen(llm, prompt, [greedy(8)])] == [o.token_ids for o in gen(ref, prompt, [greedy(8)])]
    assert not any(key[0].one_logit for key in llm.engine.runner.graphs.replays)


def test_closing_an_engine_destroys_its_graphs(models, llm_factory, emulated_graphs):
    """Engine.close() releases the target's graphs and the drafter's step and round graphs (graphs that captured NCCL
    collectives must go before their process group); anything run after it is eager and unchanged."""
    prompts, params = mixed_prompts(3, seed=8, max_len=30), [greedy(10) for _ in range(3)]
    llm = llm_factory(models["target6"], cuda_graph_max_bs=4, **_engine_args(models, CASES["eagle3-chain"]))
    before = gen(llm, prompts, params)
    engine = llm.engine
    proposer = engine.worker.proposer
    replays = (engine.runner.graphs.num_replays, proposer.runner.graphs.num_replays, proposer.draft_loop.num_replays)
    assert replays[0] and replays[2], replays  # greedy rounds run as whole-round graphs, not per-step ones
    engine.close()
    for graphs in (engine.runner.graphs, proposer.runner.graphs, proposer.draft_loop):
        assert not graphs.outputs and not graphs.graphs
    assert [o.token_ids for o in gen(llm, prompts, params)] == [o.token_ids for o in before]
    assert (engine.runner.graphs.num_replays, proposer.runner.graphs.num_replays,
            proposer.draft_loop.num_replays) == replays


@pytest.mark.parametrize("name", ["plain", "eagle3-tree", "adaptive"])
def test_sglang_cuda_graph_bs_captures_exactly_its_sizes(models, llm_factory, emulated_graphs, name):
    """--cuda-graph-bs 2 3 6 (SGLang's explicit list, without 1): batches of 1 pad to 2, of 4 and 5 to 6, and past 6
    run eagerly; outputs stay plain decoding's."""
    prompts, params = mixed_prompts(len(NEW_TOKENS), seed=31, max_len=60), [greedy(n) for n in NEW_TOKENS]
    target = CASES[name].get("target", "target")
    if target not in _REF:
        _REF[target] = gen(LLM(models[target], device="cpu", dtype="float32"), prompts, params)
    llm = llm_factory(models[target], cuda_graph_bs=[6, 2, 3], **_engine_args(models, CASES[name]))
    outs = gen(llm, prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in _REF[target]]
    graphs = llm.engine.runner.graphs
    assert tuple(graphs.batch_sizes) == (2, 3, 6) and graphs.num_replays > 0
    assert llm.get_server_info()["cuda_graph_bs"] == (2, 3, 6)


def test_cuda_graph_bs_errors_name_the_field():
    from hyperdraft.config import EngineArgs

    for sizes in ([], [0, 4], "8", [2.5]):
        with pytest.raises(ValueError, match=r"^cuda_graph_bs must be a non-empty list of integers >= 1"):
            EngineArgs(cuda_graph_bs=sizes)
    with pytest.raises(ValueError, match=r"cuda_graph_max_bs=8 and cuda_graph_bs=\[2, 4\] disagree"):
        EngineArgs(cuda_graph_bs=[4, 2], cuda_graph_max_bs=8)
    assert EngineArgs(cuda_graph_bs=[4, 2, 4], cuda_graph_max_bs=4).cuda_graph_bs == (2, 4)
