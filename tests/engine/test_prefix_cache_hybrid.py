"""Prefix caching on a hybrid (Gated DeltaNet + attention) model, CPU fp32: the radix tree shares K/V pages, and
state snapshots (kvcache/state_snapshots.py) restore the recurrent state where a hit ends. Greedy outputs with the
cache on equal those with it off, for plain decoding, NGRAM and a dense STANDALONE draft, at page sizes 1 and 4, with
real hits: a second turn over the first turn's history, a burst sharing a system prompt, n > 1 siblings. A snapshot
restored wrong (another request's state, a state one token off, zeros) changes the next tokens of an unsharpened
random model, so equality here is what checks the states."""

from __future__ import annotations

import json
import random

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.kvcache.page_table import PageTable
from hyperdraft.kvcache.prefix_cache import PrefixCache
from hyperdraft.kvcache.radix_tree import RadixTree
from hyperdraft.kvcache.state_pool import StatePool
from hyperdraft.kvcache.state_snapshots import StateSnapshots
from hyperdraft.models.config import LinearAttentionConfig
from hyperdraft.options import RuntimeOptions
from hyperdraft.request import Request
from hyperdraft.testing.tiny import make_tiny_model
from tests.conftest import assert_engine_clean
from tests.helpers.hybrid_fixtures import near_bigram_with_mtp, with_mtp_weights
from tests.helpers.prefix_cache import (assert_hits_match_cache_off, diverging_waves, make,
                                        record_root_logits, run_checked)

VOCAB = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prefix_cache_hybrid")
    target = make_tiny_model(str(root / "target"), "qwen3_5", seed=0, vocab_size=VOCAB, with_tokenizer=False,
                             eos_token_id=None)
    return {"target": target,
            "dense_draft": make_tiny_model(str(root / "draft"), "qwen3", seed=2, vocab_size=VOCAB,
                                           with_tokenizer=False, eos_token_id=None),
            "with_mtp": with_mtp_weights(target, str(root / "with_mtp")),
            # the random MTP head has (almost) every draft rejected; this one has paths of several drafts accepted
            "accepting_mtp": near_bigram_with_mtp("qwen3_5", str(root), vocab_size=VOCAB, eos_token_id=None)}


def drafter_args(models, drafter: str) -> dict:
    return {
        "plain": {},
        "NGRAM": dict(speculative_algorithm="NGRAM", speculative_num_steps=3),
        "STANDALONE": dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=models["dense_draft"],
                           speculative_num_steps=3),
        # the target drafting for itself: its own state is snapshot beside the target's, and every draft is accepted
        # only if the draft's restored state is the one it would have computed
        "STANDALONE-hybrid": dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=models["target"],
                                  speculative_num_steps=3),
    }[drafter]


def conversation(llm: LLM, seed: int) -> list[dict]:
    """Turn 1; then together: turn 2 over its history, a prefix of it that diverges, two identical siblings; then a
    burst of five requests sharing a 40-token system prompt."""
    rng = random.Random(seed)
    a = [rng.randrange(VOCAB) for _ in range(37)]
    first = run_checked(llm, [a], 10)
    more = [[rng.randrange(VOCAB) for _ in range(k)] for k in (6, 9, 5)]
    second = run_checked(llm, [a + first[0]["ids"] + more[0], a[:30] + more[1], a + more[2], a + more[2]], 12)
    system = [rng.randrange(VOCAB) for _ in range(40)]
    burst = run_checked(llm, [system + [rng.randrange(VOCAB) for _ in range(5)] for _ in range(5)], 5)
    return first + second + burst


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("drafter", ["plain", "NGRAM", "STANDALONE", "STANDALONE-hybrid"])
def test_cache_on_equals_cache_off(models, drafter, page_size, chunked):
    args = dict(page_size=page_size, chunked_prefill_size=8 if chunked else -1, **drafter_args(models, drafter))
    runs = {}
    for disabled in (True, False):
        llm = make(models["target"], disable_radix_cache=disabled, **args)
        runs[disabled] = conversation(llm, seed=page_size)
        if not disabled:
            state = llm.engine.cache_state()
        assert_engine_clean(llm)
    off, on = runs[True], runs[False]
    assert [r["ids"] for r in on] == [r["ids"] for r in off]
    assert all(r["cached"] == 0 for r in off)
    assert state["cache_state_snapshots"] > 0
    turn2, burst = on[1], on[5:]
    # The burst: the first computes the system prompt, the second ends its first chunk where the first one's prefix
    # diverges (no snapshot there yet) and snapshots it, the rest start from it.
    assert all(r["cached"] >= 40 - page_size + 1 for r in burst[2:])
    if page_size == 1 and drafter != "STANDALONE-hybrid":  # turn 1 finished at an aligned length: turn 2 starts
        assert turn2["cached"] >= 37 + 9  # after its whole history (a draft model may end a token behind)
        assert on[4]["cached"] >= 37  # the second sibling, from the snapshot at the end of turn 1's prompt
    if drafter == "STANDALONE-hybrid":
        assert sum(r["accepted"] for r in on) > 0.9 * sum(r["drafted"] for r in on)


def test_snapshots_are_reclaimed_least_recently_used_first(models):
    """Two rows, so two snapshots, and a dozen distinct conversations: taking a snapshot reclaims the least recently
    used one (its pages stay cached), and the turn 2 whose snapshot survived still starts after its history."""
    llm = make(models["target"], max_running_requests=2)
    ref = make(models["target"], disable_radix_cache=True, max_running_requests=2)
    rng = random.Random(4)
    firsts = [[rng.randrange(VOCAB) for _ in range(20)] for _ in range(12)]
    on = [run_checked(llm, [p], 4)[0] for p in firsts]
    assert [r["ids"] for r in on] == [r["ids"] for r in (run_checked(ref, [p], 4)[0] for p in firsts)]
    snapshots = llm.engine.prefix_cache.snapshots
    assert snapshots.count == 2 and snapshots.num_free == 0
    held = [n for n in llm.engine.prefix_cache.tree.nodes() if n.snapshot >= 0]
    assert len(held) == 2 and llm.engine.prefix_cache.tree.num_pages >= 12 * 20
    last = firsts[-1] + on[-1]["ids"] + [1, 2, 3]
    stale = firsts[0] + on[0]["ids"] + [1, 2, 3]
    got = run_checked(llm, [last], 5) + run_checked(llm, [stale], 5)
    assert [r["ids"] for r in got] == [r["ids"] for r in run_checked(ref, [last, stale], 5)]
    assert got[0]["cached"] == 23 and got[1]["cached"] == 0
    assert_engine_clean(llm)
    assert_engine_clean(ref)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("drafter", ["plain", "MTP", "MTP-tree", "MTP-tree-accepting"])
def test_eviction_under_memory_pressure(models, eagle3_head, drafter, page_size):
    """Three waves of six requests sharing and diverging prefixes in a tight budget: plain decoding with 600
    tokens' K/V (two rows of state and snapshots, about 300 K/V tokens), an MTP head with 700 and four rows (about
    200 K/V tokens). Evicted nodes give their snapshots back (a head's K/V position and hidden state with them),
    others are restored meanwhile, and outputs do not change."""
    path, spec = (models["target"], {}) if drafter == "plain" else head_args(models, eagle3_head, drafter)
    budget = dict(max_total_tokens=600) if drafter == "plain" else dict(max_total_tokens=700, max_running_requests=4)
    waves = diverging_waves(VOCAB, seed=5)
    roomy = make(path, disable_radix_cache=True, page_size=page_size, **spec)
    expected = [[r["ids"] for r in run_checked(roomy, wave, 16)] for wave in waves]
    llm = make(path, page_size=page_size, chunked_prefill_size=16, **budget, **spec)
    got = [run_checked(llm, wave, 16) for wave in waves]
    assert [[r["ids"] for r in wave] for wave in got] == expected
    state = llm.engine.cache_state()
    assert state["cache_evicted_tokens"] > 0 and state["cache_hit_tokens"] > 0
    if drafter.endswith("-accepting"):
        assert_drafts_accepted([r for wave in got for r in wave])
    assert_engine_clean(roomy)
    assert_engine_clean(llm)


def test_states_left_in_scratch_by_a_decode_queued_ahead_are_snapshot(models):
    """With (emulated) CUDA graphs a plain decode is queued ahead, and a request's committed state may sit in scratch
    entry 0 when it finishes (engine/model_worker.py): the snapshot is taken from there."""
    options = RuntimeOptions(emulate_cuda_graphs=True)
    llm = make(models["target"], cuda_graph_max_bs=4, runtime_options=options)
    ref = make(models["target"], disable_radix_cache=True)
    rng = random.Random(6)
    firsts = [[rng.randrange(VOCAB) for _ in range(30)] for _ in range(3)]
    turn1 = run_checked(llm, firsts, 9)
    assert llm.engine.worker.ahead_used > 0
    seconds = [p + r["ids"] + [5, 6, 7] for p, r in zip(firsts, turn1)]
    got = run_checked(llm, seconds, 8)
    assert [r["ids"] for r in turn1 + got] == [r["ids"] for r in run_checked(ref, firsts + seconds, 9)[:3]
                                                + run_checked(ref, seconds, 8)]
    assert all(r["cached"] == 30 + 8 for r in got)
    assert_engine_clean(llm)
    assert_engine_clean(ref)


@pytest.fixture(scope="module")
def eagle3_head(models) -> str:
    from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint

    return write_random_eagle_checkpoint(models["target"] + "_e3", models["target"], kind="eagle3", seed=3)


def head_args(models, eagle3_head, drafter: str) -> tuple[str, dict]:
    """(model path, engine args) of a head drafter on the hybrid target. The "-accepting" MTP drafters run on the
    near-bigram checkpoint: recurrent states advanced over accepted drafts, snapshots at accepted positions."""
    chain = dict(speculative_algorithm="MTP", speculative_num_steps=3)
    tree = dict(chain, speculative_eagle_topk=2, speculative_num_draft_tokens=5)
    return {
        "MTP": (models["with_mtp"], chain),
        "MTP-tree": (models["with_mtp"], tree),
        "MTP-accepting": (models["accepting_mtp"], chain),
        "MTP-tree-accepting": (models["accepting_mtp"], tree),
        "EAGLE3": (models["target"], dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=eagle3_head,
                                          speculative_num_steps=3)),
    }[drafter]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("drafter", ["MTP", "MTP-tree", "EAGLE3", "MTP-accepting", "MTP-tree-accepting"])
def test_a_head_on_a_hybrid_target_equals_cache_off(models, eagle3_head, drafter, page_size, chunked):
    """An EAGLE or MTP head trails the target by one token: a snapshot keeps the target's state one token past the
    node's end, that token's target K/V and the head's pending hidden state (prefix_cache.py). Restored wrong, the
    head would draft differently; the target's tokens would differ. Drafts and acceptances are compared too where
    prefill chunk boundaries stay put (whole prompts)."""
    path, spec = head_args(models, eagle3_head, drafter)
    args = dict(page_size=page_size, chunked_prefill_size=8 if chunked else -1, **spec)
    runs = {}
    for disabled in (True, False):
        llm = make(path, disable_radix_cache=disabled, **args)
        runs[disabled] = conversation(llm, seed=page_size + 20)
        if not disabled:
            state = llm.engine.cache_state()
        assert_engine_clean(llm)
    off, on = runs[True], runs[False]
    assert [r["ids"] for r in on] == [r["ids"] for r in off]
    assert state["cache_state_snapshots"] > 0 and state["cache_hit_tokens"] > 0
    # the burst: with chunked prefill a third request may be admitted (and cut) before the second has snapshot the
    # shared prefix, so only two are sure to start from it
    assert sum(r["cached"] >= 40 - page_size + 1 for r in on[5:]) >= 2
    if not chunked:
        assert [(r["drafted"], r["accepted"]) for r in on] == [(r["drafted"], r["accepted"]) for r in off]
    if drafter.endswith("-accepting"):
        assert_drafts_accepted(on)
        assert_drafts_accepted(off)


def assert_drafts_accepted(runs: list[dict]) -> None:
    """The accepted path really ran: a good share of the drafts, and several requests with drafts accepted (the
    near-bigram checkpoint accepts 7-20%; the random head about none)."""
    accepted, drafted = sum(r["accepted"] for r in runs), sum(r["drafted"] for r in runs)
    assert accepted >= 0.05 * drafted > 0, (accepted, drafted)
    assert sum(r["accepted"] > 0 for r in runs) >= len(runs) // 2, [r["accepted"] for r in runs]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("drafter", ["MTP", "EAGLE3", "MTP-accepting"])
def test_a_restored_head_drafts_from_the_same_logits(models, eagle3_head, monkeypatch, drafter, page_size):
    """Every round's root logits of the head (its K/V from cached pages, plus the catch-up from the restored hidden
    state) equal those of the cache-off engine for the same sequence: a snapshot's K/V at the wrong slot, a stale
    hidden state or the head started at the wrong position would show here even where the drafts happen to agree."""
    seen = record_root_logits(monkeypatch)
    path, spec = head_args(models, eagle3_head, drafter)
    for disabled in (True, False):
        llm = make(path, disable_radix_cache=disabled, page_size=page_size, chunked_prefill_size=-1, **spec)
        runs = conversation(llm, seed=page_size + 30)
        if drafter.endswith("-accepting"):
            assert_drafts_accepted(runs)
        assert_engine_clean(llm)
    assert_hits_match_cache_off(seen, min_compared=6)


def test_a_request_cut_at_a_snapshot_admits_nobody_behind_it(tmp_path):
    """Found by a fuzzing audit: a cache hit's first chunk ends where the cache wants a state snapshot, mid-prompt,
    with prefill budget left; a request admitted behind it took pages the cut request still needed, and with nothing
    decoding (only decodes retract) both stayed mid-prefill forever: Engine.step() returned [] with work queued."""
    path = make_tiny_model(str(tmp_path / "m"), "qwen3_5", seed=12, vocab_size=40, eos_token_id=4,
                           with_tokenizer=False)
    llm = LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, page_size=2, context_length=40,
              chunked_prefill_size=7, max_total_tokens=334, max_running_requests=2)
    engine = llm.engine
    first = [5, 31, 8, 6, 20, 35, 26, 16, 24, 28, 11, 8, 34, 11, 33, 21, 30, 34, 20, 29, 12, 37, 34, 29, 18, 5, 21, 6,
             15, 9, 15, 33, 17, 26, 29]
    other = [5, 10, 28, 38] * 8 + [33, 30, 6]  # shares no prefix with first
    short = [8, 35, 12, 30, 20, 23, 5, 16, 5]
    reqs = [engine.add_request(input_ids=ids, params=SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True))
            for ids, n in ((first, 3), (short, 3), (first, 5), (other, 13))]
    for _ in range(200):
        if not engine.has_unfinished():
            break
        engine.step()
        assert sum(r.num_uncomputed > 1 for r in engine.scheduler.running) <= 1  # at most one mid-prefill
    assert [r.finish_reason for r in reqs] == ["length"] * 4
    # a request ends where it would outgrow the 36-slot pool: 35-token prompts get 2 tokens
    assert [len(r.output_ids) for r in reqs] == [2, 3, 2, 2]
    assert_engine_clean(llm)


def test_a_head_on_a_hybrid_target_is_never_parked(models, tmp_path):
    """Adaptive step 0 parks a dense target's EAGLE head (park_head on by default), which marks cached pages headless;
    a hybrid target's step 0 stays a round (engine._plain_step_zero), so its cache has no parked heads and no
    headless page, and every hit restores a snapshot at its own end (the cache refuses the pair: see the test below).
    Turn 2 hits turn 1's history, outputs equal the cache-off engine's, and a flush frees every page."""
    ladder = tmp_path / "zero_only.json"
    ladder.write_text(json.dumps({"1": {"candidate_steps": [0]}}))
    spec = dict(speculative_algorithm="MTP", speculative_adaptive=True, speculative_adaptive_config=str(ladder),
                speculative_num_steps=0)
    rng = random.Random(8)
    firsts = [[rng.randrange(VOCAB) for _ in range(21)] for _ in range(3)]
    runs = {}
    for disabled in (True, False):
        llm = make(models["with_mtp"], disable_radix_cache=disabled, page_size=1, **spec)
        turn1 = run_checked(llm, firsts, 8)
        runs[disabled] = turn1 + run_checked(llm, [p + r["ids"] + [1, 2] for p, r in zip(firsts, turn1)], 6)
        if not disabled:
            cache, tiers = llm.engine.prefix_cache, llm.get_server_info()["internal_states"][0]["spec_steps_per_tier"]
            assert cache.parked is None and cache.headless == {} and cache.snapshots is not None
            assert llm.engine.worker.proposer.slot_hidden is None and tiers.get("0", 0) > 5, tiers
        assert_engine_clean(llm)
    assert [r["ids"] for r in runs[False]] == [r["ids"] for r in runs[True]]
    assert all(r["cached"] == 21 + 7 for r in runs[False][3:])  # the whole history but the last token, never fed


# ---- the cache alone: a real tree, page table and snapshots over a one-layer state pool ----------------------------
def _hybrid_cache(page_size: int, lookahead: int = 0, parked=None) -> tuple[PrefixCache, PageTable]:
    tree = RadixTree(page_size)
    table = PageTable(64, page_size, 4, 32, torch.device("cpu"), cache=tree)
    pool = StatePool(LinearAttentionConfig(1, 1, 2, 2, 2, "float32"), 1, 4, torch.float32, torch.device("cpu"))
    snapshots = StateSnapshots([pool], 4, tree, lambda row: -1)
    return PrefixCache(tree, table, lookahead, draft_kv=lookahead > 0, snapshots=snapshots, parked=parked), table


def test_a_hybrid_cache_refuses_parked_heads():
    """A hit walked back to a snapshot and then trimmed to a headless run would restore its node's state past the
    hit's end, or carry no pages at all and leave its node locked for good (attach keeps no lock of a hit without
    pages). The engine never parks a hybrid target's head; the cache refuses the pair outright."""

    class Parked:
        def is_parked(self, req) -> bool:
            return False

    with pytest.raises(AssertionError, match="parked heads on a hybrid target"):
        _hybrid_cache(page_size=1, lookahead=1, parked=Parked())


def test_a_cut_with_nothing_restorable_locks_only_the_root():
    """A match deeper than any snapshot walks back to the root: the Hit has no pages, its lock is the root's, which
    is no reference at all (RadixTree.lock stops at the root). attach keeps nothing, and a flush frees every page."""
    cache, table = _hybrid_cache(page_size=4)
    tree, tokens = cache.tree, list(range(10, 30))
    a = Request("a", tokens[:10], SamplingParams(), seed=0)
    a.row = table.acquire_row()
    assert table.reserve(a.row, 10)
    a.num_computed = a.draft_num_computed = 10
    cache.save(a)  # 8 tokens cached, no snapshot: the state is after 10
    cache.release(a)
    table.release_row(a.row)
    assert tree.num_pages == 2 and all(n.snapshot < 0 for n in tree.nodes())
    b = Request("b", tokens[:10] + [1, 2, 3], SamplingParams(), seed=1)
    hit = cache.match(b)
    assert hit.node is tree.root and (hit.pages, hit.computed, hit.cut) == ([], 0, 8)
    assert tree.root.refs == 1 and tree.evictable_pages == tree.num_pages
    b.row = table.acquire_row()
    cache.attach(b, b.row, hit)
    assert b.cache_node is None and (b.num_computed, b.cached_tokens) == (0, 0)
    table.release_row(b.row)
    assert cache.flush() == 2 and table.num_free_slots == table.capacity_slots
