"""Speculation on hybrid targets: a verify's per-token states go to scratch, and only the state after the last
accepted token is committed. Every accept length (0 .. K), tree paths through later siblings, NGRAM, a dense
STANDALONE draft, adaptive tier switches and concurrent requests finishing at different times all leave greedy output
equal to speculation off; the scratch is sized for the widest tier."""

from __future__ import annotations

import pytest

from hyperdraft import SamplingParams
from hyperdraft.speculative.proposers import PROPOSERS
from helpers.hybrid_fixtures import Oracle, OracleChain, OracleTree, hybrid_models  # noqa: F401
from helpers.spec_fixtures import _single_torch_thread, gen, greedy, llm_factory, mixed_prompts, spec_state  # noqa: F401

NEW_TOKENS = [18, 7, 25, 12, 3, 20, 9, 14, 16]  # requests finish at different steps


def _prompts():
    return mixed_prompts(len(NEW_TOKENS), seed=21, max_len=40)


@pytest.fixture(scope="module")
def reference(hybrid_models):
    """Spec-off greedy outputs per prompt, once per module."""
    from hyperdraft import LLM

    llm = LLM(hybrid_models["target"], device="cpu", dtype="float32", max_running_requests=16)
    prompts = _prompts()
    outs = gen(llm, prompts, [greedy(n) for n in NEW_TOKENS])
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs)}


def _run(llm):
    return [o.token_ids for o in gen(llm, _prompts(), [greedy(n) for n in NEW_TOKENS])]


@pytest.mark.parametrize("page_size", [1, 4])
def test_oracle_chain_every_accept_length(hybrid_models, llm_factory, reference, monkeypatch, page_size):
    monkeypatch.setitem(PROPOSERS, "NGRAM", OracleChain)
    Oracle.reset(reference, seed=page_size)
    llm = llm_factory(hybrid_models["target"], speculative_algorithm="NGRAM", speculative_num_steps=4,
                      page_size=page_size, max_running_requests=16, chunked_prefill_size=16)
    assert _run(llm) == [reference[tuple(p)] for p in _prompts()]
    hist = spec_state(llm)["spec_accept_length_histogram"]
    assert all(hist[length] > 0 for length in range(1, 6)), hist  # 0 .. 4 drafts accepted, each at least once


@pytest.mark.parametrize("page_size", [1, 4])
def test_oracle_tree_paths_through_later_siblings(hybrid_models, llm_factory, reference, monkeypatch, page_size):
    monkeypatch.setitem(PROPOSERS, "STANDALONE", OracleTree)
    Oracle.reset(reference, seed=10 + page_size)
    llm = llm_factory(hybrid_models["target"], speculative_algorithm="STANDALONE", page_size=page_size,
                      speculative_draft_model_path=hybrid_models["target"], speculative_num_steps=3,
                      speculative_eagle_topk=2, speculative_num_draft_tokens=7, max_running_requests=16)
    assert _run(llm) == [reference[tuple(p)] for p in _prompts()]
    hist = spec_state(llm)["spec_accept_length_histogram"]
    assert all(hist[length] > 0 for length in range(1, 5)), hist


def test_ngram_and_a_dense_draft(hybrid_models, llm_factory, reference):
    want = [reference[tuple(p)] for p in _prompts()]
    ngram = llm_factory(hybrid_models["target"], speculative_algorithm="NGRAM", speculative_num_steps=3,
                        max_running_requests=16)
    assert _run(ngram) == want
    dense = llm_factory(hybrid_models["target"], speculative_algorithm="STANDALONE", max_running_requests=16,
                        speculative_draft_model_path=hybrid_models["dense_draft"], speculative_num_steps=3,
                        speculative_eagle_topk=2, speculative_num_draft_tokens=5)
    assert _run(dense) == want


def test_adaptive_tiers_switch_both_ways_and_the_scratch_fits_the_widest(hybrid_models, llm_factory, reference,
                                                                         monkeypatch, tmp_path):
    """Tiers 1, 3 and 6 with the oracle, whose drafts are all right for a while (the controller rises to 6), then all
    wrong (it drops to 1): the scratch is as wide as tier 6's verify (7 tokens), not the initial tier's (seed 000's
    third bug), and the output stays that of speculation off."""
    import json

    monkeypatch.setitem(PROPOSERS, "NGRAM", OracleChain)
    Oracle.reset(reference, seed=3, phases=[(12, "right"), (1000, "wrong")])
    cfg = tmp_path / "adaptive.json"
    cfg.write_text(json.dumps({"ema_alpha": 0.5, "warmup_batches": 1, "update_interval": 1,
                               "1": {"candidate_steps": [1, 3, 6]}}))
    llm = llm_factory(hybrid_models["target"], speculative_algorithm="NGRAM", speculative_adaptive=True,
                      speculative_adaptive_config=str(cfg), speculative_num_steps=3, max_running_requests=1)
    assert llm.engine.runner.state_pool.verify_width == 7
    outs = [o.token_ids for o in gen(llm, _prompts()[:3], [greedy(40)] * 3)]
    ref_llm = llm_factory(hybrid_models["target"], max_running_requests=16)
    assert outs == [o.token_ids for o in gen(ref_llm, _prompts()[:3], [greedy(40)] * 3)]
    tiers = spec_state(llm)["spec_steps_per_tier"]
    assert len(tiers) == 3 and spec_state(llm)["spec_tier_switches"] >= 2, tiers


def test_sampled_requests_stay_reproducible(hybrid_models, llm_factory):
    """Seeded sampling through a hybrid verify: the same seed, with or without speculation, in any batch, draws the
    same tokens (each token's draw is keyed by (seed, position), and the state behind it is the committed one)."""
    prompts = mixed_prompts(4, seed=8, max_len=30)
    params = [SamplingParams(temperature=0.9, seed=i, max_new_tokens=15, ignore_eos=True) for i in range(4)]
    off = [o.token_ids for o in gen(llm_factory(hybrid_models["target"]), prompts, params)]
    ngram = llm_factory(hybrid_models["target"], speculative_algorithm="NGRAM", speculative_num_steps=3)
    assert [o.token_ids for o in gen(ngram, prompts, params)] == off


def test_emulated_graphs_of_a_hybrid_target_leave_output_unchanged(hybrid_models, llm_factory, reference):
    """Emulated graphs (CPU): each replay plans the state walk again from the refilled static buffers, as the Triton
    backend does inside a real graph; verify and decode graphs of a hybrid target ran, and speculation stays
    lossless. (A real capture with the torch state backend would freeze its host-side plan: CUDA without fused
    kernels runs hybrids eagerly.)"""
    from hyperdraft.options import RuntimeOptions

    llm = llm_factory(hybrid_models["target"], speculative_algorithm="NGRAM", speculative_num_steps=3,
                      max_running_requests=16, runtime_options=RuntimeOptions(emulate_cuda_graphs=True))
    assert _run(llm) == [reference[tuple(p)] for p in _prompts()]
    assert llm.engine.runner.graphs.num_replays > 0


@pytest.mark.parametrize("max_total_tokens", [None, 1097])  # ~200 K/V tokens after the states
def test_decode_ahead_on_a_hybrid_target_changes_nothing(hybrid_models, llm_factory, max_total_tokens):
    """A plain decode queued ahead (engine/model_worker.py) writes each request's state to the location it is not in
    (slot or scratch entry 0) and reads the one it is in, so a queued decode thrown away leaves every state as it
    was. Requests finishing early (stop tokens), seeded sampling, prefill chunks joining, an abort between two steps
    and, with a small pool, retractions make the next batch differ from the queued one; tokens equal decode-ahead
    off and no graphs at all, and states really did sit in scratch between steps."""
    from hyperdraft.options import RuntimeOptions

    prompts = mixed_prompts(8, seed=5, max_len=40)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_new_tokens=30, ignore_eos=i < 2,
                             stop_token_ids=[7, 11] if i == 3 else None) for i in range(8)]

    def run(options: RuntimeOptions):
        llm = llm_factory(hybrid_models["target"], cuda_graph_max_bs=8, chunked_prefill_size=24, max_running_requests=8,
                          max_total_tokens=max_total_tokens, runtime_options=options)
        engine, in_scratch = llm.engine, 0
        reqs = [engine.add_request(input_ids=p, params=sp) for p, sp in zip(prompts[:6], params[:6])]
        step = 0
        while engine.has_unfinished():
            engine.step()
            in_scratch += len(engine.worker.state_at)
            step += 1
            if step == 4:  # joins running decodes as prefill chunks
                reqs += [engine.add_request(input_ids=p, params=sp) for p, sp in zip(prompts[6:], params[6:])]
            if step == 9:  # between two steps, as a server's disconnect would
                engine.abort(reqs[1].rid)
        return engine, [r.output_ids for r in reqs], sum(r.num_retractions for r in reqs), in_scratch

    engine, outs, retractions, in_scratch = run(RuntimeOptions(emulate_cuda_graphs=True))
    assert engine.worker.ahead_used > 10 and engine.worker.ahead_discarded > 0 and in_scratch > 0
    assert (retractions > 0) == (max_total_tokens is not None)
    assert run(RuntimeOptions(emulate_cuda_graphs=True, decode_ahead=False))[1] == outs
    assert run(RuntimeOptions())[1] == outs


@pytest.mark.parametrize("prompts", [[[1], [11]], [[1, 2, 3], [11], [5]]])
def test_a_one_token_prompt_in_a_reused_state_slot_starts_from_zeros(hybrid_models, llm_factory, prompts):
    """With graphs, a one-token first chunk takes the graph-shaped (speculative) path of the torch state backend,
    which read the slot's states without the first-chunk rule: the request started from what the slot's previous
    occupant left (one running request at a time, so each reuses the slot the one before freed)."""
    from hyperdraft.options import RuntimeOptions

    def run(batch: list[list[int]], options: RuntimeOptions) -> list[list[int]]:
        llm = llm_factory(hybrid_models["target"], max_running_requests=1, runtime_options=options)
        return [o.token_ids for o in gen(llm, batch, [greedy(12)] * len(batch))]

    eager = run(prompts, RuntimeOptions())
    assert run(prompts, RuntimeOptions(emulate_cuda_graphs=True)) == eager
    assert [run([p], RuntimeOptions(emulate_cuda_graphs=True))[0] for p in prompts] == eager


def test_retraction_with_speculation_under_a_small_pool(hybrid_models, llm_factory, reference, monkeypatch):
    """A pool too small for the batch: retracted requests lose their rows and state slots mid-speculation, come back
    and recompute; every accept length keeps occurring and the output stays that of speculation off."""
    monkeypatch.setitem(PROPOSERS, "NGRAM", OracleChain)
    Oracle.reset(reference, seed=5)
    llm = llm_factory(hybrid_models["target"], speculative_algorithm="NGRAM", speculative_num_steps=4,
                      max_running_requests=16, max_total_tokens=4012, page_size=4)  # 84 K/V tokens
    outs = gen(llm, _prompts(), [greedy(n) for n in NEW_TOKENS])
    assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in _prompts()]
    assert sum(o.meta_info["num_retractions"] for o in outs) > 0


def test_eagle3_reads_the_layers_it_names_on_a_hybrid_target(hybrid_models, llm_factory, tmp_path, reference):
    """An EAGLE-3 head over the 8-layer hybrid target captures the aux states of the layers its config names (linear
    and full-attention layers alike) and stays lossless."""
    from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint

    head = write_random_eagle_checkpoint(str(tmp_path / "e3"), hybrid_models["target8"], kind="eagle3",
                                         eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 6]})
    prompts = _prompts()
    params = [greedy(n) for n in NEW_TOKENS]
    ref = [o.token_ids for o in gen(llm_factory(hybrid_models["target8"], max_running_requests=16), prompts, params)]
    llm = llm_factory(hybrid_models["target8"], speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                      speculative_num_steps=3, max_running_requests=16)
    assert llm.engine.worker.capabilities.capture_layers == (2, 4, 7)
    assert [o.token_ids for o in gen(llm, prompts, params)] == ref


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_hybrid_self_draft_is_accepted_whole(hybrid_models, llm_factory, reference, tree):
    """STANDALONE with the target itself as draft: its draft steps' states go to its own scratch, and after each
    verify only the state after its last accepted node is committed. Every greedy draft is then the target's own
    next token, so (almost) everything is accepted; a draft state left ahead or behind would show at once."""
    shape = dict(speculative_eagle_topk=2, speculative_num_draft_tokens=6) if tree else {}
    llm = llm_factory(hybrid_models["target"], speculative_algorithm="STANDALONE", speculative_num_steps=4,
                      speculative_draft_model_path=hybrid_models["target"], max_running_requests=16, **shape)
    assert llm.engine.worker.proposer.capabilities.recurrent_state
    assert _run(llm) == [reference[tuple(p)] for p in _prompts()]
    by_position = spec_state(llm)["spec_acceptance_by_position"]
    # A chain drafts the target's own greedy tokens. A 6-node beam keeps depth 1 and 2 of the greedy path (deeper
    # nodes lose to shallower siblings by cumulative score on a random model), each always accepted.
    assert all(rate > 0.95 for rate in (by_position[:2] if tree else by_position)), by_position


def test_a_different_hybrid_draft_is_lossless(hybrid_models, llm_factory, reference):
    llm = llm_factory(hybrid_models["target"], speculative_algorithm="STANDALONE", speculative_num_steps=3,
                      speculative_draft_model_path=hybrid_models["target8"], max_running_requests=16,
                      speculative_eagle_topk=2, speculative_num_draft_tokens=5)
    assert _run(llm) == [reference[tuple(p)] for p in _prompts()]
