"""Adaptive speculation policy: SGLang's test_adaptive_spec_params.py cases ported 1:1 (reference section 5), plus
the hyperdraft extensions (tier objects, strategy, goodput pass-through) and config loading. Pure: no model."""

from __future__ import annotations

import json
import logging
import re

import pytest

from hyperdraft.speculative.adaptive.config import (DEFAULT_ADAPTIVE_CONFIG, AdaptiveConfig, SlotConfig,
                                                    load_adaptive_config, resolve_initial_steps)
from hyperdraft.speculative.adaptive.controller import AdaptiveController
from hyperdraft.speculative.adaptive.ema import EmaSlot
from hyperdraft.speculative.adaptive.tier import Tier


def slot(start: int, ladder=(1, 3, 7), **overrides) -> EmaSlot:
    """SGLang's unit-test setup: alpha 1.0, warmup 0, interval 1, default hysteresis, built through the loader."""
    cfg = {"ema_alpha": 1.0, "warmup_batches": 0, "update_interval": 1, **overrides}
    return EmaSlot(load_adaptive_config({"1": {"candidate_steps": list(ladder), **cfg}}).slots[0][1], start)


def ladders(cfg: AdaptiveConfig) -> dict[int, list[int]]:
    return {k: s.candidate_steps for k, s in cfg.slots}


# ---- SGLang's slot cases -------------------------------------------------------------------------------------------


def test_initial_snaps_to_middle():
    s = slot(2)
    assert (s.steps, s.ema, s.counted) == (3, 2.0, 0)


def test_warmup_and_interval():
    s = slot(3, warmup_batches=1, update_interval=2)
    assert s.observe([0, 0]) is False
    assert s.observe([0, 0]) is False and s.steps == 3
    assert s.observe([0, 0]) is True and s.steps == 1


def test_empty_batches_ignored():
    s = slot(3, warmup_batches=1)
    assert s.observe([]) is False and (s.ema, s.counted) == (2.0, 0)
    assert s.observe([0, 0]) is False
    assert s.observe([0, 0]) is True and s.steps == 1


def test_scale_up_across_tiers():
    s = slot(1, up_hysteresis=0.0)
    assert s.observe([1, 1]) is True and s.steps == 3
    assert s.observe([3, 3]) is True and s.steps == 7


def test_multi_tier_drop():
    s = slot(7)
    assert s.observe([0, 0]) is True and s.steps == 1


def test_exact_rise_threshold_is_strict():
    s = slot(3, up_hysteresis=0.0)
    assert s.observe([2, 3]) is False and s.ema == 2.5 and s.steps == 3
    assert s.observe([3, 3]) is True and s.steps == 7


def test_exact_drop_threshold_is_inclusive():
    s = slot(3, down_hysteresis=0.0, up_hysteresis=0.5)
    assert s.observe([0, 1]) is True and s.ema == 0.5 and s.steps == 1


def test_up_hysteresis():
    s = slot(3, up_hysteresis=0.75)
    assert s.observe([3, 3]) is False and s.steps == 3
    assert s.observe([4, 4]) is True and s.steps == 7


def test_down_hysteresis():
    s = slot(7, down_hysteresis=-0.75)
    assert s.observe([2, 2]) is False and s.steps == 7
    assert s.observe([1, 1]) is True and s.steps == 3


def test_ramp_up_then_down():
    s = slot(3, ema_alpha=0.5, up_hysteresis=0.0, down_hysteresis=0.0)
    assert s.observe([4, 4]) is True and (s.steps, s.ema) == (7, 3.0)
    assert s.observe([0, 0]) is True and (s.steps, s.ema) == (3, 1.5)
    assert s.observe([0, 0]) is False and (s.steps, s.ema) == (3, 0.75)
    assert s.observe([0, 0]) is True and (s.steps, s.ema) == (1, 0.375)


def test_zero_step_slot():
    s = slot(3, ladder=(0, 3), down_hysteresis=0.0)
    assert s.observe([0, 0]) is True and (s.steps, s.ema) == (0, 0.0)
    assert s.observe([3, 3]) is True and (s.steps, s.ema) == (3, 0.0)  # blind probe; the EMA was frozen at 0
    assert s.observe([0, 0]) is True and s.steps == 0


def test_ceiling():
    s = slot(7, ceiling_coeff=1.0)
    assert s.observe([1, 1]) is True and s.ema == 1.0 and s.steps == 1  # the ladder alone gives 3; the cap is 1
    no_cap = slot(7)
    assert no_cap.observe([1, 1]) is True and no_cap.steps == 3  # control: without the ceiling it stops at 3


def test_ceiling_default_is_off():
    assert all(s.ceiling_coeff == 0 for _, s in load_adaptive_config(None).slots)
    assert load_adaptive_config({"1": [1, 3]}).slots[0][1].ceiling_coeff == 0


# ---- SGLang's config and routing cases -----------------------------------------------------------------------------


def test_default_config_loads():
    cfg = load_adaptive_config(None)
    assert ladders(cfg) == {1: [1, 3, 5, 7], 8: [0, 1, 3], 32: [0, 1], 64: [0]}
    assert cfg.strategy == "ema" and cfg.goodput == {}
    s1, s8 = cfg.slots[0][1], cfg.slots[1][1]
    assert (s1.ema_alpha, s1.warmup_batches, s1.update_interval) == (0.2, 10, 5)
    assert (s1.up_hysteresis, s1.down_hysteresis, s8.down_hysteresis) == (0.0, -0.25, 0.0)
    st = AdaptiveController(cfg, 3).state()
    assert {k: (v["steps"], v["ema"]) for k, v in st.items()} == {"1": (3, 2.0), "8": (3, 2.0), "32": (1, 0.0),
                                                                  "64": (0, -1.0)}


def test_config_file(tmp_path):
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps({"1": {"candidate_steps": [1, 5], "up_hysteresis": 0.3},
                                "32": {"candidate_steps": [1, 2]}}))
    cfg = load_adaptive_config(str(path))
    assert [k for k, _ in cfg.slots] == [1, 32] and ladders(cfg)[32] == [1, 2]
    s1 = cfg.slots[0][1]
    assert s1.up_hysteresis == 0.3 and cfg.slots[1][1].up_hysteresis == 0.0
    assert AdaptiveController(cfg, 5).tier_for(1) == Tier(5)


def test_flag_not_injected():
    cfg = load_adaptive_config({"1": [1, 5], "8": [1, 3, 7]})
    ctl = AdaptiveController(cfg, resolve_initial_steps(cfg, 7))
    assert ladders(cfg) == {1: [1, 5], 8: [1, 3, 7]}
    assert ctl.tier_for(1).steps == 5 and ctl.tier_for(8).steps == 7


@pytest.mark.parametrize("bad", [{"not_a_bs": "bad"}, {"1": {"candidate_steps": "bad"}},
                                 {"1": {"candidate_steps": []}}])
def test_invalid_configs(bad):
    with pytest.raises(ValueError):
        load_adaptive_config(bad)


def test_invalid_config_messages():
    with pytest.raises(ValueError, match=r"^speculative_adaptive_config must contain at least one integer-string BS "
                                         r"key, e\.g\. \{\"1\": \{\"candidate_steps\": \[1,3,7\]\}\}\. Got keys: "
                                         r"\['not_a_bs'\]$"):
        load_adaptive_config({"not_a_bs": "bad"})
    for v, shown in [("bad", "bad"), ([], r"\[\]"), ([1, -1], r"\[1, -1\]"), ([1, 2.5], r"\[1, 2\.5\]"),
                     ([True], r"\[True\]"), (None, "None")]:
        msg = rf"^BS 8: candidate_steps must be a list of non-negative ints or tier objects \{{.*\}}, got {shown}$"
        with pytest.raises(ValueError, match=msg):
            load_adaptive_config({"1": [1], "8": {"candidate_steps": v}})
    with pytest.raises(ValueError, match="^BS 1: candidate_steps must be a list"):
        load_adaptive_config({"1": {"up_hysteresis": 0.1}})  # candidate_steps is required


def test_global_hysteresis_inherited():
    cfg = load_adaptive_config({"up_hysteresis": 0.5, "1": {"candidate_steps": [1, 3]}, "8": [1]})
    assert [s.up_hysteresis for _, s in cfg.slots] == [0.5, 0.5]


def test_slot_overrides_global():
    cfg = load_adaptive_config({"up_hysteresis": 0.5, "1": {"candidate_steps": [1, 3], "up_hysteresis": 0.1}})
    assert cfg.slots[0][1].up_hysteresis == 0.1


def test_floor_routing_without_graphs():
    ctl = AdaptiveController(load_adaptive_config(None), 3)
    assert [ctl.route(bs) for bs in (1, 7, 8, 31, 32, 1000)] == [1, 1, 8, 8, 32, 64]


def test_graph_padding():
    ctl = AdaptiveController(load_adaptive_config(None), 3, [16, 4, 32, 8])
    assert [ctl.route(bs) for bs in (5, 17, 100)] == [8, 32, 64]
    assert [ctl.route(bs) for bs in (1, 4, 8, 9, 33)] == [1, 1, 8, 8, 32]
    assert ctl.tier_for(5) == Tier(3) and ctl.tier_for(17) == Tier(1)  # 5 pads to 8, 17 to 32


def test_graph_pruning():
    ctl = AdaptiveController(load_adaptive_config(None), 3, [4, 8, 16, 32])
    assert ctl.graph_sizes_for_steps(1) == [4, 8, 16, 32]
    assert ctl.graph_sizes_for_steps(3) == [4, 8, 16]
    assert ctl.graph_sizes_for_steps(5) == ctl.graph_sizes_for_steps(7) == [4]
    assert ctl.graph_sizes_for_steps(0) == [8, 16, 32]


def test_pruning_disabled_without_graphs():
    cfg = load_adaptive_config(None)
    assert AdaptiveController(cfg, 3).graph_sizes_for_steps(3) is None
    assert AdaptiveController(cfg, 3, None).graph_sizes_for_steps(1) is None


def test_feeds_routed_slot_only():
    ctl = AdaptiveController(load_adaptive_config(None), 3)
    for _ in range(40):
        ctl.observe(1, [7, 7, 7])
    assert ctl.tier_for(1).steps > 1 and ctl.tier_for(32).steps == 1
    st = ctl.state()
    assert st["1"]["counted"] == 40 and st["8"]["counted"] == st["32"]["counted"] == 0 and st["32"]["ema"] == 0.0


def test_candidate_union():
    assert [t.steps for t in load_adaptive_config(None).candidate_union()] == [0, 1, 3, 5, 7]
    assert [t.steps for t in load_adaptive_config({"1": [2, 4]}).candidate_union()] == [2, 4]
    assert [t.steps for t in load_adaptive_config({"1": [1, 5], "8": [3, 5, 7]}).candidate_union()] == [1, 3, 5, 7]


# ---- policy details beyond SGLang's table --------------------------------------------------------------------------


def test_ema_frozen_at_step_zero_and_probe_from_minus_one():
    s = slot(0, ladder=(0, 1), warmup_batches=0, update_interval=3)
    assert s.ema == -1.0
    assert s.observe([5]) is False and s.observe([5]) is False and s.ema == -1.0 and s.counted == 2
    assert s.observe([5]) is True and (s.steps, s.ema) == (1, 0.0)  # probe resets the neutral EMA for step 1


def test_single_zero_rung_probe_stays():
    s = slot(0, ladder=(0,))
    assert s.observe([3]) is False and s.steps == 0 and s.ema == -1.0


def test_rise_only_if_nothing_dropped():
    s = slot(3, down_hysteresis=3.0, up_hysteresis=0.0)  # ema 3.0 passes both the drop (<= 3.5) and rise (> 2.5) tests
    assert s.observe([3, 3]) is True and s.steps == 1


def test_ceiling_never_blocks_a_rise_but_caps_a_stay():
    rise = slot(3, ceiling_coeff=0.5, up_hysteresis=0.0)
    assert rise.observe([3, 3]) is True and rise.steps == 7  # cap ceil(1.5) = 2, but 7 is a rise
    stay = slot(3, ceiling_coeff=0.5)
    assert stay.observe([2, 2]) is True and stay.steps == 1  # ladder stays at 3; cap ceil(1.0) = 1


def test_extra_observe_keywords_are_ignored_by_ema_slot():
    s = slot(7)
    assert s.observe([0, 0], batch_size=2, step_seconds=0.01) is True and s.steps == 1


def test_controller_returns_switch_and_logs(caplog):
    ctl = AdaptiveController(load_adaptive_config({"1": [1, 3, 7], "ema_alpha": 1.0, "warmup_batches": 0,
                                                   "update_interval": 1}), 3)
    assert ctl.observe(2, [2, 2]) is None
    with caplog.at_level(logging.INFO, logger="hyperdraft"):
        assert ctl.observe(2, [0, 0]) == (Tier(3), Tier(1))
    # SGLang's wording, ema_accept_len included (log scrapers key on it)
    assert "Adaptive spec params updated: steps 3 -> 1 (ema_accept_len=0.00, bs slot=1)" in caplog.text
    assert ctl.tier_for(2) == Tier(1)


def test_pluggable_slot_factory_gets_keywords():
    seen = []

    class Fixed:
        def __init__(self, key, cfg, start):
            self.tier, self.key = cfg.tiers[-1], key

        def observe(self, accepted_drafts, **kw):
            seen.append((self.key, accepted_drafts, kw))
            self.tier = Tier(1)

        def state(self):
            return {"steps": self.tier.steps}

    ctl = AdaptiveController(load_adaptive_config({"1": [1, 3], "8": [1, 5]}), 3, slot_factory=Fixed)
    assert ctl.tier_for(9) == Tier(5)
    assert ctl.observe(9, [1], step_seconds=0.5) == (Tier(5), Tier(1))
    assert seen == [(8, [1], {"batch_size": 9, "step_seconds": 0.5})]  # the batch size is forwarded
    assert ctl.state() == {"1": {"steps": 3}, "8": {"steps": 1}}


# ---- hyperdraft extensions and validation --------------------------------------------------------------------------


def test_tier_objects_in_candidate_steps():
    cfg = load_adaptive_config({"1": [{"steps": 5, "topk": 4, "num_draft_tokens": 8}, 1, {"steps": 3}],
                                "8": [0, {"steps": 2, "topk": 2, "num_draft_tokens": 4}]})
    assert cfg.slots[0][1].tiers == (Tier(1), Tier(3), Tier(5, 4, 8))
    assert cfg.slots[1][1].tiers == (Tier(0), Tier(2, 2, 4))
    assert cfg.max_reserve_tokens() == 17  # Tier(5, 4, 8): the draft feeds 1 + (5-1)*4 nodes, more than its 8
    s = slot(3, ladder=(1, 3, {"steps": 7, "topk": 2, "num_draft_tokens": 10}), up_hysteresis=0.0)
    assert s.observe([3, 3]) is True and s.tier == Tier(7, 2, 10)  # decisions use tier.steps


@pytest.mark.parametrize("item", [{"steps": 3, "topk": 2}, {"steps": -1}, {"topk": 2}, {"steps": 3, "width": 2},
                                  {"steps": 2, "topk": 2, "num_draft_tokens": 99}, {"steps": "3"}])
def test_bad_tier_objects(item):
    with pytest.raises(ValueError, match="^BS 1: candidate_steps must be a list of non-negative ints"):
        load_adaptive_config({"1": [1, item]})


def test_int_candidates_take_the_flag_tree_shape():
    cfg = load_adaptive_config({"1": [0, 1, 3, 5]}, default_topk=4, default_num_draft_tokens=8)
    assert cfg.slots[0][1].tiers == (Tier(0), Tier(1, 4, 5), Tier(3, 4, 8), Tier(5, 4, 8))  # 1x4 holds at most 5
    assert load_adaptive_config({"1": [3]}, default_topk=2).slots[0][1].tiers == (Tier(3, 2, 4),)
    assert load_adaptive_config({"1": [3]}, default_topk=1, default_num_draft_tokens=9).slots[0][1].tiers == (Tier(3),)


def test_duplicate_steps_rejected_but_identical_ints_collapse():
    with pytest.raises(ValueError, match="^BS 1: candidate_steps holds two tiers with steps=3"):
        load_adaptive_config({"1": [1, 3, {"steps": 3, "topk": 2, "num_draft_tokens": 4}]})
    assert ladders(load_adaptive_config({"1": [3, 1, 3]})) == {1: [1, 3]}  # SGLang de-duplicates plain ints


def test_strategy_and_goodput_globals():
    goodput = {"window": 20, "nested": {"a": 1}}
    cfg = load_adaptive_config({"strategy": "goodput", "goodput": goodput, "1": [1, 3]})
    assert cfg.strategy == "goodput" and cfg.goodput == goodput
    assert load_adaptive_config({"strategy": "ema", "1": [1]}).strategy == "ema"
    # SGLang 0.5.23 ignores the key, so a config written for a later SGLang runs its EMA policy
    assert load_adaptive_config({"strategy": "throughput_aware", "1": [1, 3]}).strategy == "ema"
    for bad in ("EMA", None, 1):
        with pytest.raises(ValueError, match=rf"^speculative_adaptive_config: 'strategy' must be 'ema' or 'goodput', "
                                             rf"got {re.escape(repr(bad))}$"):
            load_adaptive_config({"strategy": bad, "1": [1, 3]})
    with pytest.raises(ValueError, match="'goodput' must be a JSON object"):
        load_adaptive_config({"goodput": [1], "1": [1]})


@pytest.mark.parametrize("raw", [[1, 3, 7], "[1, 3]", 3, None])
def test_non_object_json_rejected(tmp_path, raw):
    path = tmp_path / "c.json"
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    with pytest.raises(ValueError, match="^speculative_adaptive_config must be a JSON object$"):
        load_adaptive_config(str(path))
    if not isinstance(raw, str):
        with pytest.raises(ValueError, match="must be a JSON object"):
            load_adaptive_config(raw if raw is not None else [])


def test_inline_json_equals_the_same_file(tmp_path):
    text = '{"strategy": "goodput", "1": [1, 3], "32": {"candidate_steps": [0, 1]}}'
    path = tmp_path / "c.json"
    path.write_text(text)
    assert load_adaptive_config("  " + text) == load_adaptive_config(str(path))
    with pytest.raises(ValueError, match=r"^speculative_adaptive_config: '.*c2\.json' is not valid JSON"):
        (tmp_path / "c2.json").write_text("{1: [1]}")
        load_adaptive_config(str(tmp_path / "c2.json"))


def test_json_file_with_globals_and_bare_lists(tmp_path):
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(DEFAULT_ADAPTIVE_CONFIG))
    assert load_adaptive_config(str(path)) == load_adaptive_config(None)
    path.write_text('{"warmup_batches": 2, "1": [7, 1], "16": {"candidate_steps": [0, 2], "warmup_batches": 4}}')
    cfg = load_adaptive_config(str(path))
    assert ladders(cfg) == {1: [1, 7], 16: [0, 2]}
    assert [s.warmup_batches for _, s in cfg.slots] == [2, 4]


def test_bad_policy_numbers_rejected():
    for extra in ({"ema_alpha": -0.1}, {"ema_alpha": 1.5}, {"update_interval": 0}, {"warmup_batches": -1},
                  {"ema_alpha": "x"}):
        with pytest.raises(ValueError, match="^BS 1: "):
            load_adaptive_config({"1": {"candidate_steps": [1, 3], **extra}})


def test_policy_numbers_sglang_gives_a_meaning_are_accepted():
    """ema_alpha 0: the EMA stays where it starts, so the tier never moves; ceiling_coeff <= 0: no ceiling (SGLang's
    `if ceiling_coeff > 0`). Both were refused."""
    frozen = slot(3, ema_alpha=0.0, warmup_batches=0, update_interval=1)
    for _ in range(20):
        frozen.observe([0, 0])
    assert frozen.steps == 3
    no_ceiling = load_adaptive_config({"1": {"candidate_steps": [1, 3], "ceiling_coeff": -1}}).slots[0][1]
    assert no_ceiling.ceiling_coeff == -1


def test_max_reserve_tokens_of_default_config():
    cfg = load_adaptive_config(None)
    assert cfg.max_reserve_tokens() == Tier(7).reserve_tokens == 8
    assert load_adaptive_config({"1": [1, 3]}).max_reserve_tokens() == 4


def test_resolve_initial_steps():
    cfg = load_adaptive_config(None)
    assert resolve_initial_steps(cfg, None) == 3
    assert resolve_initial_steps(load_adaptive_config({"1": [1, 5], "8": [3, 5, 7]}), None) == 5
    assert resolve_initial_steps(cfg, 0) == 0 and resolve_initial_steps(cfg, 7) == 7
    with pytest.raises(ValueError, match=r"^--speculative-num-steps=4 is not in the adaptive config candidate_steps "
                                         r"\[0, 1, 3, 5, 7\]\. Pass one of those values\.$"):
        resolve_initial_steps(cfg, 4)


def test_config_is_frozen():
    cfg = load_adaptive_config(None)
    with pytest.raises(AttributeError):
        cfg.strategy = "goodput"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        cfg.slots[0][1].ema_alpha = 1.0  # type: ignore[misc]
    assert isinstance(cfg.slots[0][1], SlotConfig)


def test_ceiling_cap_is_at_least_one():
    s = slot(3, ladder=(0, 1, 3), ceiling_coeff=1.0, down_hysteresis=-1.0)  # ema 0 drops nothing; ceil(0) = 0
    assert s.observe([0, 0]) is True and s.steps == 1


def test_route_below_every_key_takes_the_first_slot():
    ctl = AdaptiveController(load_adaptive_config({"4": [1, 3], "16": [1]}), 3, [2, 8])
    assert [ctl.route(bs) for bs in (1, 2, 3, 4, 9, 16)] == [4, 4, 4, 4, 4, 16]  # 3 pads to 8; 9 and 16 exceed all


def test_reserved_globals_are_not_slot_keys(caplog):
    with caplog.at_level(logging.WARNING, logger="hyperdraft"):
        load_adaptive_config({"strategy": "goodput", "goodput": {"w": 1}, "1": [1, 3]})
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING, logger="hyperdraft"):
        load_adaptive_config({"up_hysterisis": 0.5, "1": [1, 3]})  # a typo: ignored like SGLang, but said
    assert "ignoring unknown keys ['up_hysterisis']" in caplog.text


def test_a_config_without_the_flag_is_ignored_with_a_warning(caplog):
    """SGLang reads --speculative-adaptive-config only under --speculative-adaptive; it was an error here."""
    from hyperdraft.config import EngineArgs
    from hyperdraft.speculative.config import resolve_spec_config

    spec = resolve_spec_config(EngineArgs(speculative_algorithm="NGRAM", speculative_num_steps=3,
                                          speculative_adaptive_config='{"1": [1, 3]}'))
    assert spec.adaptive is None and spec.tier == Tier(3)
    assert "speculative_adaptive_config is ignored: speculative_adaptive is off" in caplog.text


def test_a_non_ascii_digit_key_is_a_global_not_a_slot(caplog):
    """"²" is a digit to str.isdigit but not to int(): it was a slot key that failed to parse, naming nothing."""
    cfg = load_adaptive_config({"1": [1, 3], "²": [5]})
    assert ladders(cfg) == {1: [1, 3]}
    assert "ignoring unknown keys ['²']" in caplog.text
