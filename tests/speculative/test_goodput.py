"""Goodput policy (hyperdraft/speculative/adaptive/goodput.py): pure unit tests on synthetic acceptance and cost tables."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hyperdraft.speculative.adaptive.goodput import GoodputSlot, choose_tier, expected_tokens, goodput_slot_factory
from hyperdraft.speculative.adaptive.tier import Tier

CHAINS = [Tier(s) for s in (0, 1, 3, 5, 7)]


def linear_cost(c0, c1, c2):
    """True step seconds: c0 + c1 * verify tokens + c2 * draft forwards."""
    return lambda t, bs: c0 + c1 * bs * t.num_draft_tokens + c2 * t.steps


def run(slot, bs, accept, cost, n, noise=lambda i: 0.0):
    """Drive a slot for n steps; accept(tier, request, step) -> accepted drafts. Returns the tiers run, in order."""
    ran = []
    for i in range(n):
        t = slot.tier
        ran.append(t)
        slot.observe([accept(t, r, i) for r in range(bs)], bs, cost(t, bs) * (1 + noise(i)))
    return ran


# ---- expected_tokens ------------------------------------------------------------------------------------------------


def test_expected_tokens_exact():
    a = [1.0, 0.5, 0.5]
    assert expected_tokens(a, 0) == 1.0
    assert expected_tokens(a, 1) == pytest.approx(2.0)
    assert expected_tokens(a, 2) == pytest.approx(2.5)
    assert expected_tokens(a, 3) == pytest.approx(2.75)
    assert expected_tokens([0.8, 0.5], 2) == pytest.approx(1 + 0.8 + 0.4)


def test_expected_tokens_extrapolates_geometrically_with_cap():
    assert expected_tokens([0.8], 3) == pytest.approx(1 + 0.8 + 0.8**2 + 0.8**3)
    assert expected_tokens([1.0], 3) == pytest.approx(1 + 1 + 0.95 + 0.95**2)  # the carried rate is capped
    assert expected_tokens([0.9, 1.0], 3) == pytest.approx(1 + 0.9 + 0.9 + 0.9 * 0.95)
    assert expected_tokens([], 2) == pytest.approx(1 + 0.5 + 0.25)  # prior before any data


# ---- choose_tier ----------------------------------------------------------------------------------------------------


def test_choose_tier_argmax_and_hysteresis():
    a, b = Tier(1), Tier(3)
    E, cost = {a: 1.5, b: 2.2}, {a: 1.0, b: 1.4}  # goodput 1.5 vs 1.571: b is 4.8% better
    assert choose_tier([a, b], E, cost, a, 0.0) == b
    assert choose_tier([a, b], E, cost, a, 0.1) == a
    assert choose_tier([a, b], E, cost, b, 0.1) == b
    assert choose_tier([a, b], {a: 1.5, b: 3.0}, cost, a, 0.1) == b  # 43% better clears the margin
    assert choose_tier([b, a], {a: 2.0, b: 2.0}, {a: 1.0, b: 1.0}, Tier(5), 0.1) == a  # tie: the smaller tier


# ---- the slot on synthetic tables -----------------------------------------------------------------------------------


def test_high_acceptance_flat_cost_picks_deepest():
    slot = GoodputSlot(CHAINS, 3, explore_every=0)
    ran = run(slot, 1, lambda t, r, i: t.steps, linear_cost(0.010, 1e-6, 0.0005), 60)
    assert slot.tier == Tier(7) and ran[-20:] == [Tier(7)] * 20


def test_large_batch_steep_verify_cost_turns_speculation_off():
    slot = GoodputSlot(CHAINS, 3, explore_every=0)
    ran = run(slot, 64, lambda t, r, i: min(t.steps, (r + i) % 3), linear_cost(0.001, 0.001, 0.0005), 60)
    assert slot.tier == Tier(0) and ran[-20:] == [Tier(0)] * 20


def test_cheap_drafts_at_moderate_acceptance_pick_a_middle_tier():
    # a0 = 2/3, a1 = 1/2, a2 ~ 0: E(1) = 1.67, E(3) = 2.0; verify cost grows, so 1 step is the sweet spot
    slot = GoodputSlot(CHAINS, 3, explore_every=0)
    run(slot, 64, lambda t, r, i: min(t.steps, (r + i) % 3), linear_cost(0.010, 1e-4, 0.0005), 60)
    assert slot.tier == Tier(1)


def test_hysteresis_prevents_flapping_between_nearly_equal_tiers():
    # speculation off: 10 ms; 1 step with half the drafts accepted: E = 1.5 for 15 ms: equal goodput, +-5% noise
    def switches(h):
        slot = GoodputSlot([Tier(0), Tier(1)], 0, hysteresis=h, decide_every=1, warmup=0, explore_every=0)
        ran = run(slot, 4, lambda t, r, i: (r + i) % 2, lambda t, bs: 0.010 if t.steps == 0 else 0.015, 300,
                  noise=lambda i: -0.05 * (-1) ** (i // 10))
        return sum(x != y for x, y in zip(ran, ran[1:]))

    assert switches(0.0) >= 10  # without a margin the noise flips it back and forth
    assert switches(0.1) <= 1


def test_warmup_and_interval_respected():
    slot = GoodputSlot(CHAINS, 0, warmup=10, decide_every=4, explore_every=0)
    changed = [slot.observe([0] * 4, 4, 0.01) for _ in range(13)]
    assert changed == [False] * 13 and slot.tier == Tier(0)  # no decision before counted step 14
    assert slot.observe([0] * 4, 4, 0.01) is True  # the prior (a = 0.5, cheap drafts) favours 1 step
    assert slot.tier == Tier(1) and slot.decisions == 1


def test_empty_observations_ignored():
    slot = GoodputSlot(CHAINS, 3, warmup=0, decide_every=1, explore_every=0)
    before = slot.state()
    assert slot.observe([], 8, 123.0) is False
    assert slot.counted == 0 and slot.timed == {} and slot.state() == before


def test_exploration_visits_least_recently_run_tiers_then_returns():
    # a huge hysteresis: ordinary decisions never switch, so every move below is exploration or the return from it
    slot = GoodputSlot([Tier(0), Tier(1), Tier(3)], 1, hysteresis=100.0, decide_every=1, warmup=0, explore_every=2)
    ran = run(slot, 1, lambda t, r, i: t.steps, linear_cost(0.010, 1e-6, 0.004), 8)
    # never-run tiers are explored at once: decision 1 explores the one with fewest steps (0), 2 returns home, 3
    # explores the other (3), 4 returns; then every explore_every-th decision (6) the one run longest ago (0)
    assert ran == [Tier(1), Tier(0), Tier(1), Tier(3), Tier(1), Tier(1), Tier(0), Tier(1)]
    assert {t for (t, _) in slot.timed} == {Tier(0), Tier(1), Tier(3)}
    off = GoodputSlot([Tier(0), Tier(1), Tier(3)], 1, hysteresis=100.0, decide_every=1, warmup=0, explore_every=0)
    assert run(off, 1, lambda t, r, i: t.steps, linear_cost(0.010, 1e-6, 0.004), 8) == [Tier(1)] * 8


def run_with_switch_cost(slot, steady: dict, first: float, n: int) -> list:
    """Drive a one-request slot that accepts every draft for n steps; a step costs steady[tier], except the first
    step after a tier change, which costs `first` (under round-ahead it finds nothing queued). -> tiers run."""
    ran = []
    for _ in range(n):
        t = slot.tier
        cost = first if ran and ran[-1] != t else steady[t]
        ran.append(t)
        slot.observe([t.steps], 1, cost)
    return ran


def test_the_step_after_a_switch_is_not_timed():
    """It pays the switch, not the tier: the explored tier's cost is its steady steps' (exactly, at a constant)."""
    slot = GoodputSlot([Tier(0), Tier(3)], 0, decide_every=5, warmup=0, explore_every=10)
    ran = run_with_switch_cost(slot, {Tier(0): 0.010, Tier(3): 0.015}, first=0.200, n=40)
    assert ran[5:10] == [Tier(3)] * 5  # the first decision explores the never-run tier for one interval
    assert slot.timed[(Tier(3), 1)] == pytest.approx(0.015)
    assert slot.timed[(Tier(0), 1)] == pytest.approx(0.010)


def test_a_costly_switch_does_not_keep_speculation_off():
    """Drafts that always land (E(3) ~ 3.7) at 1.5x a plain step's cost are worth 2.5x plain's goodput, even when the
    first step after each switch costs 20 plain steps: timed, that step seeded tier 3's cost at 20x and the policy
    returned to step 0 after exploring it (goodput 0.4x plain)."""
    slot = GoodputSlot([Tier(0), Tier(3)], 0, decide_every=5, warmup=0, explore_every=50)
    ran = run_with_switch_cost(slot, {Tier(0): 0.010, Tier(3): 0.015}, first=0.200, n=60)
    assert slot.tier == Tier(3) and ran[-40:] == [Tier(3)] * 40


def test_a_host_hiccup_does_not_turn_a_paying_tier_off():
    """One step of tier 3 timed at 20x its cost (a GC pause, a descheduled thread) moves its EMA as a step of twice its
    cost would (1.2 -> 1.44 ms, not 5.76), so drafts worth 1.7x plain's goodput (one always lands: E = 2) keep running.
    Uncapped, that one step made step 0 look better at the next decision and the slot stayed there until exploration
    came back to tier 3, 250 steps later."""
    slot = GoodputSlot([Tier(0), Tier(3)], 3, decide_every=5, warmup=0, explore_every=50)
    cost = {Tier(0): 0.0010, Tier(3): 0.0012}
    ran = []
    for i in range(200):
        t = slot.tier
        ran.append(t)
        slot.observe([1], 1, cost[t] * (20 if i == 100 else 1))
    assert ran[100] == Tier(3)  # the hiccup hit a timed tier-3 step
    assert ran[101:].count(Tier(0)) == 0


def test_with_a_decision_every_step_every_step_is_timed():
    """decide_every 1: a tier may run one step at a time, so its switches are part of its cost."""
    slot = GoodputSlot([Tier(0), Tier(3)], 0, decide_every=1, warmup=0, explore_every=0)
    slot.observe([0], 1, 0.010)  # decides: the prior favours drafting, so the tier changes
    assert slot.tier == Tier(3)
    slot.observe([3], 1, 0.200)
    assert slot.timed[(Tier(3), 1)] == pytest.approx(0.200)


# ---- the acceptance model -------------------------------------------------------------------------------------------


def test_kaplan_meier_rates_exact():
    slot = GoodputSlot(CHAINS, 3, warmup=100)
    slot.observe([0, 1, 3, 3], 4)
    a0 = (3 + 0.5) / (4 + 1)  # 3 of 4 passed position 0; one pseudo-verify at the 0.5 prior
    a1 = (2 + a0) / (3 + 1)  # at risk: the 3 that accepted >= 1
    a2 = (2 + a1) / (2 + 1)
    assert slot.acceptance["chain"].rates() == pytest.approx([a0, a1, a2])
    assert slot.expected()[Tier(3)] == pytest.approx(1 + a0 + a0 * a1 + a0 * a1 * a2)


def test_positions_past_the_tier_are_unobserved_not_rejections():
    slot = GoodputSlot(CHAINS, 1, warmup=100)
    slot.observe([1, 1], 2)  # a tier of one draft: both accepted, nothing known of position 1
    rates = slot.acceptance["chain"].rates()
    assert len(rates) == 1 and rates[0] == pytest.approx((2 + 0.5) / 3)


def test_positions_the_drafter_left_empty_are_rejections():
    """At a 3-draft tier, a request that drafted one token (an n-gram match of one) and had it accepted gains no
    second token: position 1 counts it at risk and not passed, as a rejection."""
    slot = GoodputSlot(CHAINS, 3, warmup=100)
    slot.observe([1, 1], 2)
    assert slot.acceptance["chain"].at_risk == [2, 2, 0, 0, 0, 0, 0]
    assert slot.acceptance["chain"].passed == [2, 0, 0, 0, 0, 0, 0]


def test_a_drafter_that_never_drafts_is_turned_off():
    """Lookups that find nothing (n-gram drafting on chat) cost 1.3x a plain step and gain 1 token, as step 0 does
    for 1.0x: goodput must settle at step 0, not keep the 0.5 prior of positions it never saw drafted (it ran the
    deepest tier 2907 of 3000 steps when empty drafts were censored)."""
    slot = GoodputSlot([Tier(s) for s in (0, 1, 2, 3, 5)], 2)
    ran = run(slot, 1, lambda t, r, i: 0, lambda t, bs: 1.0 if t.steps == 0 else 1.3, 3000)
    assert sum(t.steps == 0 for t in ran[-1000:]) >= 950  # only the periodic exploration leaves step 0
    assert slot.expected()[Tier(5)] < 1.1


def test_unobserved_positions_extrapolated():
    slot = GoodputSlot(CHAINS, 1, warmup=1000)
    run(slot, 2, lambda t, r, i: 1, linear_cost(0.01, 0, 0), 20)  # only position 0 observed: always accepted
    rates = slot.acceptance["chain"].rates()
    assert len(rates) == 1 and rates[0] == pytest.approx((40 + 0.5) / 41)
    E = slot.expected()
    a, c = rates[0], 0.95
    assert E[Tier(0)] == 1.0 and E[Tier(1)] == pytest.approx(1 + a)
    assert E[Tier(3)] == pytest.approx(1 + a + a * c + a * c * c)
    assert E[Tier(7)] == pytest.approx(1 + sum(a * c**k for k in range(7)))


def test_window_forgets_old_steps():
    slot = GoodputSlot(CHAINS, 1, window=5, warmup=1000)
    run(slot, 1, lambda t, r, i: 1, linear_cost(0.01, 0, 0), 10)
    run(slot, 1, lambda t, r, i: 0, linear_cost(0.01, 0, 0), 5)  # the last 5 steps: all rejected
    assert slot.acceptance["chain"].rates() == pytest.approx([0.5 / 6])


def test_untimed_untried_tree_counts_as_its_chain_and_loses_to_it():
    chain3, tree3 = Tier(3), Tier(3, 4, 8)
    slot = GoodputSlot([Tier(1), chain3, tree3], 3, decide_every=1, warmup=0, explore_every=0)
    run(slot, 4, lambda t, r, i: t.steps, linear_cost(0.010, 1e-4, 0.001), 3)
    E = slot.expected()
    assert E[tree3] == pytest.approx(E[chain3])  # no branching bonus until measured
    assert slot.costs(4)[tree3] > slot.costs(4)[chain3] and slot.tier == chain3


def test_tree_counts_positions_to_its_depth():
    tree = Tier(2, 2, 5)
    slot = GoodputSlot([Tier(1), tree], 2, warmup=100)
    slot.observe([2, 1], 2)  # a tree of depth 2: no positions 2, 3 to reject
    assert slot.acceptance[(2, 5)].at_risk == [2, 2] and slot.acceptance[(2, 5)].passed == [2, 1]
    assert "chain" in slot.acceptance and slot.acceptance["chain"].at_risk == [0, 0]  # trees keep their own counts


# ---- the cost model -------------------------------------------------------------------------------------------------


def test_cost_fit_recovers_linear_model_and_predicts_untimed_tier():
    truth = linear_cost(0.010, 2e-4, 0.002)
    slot = GoodputSlot(CHAINS, 0, warmup=10**6)
    for t, bs in [(Tier(0), 1), (Tier(0), 16), (Tier(1), 4), (Tier(3), 8), (Tier(1), 16), (Tier(3), 2)]:
        slot._tier = t  # place the slot; observe() times the tier it holds
        slot.observe([0] * bs, bs, truth(t, bs))
    c = slot.fit()
    assert c == pytest.approx([0.010, 2e-4, 0.002], rel=0.1)
    assert slot.costs(12)[Tier(7)] == pytest.approx(truth(Tier(7), 12), rel=0.05)  # never timed
    assert slot.costs(16)[Tier(0)] == pytest.approx(truth(Tier(0), 16))  # timed exactly: its EMA


def test_prior_cost_before_any_timing():
    slot = GoodputSlot(CHAINS, 3, draft_cost_ratio=0.25, ridge_tokens=64)
    cost = slot.costs(16)
    assert cost[Tier(0)] == pytest.approx(1 + 16 / 64)
    assert cost[Tier(3)] == pytest.approx(1 + 64 / 64 + 0.75)


def test_timed_tier_moved_to_another_batch_size_along_the_fit():
    slot = GoodputSlot([Tier(0), Tier(1)], 1, warmup=10**6)
    slot.observe([1] * 8, 8, 0.020)
    c = slot.fit()
    moved = slot.costs(10)[Tier(1)]
    assert moved == pytest.approx(0.020 + c[1] * 2 * (10 - 8)) and moved > 0.020


# ---- construction and the controller's factory ----------------------------------------------------------------------


def test_start_tier_and_validation():
    assert GoodputSlot(CHAINS, 5).tier == Tier(5)
    assert GoodputSlot(CHAINS, 2).tier == Tier(3)  # not a candidate: the middle
    assert GoodputSlot([Tier(0)], 0).tier == Tier(0)
    for bad in ({"hysteresis": -0.1}, {"window": 0}, {"decide_every": 0}, {"ridge_tokens": 0}):
        with pytest.raises(ValueError):
            GoodputSlot(CHAINS, 3, **bad)


def test_factory_passes_goodput_options_and_rejects_unknown_keys():
    cfg = SimpleNamespace(goodput={"hysteresis": 0.2, "window": 16})
    slot = goodput_slot_factory(cfg)(1, SimpleNamespace(tiers=(Tier(1), Tier(3))), 3)
    assert slot.tier == Tier(3) and slot.hysteresis == 0.2 and slot.tiers == [Tier(1), Tier(3)]
    with pytest.raises(ValueError, match="unknown keys"):
        goodput_slot_factory(SimpleNamespace(goodput={"ema_alpha": 0.5}))
    for bad in ({"window": 0}, {"window": "64"}):
        with pytest.raises(ValueError):
            goodput_slot_factory(SimpleNamespace(goodput=bad))


def test_runs_under_the_adaptive_controller():
    from hyperdraft.speculative.adaptive.config import load_adaptive_config
    from hyperdraft.speculative.adaptive.controller import AdaptiveController

    cfg = load_adaptive_config({"strategy": "goodput", "goodput": {"warmup": 0, "decide_every": 1, "explore_every": 0},
                                "1": {"candidate_steps": [1, 3]}, "8": {"candidate_steps": [0, 1]}})
    ctl = AdaptiveController(cfg, 1, slot_factory=goodput_slot_factory(cfg))
    for _ in range(10):  # every draft accepted, flat cost: the bs-1 slot deepens; the bs-8 slot is untouched
        t = ctl.tier_for(1)
        ctl.observe(1, [t.steps], step_seconds=0.01 + 0.001 * t.steps)
    assert ctl.tier_for(1) == Tier(3) and ctl.slots[8].counted == 0
    assert ctl.state()["1"]["tier"] == "3"
