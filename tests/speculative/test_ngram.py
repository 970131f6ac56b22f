"""NGRAM matching: the vectorised matcher equals a plain-Python prompt lookup; the cross-request history drafts only
when it holds a strictly longer match, never past a sequence boundary, and keeps outputs identical in the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyperdraft import SamplingParams
from hyperdraft.request import Request
from hyperdraft.speculative.adaptive.tier import Tier
import hyperdraft.speculative.proposers.ngram as ngram_module
from hyperdraft.speculative.proposers.ngram import SEPARATOR, NgramHistory, NgramProposer, longest_match, ngram_match

from helpers.spec_fixtures import _single_torch_thread, gen, greedy, llm_factory, spec_models  # noqa: F401  (fixtures)


def lookup_reference(seq: list[int], k: int, lo: int, hi: int, history: list[int] = ()) -> list[int]:
    """The longest suffix (hi down to lo tokens) that occurred earlier in seq (ending before its last token), latest
    occurrence first; history is searched too and wins only with a strictly longer suffix. Its continuation stops at
    a separator."""

    def search(hay: list[int], limit: int) -> tuple[int, int]:
        for w in range(min(hi, len(seq)), 0, -1):
            for end in range(limit, w - 1, -1):
                if hay[end - w:end] == seq[len(seq) - w:]:
                    return w, end
        return 0, 0

    w, end = search(seq, len(seq) - 1)
    source = seq
    if len(history) > 1:
        hw, hend = search(list(history), len(history) - 1)
        if hw > w:
            w, end, source = hw, hend, list(history)
    if w < lo:
        return []
    draft = source[end:end + k]
    return draft[: draft.index(SEPARATOR)] if SEPARATOR in draft else draft


@pytest.mark.parametrize("one_pass_from", [1, 3, 99], ids=["one-pass-at-once", "one-pass-after-3", "step-by-step"])
def test_matcher_equals_reference_on_random_sequences(one_pass_from, monkeypatch):
    """Both ways of extending candidates: position by position over the survivors, and the rest of the window at
    once (from the first step, from the default step, never)."""
    monkeypatch.setattr(ngram_module, "ONE_PASS_FROM", one_pass_from)
    rng = np.random.default_rng(0)
    for _ in range(1500):
        vocab = int(rng.integers(2, 6))  # small vocabularies: many matches of every length
        seq = rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
        hist = rng.integers(-1, vocab, int(rng.integers(0, 40))).tolist()  # -1: separators inside the history
        lo, k = int(rng.integers(1, 4)), int(rng.integers(1, 6))
        hi = int(rng.integers(lo, 13))
        want = lookup_reference(seq, k, lo, hi)
        assert ngram_match(np.asarray(seq), k, lo, hi).tolist() == want, (seq, k, lo, hi)
        want_h = lookup_reference(seq, k, lo, hi, hist)
        assert ngram_match(np.asarray(seq), k, lo, hi, np.asarray(hist, dtype=np.int64)).tolist() == want_h, (seq, hist)


def test_longest_match_reports_window_and_end():
    hay = np.array([4, 1, 2, 3, 9, 1, 2, 3, 8, 2, 3])
    assert longest_match(hay, np.array([7, 1, 2, 3]), 12) == (3, 8)  # "1 2 3": the latest of two, before the 8
    assert longest_match(hay, np.array([1, 2, 3]), 2) == (2, 8)  # capped at max_window
    assert longest_match(hay, np.array([5]), 12) == (0, 0)


def test_history_wins_only_when_strictly_longer():
    hist = np.array([3, 7, 9, 9, SEPARATOR, 5, 6, 7, 8, SEPARATOR], dtype=np.int64)
    # local "3 7" (w=2, then 8) ties the history's "3 7" (then 9): the request's own continuation is kept
    assert ngram_match(np.array([3, 7, 8, 3, 7]), 2, 1, 12, hist).tolist() == [8, 3]
    # local has only "7" (w=1); the history has "6 7" (w=2): its continuation, cut at the separator
    assert ngram_match(np.array([7, 2, 6, 7]), 3, 1, 12, hist).tolist() == [8]
    assert ngram_match(np.array([7, 2, 6, 7]), 3, 1, 12).tolist() == [2, 6, 7]  # no history: the local match


def test_history_keeps_the_newest_tokens():
    h = NgramHistory(capacity=6)
    h.add([1, 2, 3])
    h.add([4, 5, 6])
    assert h.tokens.tolist() == [3, SEPARATOR, 4, 5, 6, SEPARATOR]


def _request(rid: str, prompt: list[int], output: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0), seed=0, output_ids=list(output))


def test_proposer_collects_finished_requests():
    proposer = NgramProposer(1, 12, torch.device("cpu"), history_tokens=100)
    first = _request("a", [10, 11, 12], [13, 14, 15])
    assert proposer.propose([first], Tier(3), None).lens == [0]  # 15 never occurred before: nothing to draft
    first.finish_reason = "stop"
    second = _request("b", [20, 12, 13], [])  # "12 13" occurred in the finished request: draft what followed
    proposal = proposer.propose([second], Tier(3), None)
    assert proposal.lens == [2] and proposal.tokens[0, :2].tolist() == [14, 15]
    assert "a" not in proposer.live and "b" in proposer.live
    off = NgramProposer(1, 12, torch.device("cpu"), history_tokens=0)
    off.propose([first], Tier(3), None)
    assert off.propose([second], Tier(3), None).lens == [0]


def test_engine_history_is_lossless_and_drafts_from_earlier_answers(spec_models, llm_factory):
    prompts = [[5, 9, 14, 3, 8], [7, 1, 2]]
    ref = llm_factory(spec_models["target"])
    want = [gen(ref, [p], greedy(40))[0].token_ids for p in prompts]
    llm = llm_factory(spec_models["target"], speculative_algorithm="NGRAM", speculative_num_steps=4)
    first = [gen(llm, [p], greedy(40))[0] for p in prompts]
    again = [gen(llm, [p], greedy(40))[0] for p in prompts]  # the history now holds both earlier answers
    assert [o.token_ids for o in first] == want and [o.token_ids for o in again] == want
    for a, b in zip(first, again):
        assert b.meta_info["spec_accepted_tokens"] > a.meta_info["spec_accepted_tokens"]


def test_flush_cache_empties_the_history(spec_models, llm_factory):
    """A benchmark repeats its prompts after a warm-up and flushes between: the repeat must draft as on a fresh
    engine, not from its own earlier answer."""
    prompts = [[5, 9, 14, 3, 8], [7, 1, 2]]
    fresh = [gen(llm_factory(spec_models["target"], speculative_algorithm="NGRAM", speculative_num_steps=4), [p],
                 greedy(40))[0] for p in prompts]
    llm = llm_factory(spec_models["target"], speculative_algorithm="NGRAM", speculative_num_steps=4)
    gen(llm, prompts, greedy(40))
    gen(llm, [[1, 2, 3]], greedy(4))  # collects the two finished requests into the history
    assert llm.flush_cache()
    again = [gen(llm, [p], greedy(40))[0] for p in prompts]
    for a, b in zip(fresh, again):
        assert b.token_ids == a.token_ids
        assert b.meta_info["spec_accepted_tokens"] == a.meta_info["spec_accepted_tokens"]


def test_saved_history_restores_collected_and_pending_requests():
    proposer = NgramProposer(1, 12, torch.device("cpu"), history_tokens=100)
    first = _request("a", [10, 11, 12], [13, 14, 15])
    proposer.propose([first], Tier(3), None)
    saved = proposer.save_history()  # "a" is live, not yet in the history
    first.finish_reason = "stop"
    second = _request("b", [20, 12, 13], [])
    assert proposer.propose([second], Tier(3), None).lens == [2]  # "a" collected: "12 13" drafts "14 15"
    proposer.restore_history((proposer.history.tokens[:0], {}))
    assert proposer.propose([second], Tier(3), None).lens == [0]  # an emptied history drafts nothing
    proposer.restore_history(saved)
    assert proposer.propose([second], Tier(3), None).lens == [2]  # "a", pending in the saved state, is collected again


def test_sequence_arrays_follow_growing_outputs_and_reused_ids():
    """The proposer keeps each request's tokens as an array it appends to: drafts equal those from the whole list,
    round after round, and a finished request's id reused by a new request starts a fresh array."""
    proposer = NgramProposer(1, 12, torch.device("cpu"), history_tokens=0)
    rng = np.random.default_rng(3)
    req = _request("a", rng.integers(0, 5, 30).tolist(), [])
    for _ in range(40):
        got = proposer.propose([req], Tier(3), None)
        want = ngram_match(np.asarray(req.prompt_ids + req.output_ids), 3, 1, 12)
        assert got.lens == [len(want)] and got.tokens[0, : len(want)].tolist() == want.tolist()
        req.output_ids += rng.integers(0, 5, int(rng.integers(1, 4))).tolist()  # 1-3 tokens a round, as accepted
    req.finish_reason = "stop"
    again = _request("a", [7, 8, 9, 7, 8], [])  # same id, other tokens
    assert proposer.propose([again], Tier(3), None).tokens[0, :1].tolist() == [9]  # "7 8" -> 9, not a's tokens
    assert proposer._sequence(again).tolist() == [7, 8, 9, 7, 8]
