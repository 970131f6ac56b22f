"""Adaptive speculation inside the engine (CPU, fp32): tiers move with measured acceptance, outputs never change,
and every buffer was sized for the largest tier before the first switch."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hyperdraft import LLM, SamplingParams
from hyperdraft.options import RuntimeOptions
from hyperdraft.testing.eagle_ckpt import write_random_eagle_checkpoint
from hyperdraft.testing.tiny import make_tiny_model
from tests.conftest import assert_engine_clean
from tests.helpers.spec_fixtures import STEP_ZERO_PARAMS

torch.set_num_threads(1)

FAST = {"ema_alpha": 0.5, "warmup_batches": 2, "update_interval": 2,
        "1": {"candidate_steps": [1, 3, 5, 7], "down_hysteresis": -0.25},
        "8": {"candidate_steps": [0, 1, 3]}}
REPETITIVE = [[5, 6, 7] * 6, [9, 8] * 8, [1, 2, 3, 4] * 4, [20, 21] * 9]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    target = make_tiny_model(str(root / "target"), "llama", num_hidden_layers=4)
    draft = make_tiny_model(str(root / "draft"), "qwen3", seed=5, hidden_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=64)
    head = write_random_eagle_checkpoint(str(root / "e3"), target, kind="eagle3", draft_vocab_size=200)
    head1 = write_random_eagle_checkpoint(str(root / "e1"), target, kind="eagle")
    return {"target": target, "draft": draft, "eagle3": head, "eagle": head1, "root": root,
            "bigram": _bigram_copy(target, root / "bigram")}


def _bigram_copy(src: str, dst) -> str:
    """The target with every attention output zeroed: the next token depends only on the current one, so greedy
    text falls into a short cycle -- genuinely repetitive text that prompt lookup predicts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    model.save_pretrained(str(dst))
    AutoTokenizer.from_pretrained(src).save_pretrained(str(dst))
    return str(dst)


def _config(models, name: str, cfg: dict) -> str:
    path = models["root"] / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _run(models, prompts, n_new=64, target="target", **engine_args):
    llm = LLM(models[target], device="cpu", dtype="float32", **engine_args)
    outs = llm.generate(input_ids=prompts, sampling_params=SamplingParams(temperature=0, max_new_tokens=n_new, ignore_eos=True),
                        use_tqdm=False)
    state = llm.get_server_info()["internal_states"][0]
    assert_engine_clean(llm)
    return [o.token_ids for o in outs], state


@pytest.fixture(scope="module")
def plain(models):
    cache = {}

    def get(prompts, n_new=64):
        key = (tuple(map(tuple, prompts)), n_new)
        if key not in cache:
            cache[key] = _run(models, prompts, n_new)[0]
        return cache[key]

    return get


def test_self_draft_rises_to_the_top_tier(models, plain):
    cfg = _config(models, "fast", FAST)
    outs, state = _run(models, REPETITIVE, speculative_algorithm="STANDALONE", speculative_draft_model_path=models["target"],
                       speculative_adaptive=True, speculative_adaptive_config=cfg)
    assert outs == plain(REPETITIVE)
    assert state["speculative_num_steps"] == 7 and state["speculative_adaptive_slots"]["1"]["steps"] == 7
    assert state["spec_tier_switches"] >= 2 and state["spec_steps_per_tier"].get("7", 0) > 0


def test_random_draft_falls_to_the_lowest_tier(models, plain):
    cfg = _config(models, "fast", FAST)
    outs, state = _run(models, REPETITIVE, speculative_algorithm="STANDALONE", speculative_draft_model_path=models["draft"],
                       speculative_adaptive=True, speculative_adaptive_config=cfg)
    assert outs == plain(REPETITIVE)
    assert state["speculative_num_steps"] == 1 and state["speculative_adaptive_slots"]["1"]["steps"] == 1


def test_ngram_follows_the_text(models, plain):
    cfg = _config(models, "fast", FAST)
    g = torch.Generator().manual_seed(3)
    random_prompts = [torch.randint(0, 384, (40,), generator=g).tolist() for _ in range(4)]
    rep_plain, _ = _run(models, REPETITIVE, target="bigram")
    rep, rep_state = _run(models, REPETITIVE, target="bigram", speculative_algorithm="NGRAM", speculative_adaptive=True,
                          speculative_adaptive_config=cfg)
    rnd, rnd_state = _run(models, random_prompts, speculative_algorithm="NGRAM", speculative_adaptive=True,
                          speculative_adaptive_config=cfg)
    assert rep == rep_plain and rnd == plain(random_prompts)
    assert rep_state["speculative_num_steps"] >= 5, rep_state  # rose from the initial 3 (the cycle starts after a few tokens)
    assert rep_state["speculative_num_steps"] > rnd_state["speculative_num_steps"], (rep_state, rnd_state)
    assert rnd_state["speculative_num_steps"] == 1


def test_large_batches_route_to_their_own_slot_and_may_stop_speculating(models, plain):
    cfg = _config(models, "fast", FAST)
    prompts = REPETITIVE * 3  # 12 requests: slot "8", ladder [0, 1, 3]
    outs, state = _run(models, prompts, n_new=40, speculative_algorithm="STANDALONE", speculative_draft_model_path=models["draft"],
                       speculative_adaptive=True, speculative_adaptive_config=cfg)
    assert outs == plain(prompts, 40)
    assert state["spec_steps_per_tier"].get("0", 0) > 0, state  # the random draft drove slot 8 to no speculation
    assert state["speculative_adaptive_slots"]["8"]["counted"] > 0


@pytest.mark.parametrize("algo", ["STANDALONE", "EAGLE3", "EAGLE"])
def test_adaptive_trees(models, plain, algo):
    tree_cfg = {"ema_alpha": 0.5, "warmup_batches": 1, "update_interval": 1,
                "1": {"candidate_steps": [1, {"steps": 3, "topk": 2, "num_draft_tokens": 6},
                                          {"steps": 5, "topk": 4, "num_draft_tokens": 16}]}}
    draft = {"STANDALONE": models["draft"], "EAGLE3": models["eagle3"], "EAGLE": models["eagle"]}[algo]  # weak drafts
    outs, state = _run(models, REPETITIVE, speculative_algorithm=algo, speculative_draft_model_path=draft,
                       speculative_adaptive=True, speculative_adaptive_config=_config(models, "tree", tree_cfg))
    assert outs == plain(REPETITIVE)
    assert len(state["spec_steps_per_tier"]) >= 2, state  # it really switched between chain and tree tiers


def test_first_update_jumps_from_smallest_to_largest_tier_within_the_sized_buffers(models, plain):
    """Start at 1 step; alpha 1, no warmup, interval 1 and a self-draft force 1 -> 7 on the very first decision.
    Every pool and buffer was sized at start-up for 7 steps (8 tokens), never for the initial tier."""
    cfg = _config(models, "jump", {"ema_alpha": 1.0, "warmup_batches": 0, "update_interval": 1,
                                   "1": {"candidate_steps": [1, 7], "up_hysteresis": -10.0}})
    llm = LLM(models["target"], device="cpu", dtype="float32", speculative_algorithm="STANDALONE",
              speculative_draft_model_path=models["target"], speculative_adaptive=True, speculative_adaptive_config=cfg,
              speculative_num_steps=1, page_size=4)
    assert llm.engine.spec.max_verify_tokens == 8 and llm.engine.scheduler.decode_reserve == 8
    outs = llm.generate(input_ids=REPETITIVE, sampling_params=SamplingParams(temperature=0, max_new_tokens=64, ignore_eos=True),
                        use_tqdm=False)
    state = llm.get_server_info()["internal_states"][0]
    assert [o.token_ids for o in outs] == plain(REPETITIVE)
    assert state["spec_steps_per_tier"]["1"] <= 2 and state["spec_steps_per_tier"]["7"] > 0, state
    assert_engine_clean(llm)


def test_adaptive_eagle_pools_sized_for_the_largest_tier(models):
    llm = LLM(models["target"], device="cpu", speculative_algorithm="EAGLE3", speculative_draft_model_path=models["eagle3"],
              speculative_adaptive=True)  # SGLang's default ladder: up to 7 steps
    assert llm.engine.spec.num_steps == 3  # the middle of [0, 1, 3, 5, 7]
    assert llm.engine.worker.proposer.hidden_buf.shape[1] >= 8 + 1
    assert llm.engine.scheduler.decode_reserve == 8


def test_adaptive_errors_use_sglang_wording(models, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"1": {"candidate_steps": "x"}}))
    with pytest.raises(ValueError, match="BS 1: candidate_steps must be a list of non-negative ints"):
        LLM(models["target"], device="cpu", speculative_algorithm="NGRAM", speculative_adaptive=True,
            speculative_adaptive_config=str(bad))
    with pytest.raises(ValueError, match="is not in the adaptive config candidate_steps"):
        LLM(models["target"], device="cpu", speculative_algorithm="NGRAM", speculative_adaptive=True, speculative_num_steps=4)


def test_goodput_turns_speculation_off_for_a_useless_draft(models, plain, tmp_path):
    # A draft as deep as the target, so a drafting step costs about twice a plain one: with the 1-layer draft the gap
    # was small enough that the other test worker's load could make tier 1 look no dearer than tier 0 (seen once in
    # CI: tiers {0: 22, 1: 43, 3: 8, 5: 6}).
    useless = make_tiny_model(str(tmp_path / "deep_draft"), "qwen3", seed=5, num_hidden_layers=4)
    cfg = _config(models, "goodput", {"strategy": "goodput", "goodput": {"warmup": 2, "decide_every": 2, "explore_every": 5},
                                      "1": {"candidate_steps": [0, 1, 3, 5]}})
    outs, state = _run(models, REPETITIVE, n_new=80, speculative_algorithm="STANDALONE",
                       speculative_draft_model_path=useless, speculative_adaptive=True, speculative_adaptive_config=cfg)
    assert outs == plain(REPETITIVE, 80)
    tiers = state["spec_steps_per_tier"]
    assert state["speculative_adaptive_strategy"] == "goodput"
    assert tiers.get("0", 0) > sum(tiers.values()) / 2, tiers  # a draft that is never accepted only costs time


def test_goodput_does_not_time_the_step_after_a_prefill(models, plain):
    """The step after one that ran prefill chunks found nothing queued ahead (speculative/worker.py): its wall time is
    not its tier's cost. One request at a time, so each request's first decode step follows its prefill; no decision
    (warmup past the run), so no tier switch leaves a step untimed either."""
    cfg = _config(models, "goodput_untimed", {"strategy": "goodput", "goodput": {"warmup": 100000},
                                              "1": {"candidate_steps": [0, 1, 3]}})
    outs, state = _run(models, REPETITIVE, n_new=24, speculative_algorithm="NGRAM", speculative_adaptive=True,
                       speculative_adaptive_config=cfg, max_running_requests=1)
    assert outs == plain(REPETITIVE, 24)
    slot = state["speculative_adaptive_slots"]["1"]
    assert slot["counted"] >= 4 * 10, slot  # a few rounds accept several tokens; most do not
    assert slot["timed_steps"] == slot["counted"] - len(REPETITIVE), slot


def test_draft_state_survives_step_zero(models, plain):
    """A self-draft alternating 3, 0, 3, 0 (a huge down-hysteresis drops it after every fully accepted round; the
    probe brings it back) must still accept everything: a step run at 0 right after a fully accepted round must not
    leave a hole in the draft's K/V (the draft catches up on the next speculating round)."""
    cfg = _config(models, "zero", {"ema_alpha": 1.0, "warmup_batches": 0, "update_interval": 1,
                                   "1": {"candidate_steps": [0, 3], "down_hysteresis": 10.0}})
    outs, state = _run(models, REPETITIVE, speculative_algorithm="STANDALONE", speculative_draft_model_path=models["target"],
                       speculative_adaptive=True, speculative_adaptive_config=cfg, speculative_num_steps=0)
    assert outs == plain(REPETITIVE)
    assert state["spec_steps_per_tier"].get("0", 0) > 5 and state["spec_steps_per_tier"].get("3", 0) > 5, state
    assert state["spec_acceptance_rate"] > 0.99, state


def _run_graphed(models, prompts, params, target="target", ahead=True, park=True, draft_ahead=True,
                 after_empty=False, **engine_args):
    """Emulated CUDA graphs (CPU): the plain worker queues each next decode ahead only where a graph runs it, and so
    does a speculative worker a step-0 round's next verify (counts: the plain worker's, else the verify-ahead's;
    rounds_ahead_used: steps served by a queued verify, either way)."""
    options = RuntimeOptions(emulate_cuda_graphs=True, decode_ahead=ahead, park_head=park, draft_ahead=draft_ahead,
                             ahead_after_empty=after_empty)
    llm = LLM(models[target], device="cpu", dtype="float32", runtime_options=options, cuda_graph_max_bs=4,
              **engine_args)
    outs = llm.generate(input_ids=prompts, sampling_params=params, use_tqdm=False)
    worker = llm.engine.worker
    counts = {}
    if engine_args and worker.plain is not None:
        counts = {"ahead_used": worker.plain.ahead_used, "ahead_discarded": worker.plain.ahead_discarded,
                  "rounds_ahead_used": worker.verify_ahead.used}
    elif engine_args:
        counts = {"ahead_used": worker.verify_ahead.used, "ahead_discarded": worker.verify_ahead.dropped,
                  "drafts_ahead_used": worker.proposer.ahead_used}
    state = llm.get_server_info()["internal_states"][0] if engine_args else {}
    assert_engine_clean(llm)
    return outs, counts, state


def test_ngram_step_zero_runs_as_plain_decodes(models):
    """A ladder of step 0 only: every decode step is the plain worker's, its next decode queued ahead and used, and the
    output is plain decoding's. Each step still counts as a round of zero drafts, per request and in the metrics."""
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    cfg = _config(models, "zero_only", {"1": {"candidate_steps": [0]}})
    plain_outs, _, _ = _run_graphed(models, REPETITIVE, params)
    outs, counts, state = _run_graphed(models, REPETITIVE, params, speculative_algorithm="NGRAM",
                                       speculative_adaptive=True, speculative_adaptive_config=cfg)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain_outs]
    assert counts["ahead_used"] > 10, counts  # the queued decodes served the steps after them
    assert set(state["spec_steps_per_tier"]) == {"0"}, state
    # the first token comes from the prefill; each later one from a step-0 decode, counted as a round
    assert all(o.meta_info["spec_verify_ct"] == 23 and o.meta_info["spec_draft_tokens"] == 0 for o in outs), \
        [o.meta_info for o in outs]


@pytest.mark.parametrize("draft_ahead", [False, True], ids=["host-lookups", "lookups-ahead"])
@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "static"])
@STEP_ZERO_PARAMS
def test_ngram_rounds_without_a_match_run_as_plain_decodes(models, params, adaptive, draft_ahead):
    """Tier 3 (an adaptive ladder of it alone, or the static tier), random prompts: NGRAM finds no match in most
    rounds, and a round in which no request has a draft runs as the plain worker's decode, its next decode queued
    ahead and used when the next lookup finds nothing either (thrown away when it does). Output equals plain
    decoding's (seeded sampling: the same engine queuing nothing ahead); each such step counts as a round of no
    drafts at tier 3, per request too. With lookups queued ahead (proposers/ngram.py) a round after a drafting one
    verifies the queued lookup first; if that drafted nothing anywhere, the steps after it are plain decodes again
    (RuntimeOptions.ahead_after_empty off, as _run_graphed builds it; on: the next test)."""
    spec = dict(speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_num_draft_tokens=4)
    if adaptive:
        spec.update(speculative_adaptive=True,
                    speculative_adaptive_config=_config(models, "three_only", {"1": {"candidate_steps": [3]}}))
    prompts = torch.randint(3, 300, (4, 12), generator=torch.Generator().manual_seed(3)).tolist()
    batch_params = [dataclasses.replace(params, max_new_tokens=n) for n in (24, 30, 17, 30)]
    outs, counts, state = _run_graphed(models, prompts, batch_params, draft_ahead=draft_ahead, **spec)
    if params.temperature == 0:
        want, _, _ = _run_graphed(models, prompts, batch_params)
    else:
        want, _, _ = _run_graphed(models, prompts, batch_params, ahead=False, draft_ahead=draft_ahead, **spec)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert counts["ahead_used"] > (1 if draft_ahead else 3), counts
    assert set(state["spec_steps_per_tier"]) == {"3"}, state
    for o in outs:  # the first token is the prefill's; every later step is a round, drafting or not
        info = o.meta_info
        assert info["spec_verify_ct"] + info["spec_accepted_tokens"] == len(o.token_ids) - 1, info


@STEP_ZERO_PARAMS
def test_ngram_queue_kept_past_empty_rounds(models, params):
    """RuntimeOptions.ahead_after_empty: a round whose queued lookups drafted nothing anywhere keeps the lookup and
    verify queued behind it, so the steps after a drafting round stay rounds served by queued verifies instead of
    host lookups and plain decodes. Same prompts and tier as the test above: the output equals plain decoding's
    (seeded sampling: the same engine queuing nothing ahead), fewer steps are plain decodes and more use queued
    verifies than when the queue is dropped, and the pool ends free (_run_graphed)."""
    spec = dict(speculative_algorithm="NGRAM", speculative_num_steps=3, speculative_num_draft_tokens=4)
    prompts = torch.randint(3, 300, (4, 12), generator=torch.Generator().manual_seed(3)).tolist()
    batch_params = [dataclasses.replace(params, max_new_tokens=n) for n in (24, 30, 17, 30)]
    kept, kept_counts, _ = _run_graphed(models, prompts, batch_params, after_empty=True, **spec)
    dropped, dropped_counts, _ = _run_graphed(models, prompts, batch_params, **spec)
    if params.temperature == 0:
        want, _, _ = _run_graphed(models, prompts, batch_params)
    else:
        want, _, _ = _run_graphed(models, prompts, batch_params, ahead=False, **spec)
    assert [o.token_ids for o in kept] == [o.token_ids for o in want] == [o.token_ids for o in dropped]
    assert kept_counts["rounds_ahead_used"] > dropped_counts["rounds_ahead_used"], (kept_counts, dropped_counts)
    assert kept_counts["ahead_used"] < dropped_counts["ahead_used"], (kept_counts, dropped_counts)


@pytest.mark.parametrize("penalty", [1.0, 1.3], ids=["greedy", "penalised"])
@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE"])
def test_between_step_zero_and_rounds(models, algo, penalty):
    """Tiers 3, 0, 3, 0, ... (a huge down-hysteresis drops after every round, the probe climbs back), NGRAM on
    repetitive text and a self-draft that accepts everything: each round after a plain step must throw that step's
    queued decode away, or a later step-0 batch of the same requests would take tokens sampled before the round moved
    them on; a self-draft skipping step 0 must catch up on the next round, as after a round of step 0. Penalty counts
    cross the two workers too."""
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True, repetition_penalty=penalty)
    cfg = _config(models, "zero_three", {"ema_alpha": 1.0, "warmup_batches": 0, "update_interval": 1,
                                         "1": {"candidate_steps": [0, 3], "down_hysteresis": 10.0}})
    target, drafter = ("bigram", {}) if algo == "NGRAM" else ("target", {"speculative_draft_model_path": models["target"]})
    plain_outs, _, _ = _run_graphed(models, REPETITIVE, params, target=target)
    outs, counts, state = _run_graphed(models, REPETITIVE, params, target=target, speculative_algorithm=algo,
                                       speculative_adaptive=True, speculative_adaptive_config=cfg,
                                       speculative_num_steps=0, **drafter)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain_outs]
    tiers = state["spec_steps_per_tier"]
    assert tiers.get("0", 0) > 5 and tiers.get("3", 0) > 5, tiers
    # (an NGRAM round that finds no match is a plain decode too, and uses the decode queued before it)
    assert counts["ahead_discarded"] > (5 if algo == "STANDALONE" else 0), counts
    if algo == "STANDALONE":  # the same text drafted: every draft accepted, the skipped steps caught up
        assert state["spec_acceptance_rate"] > 0.99, state
    elif penalty == 1.0:  # the rounds between the plain steps really drafted (penalised text stops repeating)
        assert state["spec_acceptance_rate"] > 0.5, state


@pytest.mark.parametrize("ladder", ["zero_only", "zero_three"])
@STEP_ZERO_PARAMS
def test_eagle_step_zero_verifies_ahead(models, ladder, params):
    """With park_head off an EAGLE-3 head's step-0 steps stay rounds (it must see every token); each queues the next
    round's verify (verify_ahead.py) and the next step-0 round of the same requests uses it. Tiers 0 only, or 3, 0, 3, 0 (every
    round after a step-0 round drops the queued verify), requests finishing at different steps (the batch changes):
    the output equals plain decoding's (greedy, penalised) and the same engine's without queuing (seeded sampling),
    and the pool ends free."""
    steps = {"zero_only": {"1": {"candidate_steps": [0]}},
             "zero_three": {"ema_alpha": 1.0, "warmup_batches": 0, "update_interval": 1,
                            "1": {"candidate_steps": [0, 3], "down_hysteresis": 10.0}}}[ladder]
    cfg = _config(models, f"eagle_{ladder}", steps)
    lengths = [32, 20, 27, 32]
    batch_params = [dataclasses.replace(params, max_new_tokens=n) for n in lengths]
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=models["eagle3"],
                speculative_adaptive=True, speculative_adaptive_config=cfg, speculative_num_steps=0)
    outs, counts, state = _run_graphed(models, REPETITIVE, batch_params, park=False, **spec)
    if params.temperature == 0:
        want, _, _ = _run_graphed(models, REPETITIVE, batch_params)
    else:
        want, _, _ = _run_graphed(models, REPETITIVE, batch_params, ahead=False, park=False, **spec)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    if ladder == "zero_only":  # queued verifies served the step-0 rounds after them, and went where the batch changed;
        # so did the head's catch-ups, queued as round graphs of the catch-up alone
        assert counts["ahead_used"] > 20 and counts["ahead_discarded"] > 0, counts
        assert counts["drafts_ahead_used"] > 20, counts
    else:  # every step-0 round is followed by a round of 3: each queued verify is dropped
        assert counts["ahead_used"] == 0 and counts["ahead_discarded"] > 5, counts
    tiers = state["spec_steps_per_tier"]
    assert tiers.get("0", 0) > 5 and (ladder == "zero_only") == ("3" not in tiers), tiers
