"""Wide trees crossed with the five seed classes (/work/shared/seeds/): greedy output with speculation equals plain
decoding's, token for token, and the KV pool ends fully free (llm_factory), when

- a hybrid target (Qwen3.5, Qwen3-Next) drafts with its own MTP module through an adaptive ladder whose tiers are
  topk-8 trees (16 and 32 nodes) and chains (seed 000), keyed by batch size (seed 001), at page_size 4 (seed 002),
  under emulated CUDA graphs captured up to a batch of 2 below a batch of 6: rounds start eager and shrink into the
  graphs (seed 003), with the prefix cache on and a second pass served from it;
- a STANDALONE draft whose hidden size, layer count, head counts (and, for one, head_dim) differ from the target's
  (seed 004) runs the same kind of ladder, at page_size 4 and 16;
- an EAGLE-3 head with its own draft vocabulary does the same.

Every engine's per-request K/V reservation (decode_reserve), a hybrid model's verify scratch and an EAGLE head's
pending-hidden buffer are sized from the widest tier of the whole ladder, not from the tier the engine starts at.
"""

from __future__ import annotations

import json

import pytest

from hyperdraft import LLM
from hyperdraft.llm import meta_info
from hyperdraft.speculative.adaptive.tier import Tier
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model
from helpers.hybrid_fixtures import near_bigram_with_mtp
from helpers.spec_fixtures import (_single_torch_thread, gen, greedy, llm_factory, mixed_prompts,  # noqa: F401
                                   spec_models, spec_state, step_until_done)

EMULATE_GRAPHS_ENV = "HYPERDRAFT_EMULATE_CUDA_GRAPH"  # a RuntimeOptions override (hyperdraft/options.py)
NEW_TOKENS = [40, 1, 9, 30, 3, 12]  # 6 requests finishing at different steps: the batch shrinks 6 -> 1
GRAPH_MAX_BS = 2
EAGLE_VOCAB, DRAFT_VOCAB = 16, 8


def _tier(steps: int, topk: int, n: int) -> dict:
    return {"steps": steps, "topk": topk, "num_draft_tokens": n}


# Slots keyed by batch size (SGLang's adaptive JSON): batches of 1-2 (graphs) pick a 16-node topk-8 tree or a chain,
# batches of 3 and more (eager) a chain, a 32-node topk-8 tree or a 6-deep topk-4 tree. The rise threshold is lowered
# so that tree tiers run despite low acceptance.
LADDER = {"ema_alpha": 0.5, "warmup_batches": 1, "update_interval": 1, "up_hysteresis": -1.0,
          "1": {"candidate_steps": [1, _tier(5, 8, 16)]},
          "3": {"candidate_steps": [2, _tier(3, 8, 32), _tier(6, 4, 16)]}}
LADDER_TIERS = [Tier(1), Tier(5, 8, 16), Tier(2), Tier(3, 8, 32), Tier(6, 4, 16)]


@pytest.fixture(scope="module")
def models(spec_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("wide_seed_combos")
    small = make_tiny_model(str(root / "small"), "llama", num_hidden_layers=6, vocab_size=EAGLE_VOCAB,
                            with_tokenizer=False)
    # head_dim 32 against the target's 16, hidden 48 against 64, 3 layers against 2, 3 heads / 1 KV head against 4 / 2
    odd = make_tiny_model(str(root / "odd"), "qwen3", seed=11, with_tokenizer=False, hidden_size=48,
                          intermediate_size=96, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1,
                          head_dim=32)
    return dict(spec_models, small=small, draft_odd_heads=odd,
                eagle3=write_random_eagle_checkpoint(str(root / "e3"), small, kind="eagle3",
                                                     draft_vocab_size=DRAFT_VOCAB, seed=3),
                qwen3_5=near_bigram_with_mtp("qwen3_5", str(root)),
                qwen3_next=near_bigram_with_mtp("qwen3_next", str(root)))


_REF: dict = {}


def _spec_off(path: str, prompts, params) -> list[list[int]]:
    key = (path, tuple(map(tuple, prompts)))
    if key not in _REF:
        _REF[key] = [o.token_ids for o in gen(LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True),
                                              prompts, params)]
    return _REF[key]


def _run_twice(llm, prompts, params) -> list[list[int]]:
    """The batch, then the same batch again: the second pass starts from the prefix cache (asserted)."""
    first = [o.token_ids for o in gen(llm, prompts, params)]
    again = gen(llm, prompts, params)
    assert sum(o.meta_info["cached_tokens"] for o in again) > 0, "the second pass hit no cached prefix"
    assert [o.token_ids for o in again] == first
    return first


def _assert_ran(llm) -> None:
    """Tree and chain tiers both ran; the target's verify graphs replayed (batches <= GRAPH_MAX_BS) and batches above
    ran eagerly (nothing captured past GRAPH_MAX_BS)."""
    tiers = spec_state(llm)["spec_steps_per_tier"]
    assert any("x8/" in t for t in tiers), tiers
    graphs = llm.engine.worker.runner.graphs
    assert any(n and shape.tokens_per_req > 1 for (shape, _), n in graphs.replays.items()), graphs.replays
    assert max(bs for _, bs in graphs.replays) <= GRAPH_MAX_BS
    loop = llm.engine.worker.proposer.draft_loop  # whole draft rounds as one graph: a topk-8 tree's among them
    assert any(n and key.tier.topk == 8 for key, n in loop.replays.items()), loop.replays


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_hybrid_mtp_wide_adaptive_ladder_graphs_paged_prefix_cache(models, llm_factory, monkeypatch, kind):
    """Seeds 000-003 together on a hybrid target: MTP drafts through topk-8 trees and chains per batch-size slot,
    page_size 4, graphs up to a batch of 2 (6 requests start eager), prefix cache on."""
    prompts, params = mixed_prompts(len(NEW_TOKENS), seed=5, max_len=40), list(map(greedy, NEW_TOKENS))
    want = _spec_off(models[kind], prompts, params)
    monkeypatch.setenv(EMULATE_GRAPHS_ENV, "1")
    llm = llm_factory(models[kind], skip_tokenizer_init=True, page_size=4, chunked_prefill_size=16,
                      max_running_requests=8, cuda_graph_max_bs=GRAPH_MAX_BS, speculative_algorithm="MTP",
                      speculative_adaptive=True, speculative_adaptive_config=json.dumps(LADDER))
    widest = max(t.reserve_tokens for t in LADDER_TIERS)  # 5x8/16: its draft feeds 1 + 4 * 8 = 33 nodes
    assert llm.engine.scheduler.decode_reserve == widest == 33
    assert llm.engine.runner.state_pool.verify_width == 32  # the 3x8/32 tier's verify, not the starting tier's
    assert _run_twice(llm, prompts, params) == want
    _assert_ran(llm)
    state = spec_state(llm)
    assert state["spec_acceptance_by_position"][1] > 0, state  # accepted paths of 2 and more drafts


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("drafter", ["standalone:draft_wide_noisy", "standalone:draft_odd_heads", "eagle3"])
def test_wide_batch_keyed_ladder_with_mismatched_drafters(models, llm_factory, monkeypatch, drafter, page_size):
    """Seeds 001-004 together: a STANDALONE draft shaped unlike the target (hidden size, layers, heads, head_dim), or
    an EAGLE-3 head with its own 8-token draft vocabulary, runs the batch-keyed ladder of topk-8 and topk-4 trees,
    with graphs up to a batch of 2 under batches of 6, at page_size 4 and 16, prefix cache on."""
    if drafter == "eagle3":
        target, draft, vocab, algo = "small", "eagle3", EAGLE_VOCAB, "EAGLE3"
    else:
        target, draft, vocab, algo = "target", drafter.split(":")[1], 384, "STANDALONE"
    prompts, params = mixed_prompts(len(NEW_TOKENS), seed=7, vocab=vocab, max_len=60), list(map(greedy, NEW_TOKENS))
    want = _spec_off(models[target], prompts, params)
    monkeypatch.setenv(EMULATE_GRAPHS_ENV, "1")
    llm = llm_factory(models[target], skip_tokenizer_init=True, page_size=page_size, chunked_prefill_size=16,
                      max_running_requests=8, cuda_graph_max_bs=GRAPH_MAX_BS, speculative_algorithm=algo,
                      speculative_draft_model_path=models[draft], speculative_adaptive=True,
                      speculative_adaptive_config=json.dumps(LADDER))
    assert llm.engine.scheduler.decode_reserve == max(t.reserve_tokens for t in LADDER_TIERS)
    proposer = llm.engine.worker.proposer
    if drafter == "eagle3":  # the pending target states: the target's hidden size, the widest round's length
        assert tuple(proposer.hidden_buf.shape[1:]) == (33 + 1, 64)
    assert _run_twice(llm, prompts, params) == want
    _assert_ran(llm)
    if draft in ("draft_wide_noisy", "eagle3"):  # drafts close to the target: paths of several nodes accepted
        assert spec_state(llm)["spec_acceptance_by_position"][1] > 0, spec_state(llm)


# 10410: ~160 K/V tokens once both models' states (scratch and prefix-cache snapshots) of 8 rows are paid for
@pytest.mark.parametrize("pool", [None, 10410])
def test_hybrid_standalone_draft_wide_ladder(models, llm_factory, monkeypatch, tmp_path, pool):
    """A hybrid STANDALONE draft (Qwen3.5, hidden 96 against the target's 64) over a hybrid target, the batch-keyed
    wide ladder, graphs up to 2, page_size 4: each model's state scratch is sized from the widest tier (the target's
    from the widest verify, the draft's from the farthest node its steps feed), and with a pool too small for the
    batch requests are retracted after a verify and recomputed; outputs stay spec off's."""
    draft = make_tiny_model(str(tmp_path / "hd"), "qwen3_5", seed=12, with_tokenizer=False, hidden_size=96,
                            intermediate_size=160)
    prompts, params = mixed_prompts(len(NEW_TOKENS), seed=9, max_len=40), list(map(greedy, NEW_TOKENS))
    want = _spec_off(models["qwen3_5"], prompts, params)
    monkeypatch.setenv(EMULATE_GRAPHS_ENV, "1")
    llm = llm_factory(models["qwen3_5"], skip_tokenizer_init=True, page_size=4, chunked_prefill_size=16,
                      max_running_requests=8, cuda_graph_max_bs=GRAPH_MAX_BS, speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=draft, speculative_adaptive=True,
                      speculative_adaptive_config=json.dumps(LADDER), max_total_tokens=pool or None)
    engine = llm.engine
    assert engine.runner.state_pool.verify_width == 32
    assert engine.worker.proposer.runner.state_pool.verify_width == engine.scheduler.decode_reserve == 33
    reqs = [engine.add_request(input_ids=p, params=sp) for p, sp in zip(prompts, params)]
    _, retracted = step_until_done(engine, reqs, 4, 3000, check_draft=True)
    assert [r.output_ids for r in reqs] == want
    assert (retracted > 0) == (pool is not None), retracted
    assert any("x8/" in t for t in spec_state(llm)["spec_steps_per_tier"])


# Batches of 1 a 10-deep topk-8 tree (its draft feeds 1 + 9 * 8 = 73 nodes), batches of 2 and more a 100-node tree.
DEEP_LADDER = {"ema_alpha": 0.5, "warmup_batches": 1, "update_interval": 1, "up_hysteresis": -1.0,
               "1": {"candidate_steps": [1, _tier(10, 8, 64)]},
               "2": {"candidate_steps": [2, _tier(4, 8, 100)]}}


def test_hybrid_mtp_deep_ladder_under_a_tight_pool_retracts(models, llm_factory, monkeypatch):
    """MTP on a hybrid target with a ladder of a 10x8/64 and a 4x8/100 tree, graphs up to 2, page_size 4, and ~200
    K/V tokens for 8 requests: requests are retracted after a verify and recomputed, each holds at most the widest
    round's room (100) past its tokens, and outputs stay spec off's."""
    prompts, params = mixed_prompts(8, seed=3, max_len=50), [greedy(n) for n in [30, 2, 17, 25, 5, 40, 11, 20]]
    want = _spec_off(models["qwen3_5"], prompts, params)
    monkeypatch.setenv(EMULATE_GRAPHS_ENV, "1")
    # 15400: ~200 K/V tokens once the states (a 100-wide scratch, prefix-cache snapshots) of 8 rows are paid for
    llm = llm_factory(models["qwen3_5"], skip_tokenizer_init=True, page_size=4, chunked_prefill_size=16,
                      max_running_requests=8, cuda_graph_max_bs=GRAPH_MAX_BS, speculative_algorithm="MTP",
                      speculative_adaptive=True, speculative_adaptive_config=json.dumps(DEEP_LADDER),
                      max_total_tokens=15400)
    engine = llm.engine
    assert engine.scheduler.decode_reserve == engine.runner.state_pool.verify_width == 100
    reqs = [engine.add_request(input_ids=p, params=sp) for p, sp in zip(prompts, params)]
    _, retracted = step_until_done(engine, reqs, 4, 5000, check_draft=True)
    assert [r.output_ids for r in reqs] == want
    assert retracted > 0
    state = spec_state(llm)
    assert {"10x8/64", "4x8/100"} <= set(state["spec_steps_per_tier"]), state
    # the near-bigram checkpoint: paths of several drafts accepted, in retracted requests too
    assert state["spec_acceptance_by_position"][1] > 0, state
    assert any(r.num_retractions and r.spec_accepted_tokens for r in reqs), [meta_info(r) for r in reqs]
