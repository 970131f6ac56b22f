"""Acceptance accounting: what verification accepted, per request (meta_info) and per engine (server info).

- Full acceptance: a STANDALONE draft that computes the target's function (the target checkpoint itself, or a
  differently shaped but equivalent copy) must have every greedy draft accepted.
- Exact acceptance: for a draft that only sometimes agrees (and for NGRAM), the accept counts must equal those of
  a reference simulation of greedy chain speculation: transformers runs the draft model from scratch on the
  current sequence (no KV cache to get wrong), and a plain-Python prompt lookup stands in for NGRAM. Any slip in
  the engine's draft KV bookkeeping (rollback after a rejection, catch-up after a full acceptance) or in the
  NGRAM's view of the sequence changes the proposals and hence the counts.
- Metrics: meta_info and get_server_info()['internal_states'][0] are consistent with each other.
"""

from __future__ import annotations

import functools

import pytest
import torch

from hyperdraft import LLM
from helpers.spec_fixtures import (_single_torch_thread, assert_clean, ceil_div, gen, greedy, llm_factory, mixed_prompts,  # noqa: F401
                           spec_models, spec_state)

# ---- full acceptance ----------------------------------------------------------------------------------------------

# Every remainder of (max_new_tokens - 1) modulo steps + 1 occurs, and 1 (no verify at all).
MAX_NEW = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 16, 17, 20, 25, 30]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return mixed_prompts(16, seed=21)


@functools.lru_cache(maxsize=None)
def _spec_off(target: str, prompts_key: tuple, max_new: tuple) -> list:
    llm = LLM(target, device="cpu", dtype="float32")
    outs = gen(llm, [list(p) for p in prompts_key], [greedy(n) for n in max_new])
    assert_clean(llm)
    return outs


def spec_off(spec_models, prompts, max_new) -> list:
    return _spec_off(spec_models["target"], tuple(map(tuple, prompts)), tuple(max_new))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("draft", ["target", "draft_wide"])
def test_full_acceptance_when_draft_is_target(spec_models, llm_factory, prompts, draft, steps, page_size):
    """Every verify accepts all `steps` drafts. The first token comes from the prefill, and each verify then emits
    steps + 1 tokens (the last verify possibly cut by max_new_tokens), so an ignore_eos request with max_new_tokens
    n has exactly ceil((n - 1) / (steps + 1)) verifies; any rejected draft would need more."""
    llm = llm_factory(spec_models["target"], speculative_algorithm="STANDALONE", page_size=page_size,
                      speculative_draft_model_path=spec_models[draft], speculative_num_steps=steps)
    outs = gen(llm, prompts, [greedy(n) for n in MAX_NEW])
    refs = spec_off(spec_models, prompts, MAX_NEW)

    total_verifies = 0
    for i, (o, ref, n) in enumerate(zip(outs, refs, MAX_NEW)):
        assert o.token_ids == ref.token_ids and o.finish_reason == "length", f"request {i}"
        meta = o.meta_info
        assert meta["completion_tokens"] == n
        verifies = ceil_div(n - 1, steps + 1)
        if verifies == 0:
            assert meta.get("spec_verify_ct", 0) == 0, "a one-token request is done after its prefill"
            continue
        assert meta["spec_verify_ct"] == verifies, f"request {i} (max_new_tokens {n}): {meta}"
        assert meta["spec_accept_length"] == pytest.approx(n / verifies)
        assert meta["spec_draft_tokens"] == meta["spec_accepted_tokens"] == steps * verifies
        # SGLang's meta_info names for the same counts (what its clients read)
        assert meta["spec_num_proposed_drafts"] == meta["spec_num_correct_drafts"] == steps * verifies
        assert meta["spec_accept_rate"] == 1.0
        total_verifies += verifies

    state = spec_state(llm)
    assert state["spec_acceptance_by_position"] == [1.0] * steps
    hist = state["spec_accept_length_histogram"]
    assert hist[steps + 1] == total_verifies == state["spec_verifies"]
    assert sum(hist) == hist[steps + 1], f"only full-length accepts expected: {hist}"
    assert state["avg_spec_accept_length"] == pytest.approx(steps + 1)
    assert state["spec_acceptance_rate"] == pytest.approx(1.0)


# ---- exact acceptance against a reference simulation ----------------------------------------------------------------

SIM_NEW = 24
SIM_STEPS = 3
NGRAM_WINDOWS = {"NGRAM": (1, 12), "NGRAM-window-2-3": (2, 3)}  # (min, max); the first is EngineArgs' default


@functools.lru_cache(maxsize=None)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy_draft(path: str, seq: list[int], k: int) -> list[int]:
    """k greedy tokens of the draft model, each from a full forward over the whole sequence (no KV cache)."""
    model, seq = _hf_model(path), list(seq)
    out = []
    with torch.no_grad():
        for _ in range(k):
            tok = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            out.append(tok)
            seq.append(tok)
    return out


def prompt_lookup(seq: list[int], k: int, min_window: int, max_window: int) -> list[int]:
    """Reference NGRAM: the longest suffix (max_window down to min_window tokens) that occurred earlier (the
    occurrence must end before the last token); take the latest such occurrence, propose the up to k tokens after it."""
    n = len(seq)
    for w in range(min(max_window, n - 1), min_window - 1, -1):
        suffix = seq[n - w:]
        for start in range(n - 1 - w, -1, -1):
            if seq[start:start + w] == suffix:
                return seq[start + w:start + w + k]
    return []


def simulate(prompt, target_tokens, max_new, propose):
    """Greedy chain speculation: -> (verifies, accepted drafts, accept-length histogram entries [a + 1])."""
    out, verifies, accepted, lengths = [target_tokens[0]], 0, 0, []
    while len(out) < max_new:
        drafts = propose(prompt + out)
        a = 0
        while a < len(drafts) and drafts[a] == target_tokens[len(out) + a]:
            a += 1
        verifies, accepted = verifies + 1, accepted + a
        lengths.append(a + 1)
        out = target_tokens[:len(out) + a + 1]
    return verifies, accepted, lengths


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("drafter", ["STANDALONE-wide-noisy", *NGRAM_WINDOWS])
def test_accept_counts_match_reference_simulation(spec_models, llm_factory, prompts, drafter, page_size):
    if drafter in NGRAM_WINDOWS:
        lo, hi = NGRAM_WINDOWS[drafter]
        args = dict(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=lo,
                    speculative_ngram_max_match_window_size=hi)
        propose = functools.partial(lambda seq: prompt_lookup(seq, SIM_STEPS, lo, hi))
    else:
        path = spec_models["draft_wide_noisy"]
        args = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=path)
        propose = functools.partial(lambda seq: hf_greedy_draft(path, seq, SIM_STEPS))
    llm = llm_factory(spec_models["target"], speculative_num_steps=SIM_STEPS, page_size=page_size, **args)
    outs = gen(llm, prompts, greedy(SIM_NEW))
    # The target's greedy continuation, long enough to judge drafts that run past max_new_tokens.
    long_refs = spec_off(spec_models, prompts, [SIM_NEW + SIM_STEPS] * len(prompts))

    all_lengths = []
    for i, (o, ref, prompt) in enumerate(zip(outs, long_refs, prompts)):
        assert o.token_ids == ref.token_ids[:SIM_NEW], f"request {i}"
        verifies, accepted, lengths = simulate(prompt, ref.token_ids, SIM_NEW, propose)
        meta = o.meta_info
        assert (meta["spec_verify_ct"], meta["spec_accepted_tokens"]) == (verifies, accepted), (
            f"request {i}: engine (verifies, accepted) = {(meta['spec_verify_ct'], meta['spec_accepted_tokens'])}, "
            f"reference {(verifies, accepted)}")
        all_lengths += lengths

    state = spec_state(llm)
    hist = [0] * (SIM_STEPS + 2)
    for n in all_lengths:
        hist[n] += 1
    assert state["spec_accept_length_histogram"] == hist
    assert sum(hist[2:]) > 0 and sum(hist[1:SIM_STEPS + 1]) > 0, "expected both accepted and rejected drafts"


# ---- metrics ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["STANDALONE-wide-noisy", "NGRAM"])
def test_spec_metrics_consistent(spec_models, llm_factory, prompts, drafter):
    steps = 3
    args = dict(speculative_algorithm="NGRAM") if drafter == "NGRAM" else dict(
        speculative_algorithm="STANDALONE", speculative_draft_model_path=spec_models["draft_wide_noisy"])
    llm = llm_factory(spec_models["target"], speculative_num_steps=steps, **args)
    outs = gen(llm, prompts, [greedy(n) for n in MAX_NEW])

    sums = dict(verifies=0, drafted=0, accepted=0)
    max_verifies = 0
    for o, n in zip(outs, MAX_NEW):
        meta = o.meta_info
        completion = meta["completion_tokens"]
        assert completion == n == len(o.token_ids)
        if n == 1:
            assert meta.get("spec_verify_ct", 0) == 0
            continue
        vc, drafted, accepted = meta["spec_verify_ct"], meta["spec_draft_tokens"], meta["spec_accepted_tokens"]
        assert vc >= 1
        assert meta["spec_accept_length"] == pytest.approx(completion / vc)
        assert 0 <= accepted <= drafted <= steps * vc
        assert (meta["spec_num_correct_drafts"], meta["spec_num_proposed_drafts"]) == (accepted, drafted)
        assert meta["spec_accept_rate"] == pytest.approx(accepted / drafted if drafted else 0.0)
        if drafter != "NGRAM":
            assert drafted == steps * vc  # a draft model always proposes a full chain
        # 1 prefill token + (accepted + 1) per verify, of which the last verify may lose up to `steps` to the length cap.
        assert 1 + vc + accepted - steps <= completion <= 1 + vc + accepted
        sums["verifies"] += vc
        sums["drafted"] += drafted
        sums["accepted"] += accepted
        max_verifies = max(max_verifies, vc)

    state = spec_state(llm)
    assert state["speculative_algorithm"] == drafter.split("-")[0]
    assert state["speculative_num_steps"] == steps
    assert state["speculative_eagle_topk"] == 1
    assert state["speculative_num_draft_tokens"] == steps + 1
    assert state["spec_verifies"] == sums["verifies"]
    assert state["spec_draft_tokens"] == sums["drafted"]
    assert state["spec_accepted_tokens"] == sums["accepted"]
    assert max_verifies <= state["spec_verify_forwards"] <= state["spec_verifies"]
    assert state["avg_spec_accept_length"] == pytest.approx((sums["accepted"] + sums["verifies"]) / sums["verifies"])
    assert state["spec_acceptance_rate"] == pytest.approx(sums["accepted"] / sums["drafted"])
    hist = state["spec_accept_length_histogram"]
    assert len(hist) == steps + 2 and hist[0] == 0
    assert sum(hist) == sums["verifies"]
    assert sum((i - 1) * c for i, c in enumerate(hist)) == sums["accepted"]
    rates = state["spec_acceptance_by_position"]
    assert len(rates) == steps and all(0.0 <= r <= 1.0 for r in rates)
    if drafter != "NGRAM":  # a chain: accepting draft j requires accepting draft j-1, with equal proposal counts
        assert all(a >= b for a, b in zip(rates, rates[1:]))
        assert rates[0] * sums["verifies"] == pytest.approx(hist_at_least(hist, 1))
    assert 0 < sums["accepted"] < sums["drafted"]


def hist_at_least(hist, j):
    """Verifies that accepted at least j drafts."""
    return sum(c for i, c in enumerate(hist) if i - 1 >= j)


def test_no_spec_metrics_without_speculation(spec_models, llm_factory, prompts):
    llm = llm_factory(spec_models["target"])
    outs = gen(llm, prompts[:4], greedy(8))
    for o in outs:
        assert "spec_verify_ct" not in o.meta_info and "spec_accept_length" not in o.meta_info
    state = spec_state(llm)
    assert not any(k.startswith("spec") for k in state), state


def test_metrics_accumulate_across_generate_calls(spec_models, llm_factory, prompts):
    """Server-level counters cover every request the engine served; per-request ones only that request."""
    llm = llm_factory(spec_models["target"], speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=spec_models["target"], speculative_num_steps=2)
    first = gen(llm, prompts[:3], greedy(10))
    after_first = spec_state(llm)["spec_verifies"]
    second = gen(llm, prompts[3:5], greedy(7))
    state = spec_state(llm)
    assert after_first == sum(o.meta_info["spec_verify_ct"] for o in first) == 3 * ceil_div(9, 3)
    assert state["spec_verifies"] == after_first + sum(o.meta_info["spec_verify_ct"] for o in second)
    assert all(o.meta_info["spec_verify_ct"] == ceil_div(6, 3) for o in second)
