"""What the prefix-cache tests (dense and hybrid) share: an fp32 CPU engine without a tokenizer, prompts run together
with the page accounting checked after every step, and a drafter's root logits per round, recorded from its catch-up,
to compare cache-on rounds with cache-off ones (a page of wrong K/V, or a restored state or hidden state that is not
the one the drafter would have computed, moves them even where the drafts happen to agree)."""

from __future__ import annotations

import random

import torch

from hyperdraft import LLM, SamplingParams
from tests.conftest import assert_kv_accounted


def make(path: str, **args) -> LLM:
    return LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, **args)


def diverging_waves(vocab: int, seed: int) -> list[list[list[int]]]:
    """Three waves of six prompts: 12-23 tokens of one 24-token stem, then 5-17 tokens of their own."""
    rng = random.Random(seed)
    stem = [rng.randrange(vocab) for _ in range(24)]
    return [[stem[: rng.randrange(12, 24)] + [rng.randrange(vocab) for _ in range(rng.randrange(5, 18))]
             for _ in range(6)] for _ in range(3)]


def run_checked(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """Run the prompts together, checking the page accounting after every step -> per request: its tokens, cached
    tokens and speculative counters."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    reqs = [engine.add_request(input_ids=p, params=params) for p in prompts]
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
        assert_kv_accounted(engine)
    assert all(r.finished for r in reqs)
    return [dict(ids=r.output_ids, cached=r.cached_tokens, drafted=r.spec_draft_tokens,
                 accepted=r.spec_accepted_tokens, reason=r.finish_reason) for r in reqs]


def record_root_logits(monkeypatch) -> dict[tuple, list]:
    """Spy on ModelProposer.catch_up -> {(request hit the cache, its sequence so far): [root logits per round]}."""
    from hyperdraft.speculative.proposers.model_proposer import ModelProposer

    seen: dict[tuple, list] = {}
    original = ModelProposer.catch_up

    def spy(self, reqs, tokens_in=None):
        fb, out = original(self, reqs, tokens_in)
        for r, row in zip(reqs, out.target_logits()):
            seen.setdefault((r.cached_tokens > 0, tuple(r.prompt_ids + r.output_ids)), []).append(row.clone())
        return fb, out

    monkeypatch.setattr(ModelProposer, "catch_up", spy)
    return seen


def assert_hits_match_cache_off(seen: dict[tuple, list], min_compared: int) -> None:
    """Every round of a request that hit the cache has the root logits the cache-off run had for the same sequence
    (the cache-off run recorded each sequence's rounds from scratch)."""
    off = {seq: rows for (hit, seq), rows in seen.items() if not hit}
    compared = 0
    for (hit, seq), rows in seen.items():
        for ref in off.get(seq, []) if hit else []:
            # fp32 summation order differs (batch shapes): ~1e-5; a wrong page or restore is O(1e-1) or more
            assert torch.allclose(rows[0], ref, atol=2e-3, rtol=1e-4), (len(seq), (rows[0] - ref).abs().max())
            compared += 1
    assert compared >= min_compared, f"{compared} rounds compared"
