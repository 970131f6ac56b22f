"""Prefix caching through the engine (CPU, fp32): greedy outputs with the cache on equal those with it off, for plain
decoding and every drafter, at page sizes 1 and 4, with real hits (multi-turn, shared and diverging prefixes, n > 1
siblings); every page accounted for after every step; eviction under memory pressure; aborts mid-prefill; retraction.

The drafters run on a 16-token vocabulary, where even random heads get drafts accepted: with the cache on, every
request must draft and accept exactly what it does with the cache off. A drafter reading wrong K/V from a shared page
would draft differently even though verification keeps the output right."""

from __future__ import annotations

import json
import random

import pytest

from hyperdraft import LLM, SamplingParams
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model
from tests.conftest import assert_engine_clean, assert_kv_accounted
from tests.helpers.prefix_cache import (assert_hits_match_cache_off, diverging_waves, make,
                                        record_root_logits, run_checked)

VOCAB = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prefix_cache")
    target = make_tiny_model(str(root / "target"), "llama", num_hidden_layers=4, vocab_size=VOCAB,
                             with_tokenizer=False, eos_token_id=None)
    return {
        "target": target,
        "eagle3": write_random_eagle_checkpoint(str(root / "e3"), target, kind="eagle3", draft_vocab_size=12, seed=3),
        "eagle": write_random_eagle_checkpoint(str(root / "e1"), target, kind="eagle", seed=4),
    }


def drafter_args(models, drafter: str) -> dict:
    steps = dict(speculative_num_steps=3)
    return {
        "plain": {},
        "NGRAM": dict(speculative_algorithm="NGRAM", **steps),
        # the target drafting for itself: every draft is accepted only if its draft K/V (cached or not) is right
        "STANDALONE": dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=models["target"], **steps),
        "STANDALONE-tree": dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=models["target"],
                                speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5),
        "EAGLE": dict(speculative_algorithm="EAGLE", speculative_draft_model_path=models["eagle"], **steps),
        "EAGLE3": dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=models["eagle3"], **steps),
        "EAGLE3-tree": dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=models["eagle3"],
                            speculative_num_steps=3, speculative_eagle_topk=2, speculative_num_draft_tokens=5),
    }[drafter]


def two_turns(llm: LLM, seed: int) -> list[dict]:
    """Turn 1: one prompt. Turn 2, together: its history plus a new message (multi-turn), prefixes of it diverging
    mid-page and at a page boundary, and two identical siblings (n > 1) that extend it."""
    rng = random.Random(seed)
    a = [rng.randrange(VOCAB) for _ in range(37)]
    first = run_checked(llm, [a], 10)
    more = [[rng.randrange(VOCAB) for _ in range(k)] for k in (6, 9, 5, 7)]
    more[3][0] = (a[28] + 1) % VOCAB  # a real divergence right after token 28
    turn2 = [a + first[0]["ids"] + more[0], a[:30] + more[1], a + more[2], a + more[2], a[:28] + more[3]]
    return first + run_checked(llm, turn2, 12)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("drafter", ["plain", "NGRAM", "STANDALONE", "STANDALONE-tree", "EAGLE", "EAGLE3", "EAGLE3-tree"])
def test_cache_on_equals_cache_off(models, drafter, page_size, chunked):
    args = dict(page_size=page_size, chunked_prefill_size=8 if chunked else -1, **drafter_args(models, drafter))
    runs = {}
    for disabled in (True, False):
        llm = make(models["target"], disable_radix_cache=disabled, **args)
        runs[disabled] = two_turns(llm, seed=page_size)
        assert_engine_clean(llm)
    off, on = runs[True], runs[False]
    assert [r["ids"] for r in on] == [r["ids"] for r in off]
    # A model drafter drafts and is accepted exactly as without the cache: its K/V from shared pages is right. (Not
    # comparable: chunked prefills, whose last chunk may be a one-token round, at boundaries that move with a hit;
    # NGRAM, which also searches finished requests, finishing at other steps with the cache.)
    if not chunked and drafter != "NGRAM":
        assert [(r["drafted"], r["accepted"]) for r in on] == [(r["drafted"], r["accepted"]) for r in off]
    assert all(r["cached"] == 0 for r in off)
    assert on[0]["cached"] == 0 and all(r["cached"] > 0 for r in on[1:])
    assert on[1]["cached"] >= 37  # turn 2 reuses turn 1's prompt and answer, not only its prompt
    if drafter == "STANDALONE":
        assert sum(r["accepted"] for r in on) > 0.9 * sum(r["drafted"] for r in on)  # self-drafting: all accepted


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("drafter", ["plain", "STANDALONE"])
def test_eviction_under_memory_pressure(models, drafter, page_size):
    """A pool of 112 tokens, six concurrent requests of 29-41 prompt tokens sharing and diverging prefixes, three
    waves: cached pages are evicted (and requests retracted) to make room, and nothing changes in the outputs."""
    waves = diverging_waves(VOCAB, seed=5)
    roomy = make(models["target"], disable_radix_cache=True, page_size=page_size)
    expected = [[r["ids"] for r in run_checked(roomy, wave, 10)] for wave in waves]
    assert_engine_clean(roomy)
    llm = make(models["target"], max_total_tokens=112, page_size=page_size, chunked_prefill_size=16,
               **drafter_args(models, drafter))
    got = [run_checked(llm, wave, 10) for wave in waves]
    assert [[r["ids"] for r in wave] for wave in got] == expected
    state = llm.engine.cache_state()
    assert state["cache_evicted_tokens"] > 0 and state["cache_hit_tokens"] > 0
    assert_engine_clean(llm)


@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_mid_prefill_leaves_no_referenced_pages(models, page_size):
    """Requests aborted after a cache hit and part of their chunked prefill, or before their first step, release
    their rows and their references; the computed pages of the others stay cached, unreferenced."""
    llm = make(models["target"], page_size=page_size, chunked_prefill_size=8)
    engine = llm.engine
    rng = random.Random(7)
    stem = [rng.randrange(VOCAB) for _ in range(20)]
    run_checked(llm, [stem + [1, 2, 3]], 4)
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    reqs = [engine.add_request(input_ids=stem + [rng.randrange(VOCAB) for _ in range(30)], params=params) for _ in range(3)]
    engine.step()
    assert reqs[0].row is not None and reqs[0].cached_tokens > 0 and reqs[0].num_computed < reqs[0].seq_len - 1
    assert reqs[0].cache_node is not None
    for r in reqs:
        engine.abort(r.rid)
        assert_kv_accounted(engine)
    assert not engine.has_unfinished() and all(r.cache_node is None and r.row is None for r in reqs)
    tree = engine.prefix_cache.tree
    assert engine.page_table.num_private_slots == 0 and tree.evictable_pages == tree.num_pages > 0
    assert_engine_clean(llm)


def test_retracted_request_keeps_its_prefix_cached(models):
    """A pool that cannot hold two long requests decoding: the newer is retracted, its computed pages stay in the
    cache, and its recompute takes them back."""
    llm = make(models["target"], max_total_tokens=96, page_size=4)
    rng = random.Random(9)
    prompts = [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(2)]
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    reqs = [llm.engine.add_request(input_ids=p, params=params) for p in prompts]
    while llm.engine.has_unfinished():
        llm.engine.step()
        assert_kv_accounted(llm.engine)
    assert reqs[1].num_retractions > 0
    ref = make(models["target"], disable_radix_cache=True)
    assert [r.output_ids for r in reqs] == [r["ids"] for r in run_checked(ref, prompts, 30)]
    assert llm.engine.cache_state()["cache_hit_tokens"] == 0  # a recompute is no new lookup...
    assert llm.engine.prefix_cache.tree.num_pages > 0
    assert_engine_clean(ref)
    assert_engine_clean(llm)


def test_flush_cache_refuses_while_requests_run(models):
    llm = make(models["target"], page_size=2)
    run_checked(llm, [list(range(12))], 3)
    assert llm.engine.kv_cached_slots > 0
    req = llm.engine.add_request(input_ids=list(range(12)) + [3, 4], params=SamplingParams(max_new_tokens=2))
    assert not llm.flush_cache()
    while not req.finished:
        llm.engine.step()
    assert llm.flush_cache() and llm.engine.kv_cached_slots == 0
    assert llm.engine.kv_free_slots == llm.engine.kv_capacity_slots


def test_disable_flag(models):
    assert make(models["target"], disable_radix_cache=True).engine.prefix_cache is None
    assert make(models["target"]).engine.prefix_cache is not None
    # (hybrid models: tests/engine/test_prefix_cache_hybrid.py)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("drafter", ["STANDALONE", "EAGLE", "EAGLE3", "EAGLE3-tree"])
def test_drafter_reads_the_same_state_from_shared_pages(models, monkeypatch, drafter, page_size):
    """Every round's root logits of the drafter (its K/V, partly from cached pages, plus the catch-up) equal those of
    the cache-off engine for the same sequence. This is where a page cached with K/V the drafter never wrote, or an
    EAGLE head's K/V at a match's last position computed from a different next token, would show."""
    seen = record_root_logits(monkeypatch)
    args = dict(page_size=page_size, chunked_prefill_size=-1, **drafter_args(models, drafter))
    for disabled in (True, False):
        llm = make(models["target"], disable_radix_cache=disabled, **args)
        two_turns(llm, seed=10 + page_size)
        assert_engine_clean(llm)
    assert sum(hit for hit, _ in seen) >= 8, "too few rounds of requests that hit the cache"
    assert_hits_match_cache_off(seen, min_compared=8)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_burst_sharing_a_prompt_computes_it_once(models, page_size):
    """n > 1 siblings and a shared system prompt arriving together: the first request computes the shared part, the
    rest wait one step for it to be cached instead of all computing it at once."""
    rng = random.Random(3)
    system = [rng.randrange(VOCAB) for _ in range(60)]
    prompts = [system + [1, 2]] * 3 + [system + [rng.randrange(VOCAB) for _ in range(5)] for _ in range(3)]
    on = run_checked(make(models["target"], page_size=page_size), prompts, 6)
    off = run_checked(make(models["target"], page_size=page_size, disable_radix_cache=True), prompts, 6)
    assert [r["ids"] for r in on] == [r["ids"] for r in off]
    assert on[0]["cached"] == 0 and all(r["cached"] >= 56 for r in on[1:])


def test_cli_flag(models, capsys):
    from hyperdraft.cli import main

    base = ["generate", "--model", models["target"], "--device", "cpu", "--dtype", "float32", "--skip-tokenizer-init",
            "--max-new-tokens", "2", "--json"]
    ids = ",".join(str(t % VOCAB) for t in range(40))
    for flag, cached in (("--disable-radix-cache", [0, 0]), ("--no-disable-radix-cache", [0, 38])):
        # the same prompt twice in one run: the second waits a step and takes the first's pages, unless the cache is off
        assert main(base + ["--input-ids", ids, "--input-ids", ids, flag]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [r["meta_info"]["cached_tokens"] for r in rows] == cached


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("drafter", ["plain", "EAGLE3"])
def test_chunked_prefill_saves_only_each_chunks_pages(models, monkeypatch, drafter, page_size):
    """A long prompt prefilled in 16-token chunks: each save after a chunk inserts that chunk's pages below the node
    the previous one locked (it inserted the whole sequence so far from the root: O(prompt) a chunk), and the tree
    ends up as a whole-prompt insert leaves it: a repeat of the prompt hits all of it, outputs as with the cache off."""
    from hyperdraft.kvcache.radix_tree import RadixTree

    inserted = []
    real = RadixTree.insert
    monkeypatch.setattr(RadixTree, "insert", lambda self, keys, pages, below=None: inserted.append(len(keys))
                        or real(self, keys, pages, below))
    rng = random.Random(11)
    prompt = [rng.randrange(VOCAB) for _ in range(203)]
    args = dict(page_size=page_size, chunked_prefill_size=16, **drafter_args(models, drafter))
    llm = make(models["target"], **args)
    first = run_checked(llm, [prompt], 8)
    saves = list(inserted)
    assert len(saves) >= 203 // 16 and max(saves) <= 16 + page_size, saves
    again = run_checked(llm, [prompt], 8)
    assert again[0]["cached"] >= 203 - 16 - page_size and again[0]["ids"] == first[0]["ids"]
    off = run_checked(make(models["target"], disable_radix_cache=True, **args), [prompt], 8)
    assert first[0]["ids"] == off[0]["ids"]
    assert_engine_clean(llm)
