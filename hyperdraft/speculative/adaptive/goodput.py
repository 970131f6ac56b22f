"""Goodput policy for adaptive speculation: each batch-size slot runs the tier with the most expected tokens per second,
goodput(tier) = batch_size * E(tier) / cost(batch_size, tier), both learned online. Pure bookkeeping, no engine code.

E(tier): tokens a request gains per verify, bonus included. Past the depth a tier offered, positions are censored,
not rejected, so the estimate is Kaplan-Meier: at position j, at_risk = verifies whose tier was deeper than j and that
accepted at least j, passed = those that accepted more than j; a_j = passed / at_risk (conditional acceptance), and
E(s) = 1 + sum_{j<s} prod_{i<=j} a_i. Each rate is shrunk by one pseudo-verify towards its prior (0.5 at position 0,
min(a_{j-1}, 0.95) after); positions never observed continue geometrically at min(last rate, 0.95). Chains share one
estimate (a chain's position j does not depend on how deep it goes). A tree (topk > 1) keeps its own estimate of its
accepted depth, shrunk towards the chain's rates, so an unmeasured tree counts as the chain of its depth: no bonus for
branching until measured (conservative). Steps 0: E = 1. Estimates cover the last `window` steps run at a tier
above 0.
Below its tier's depth, a position the drafter left empty counts as a rejection: the round gains no token there. An
n-gram lookup drafts only as far as its match (often nothing, on chat), and censoring those positions instead kept a
drafter that never drafted at the prior's 0.5: in a synthetic run of 3000 steps whose lookups found nothing and cost
1.3x a plain step, goodput sat at the deepest tier for 2907 of them, 1 token a step at 1.3x the cost
(tests/speculative/test_goodput.py holds it to step 0 now).
A verify narrowed by a full pool (a lone request, scheduler.py) counts its missing positions the same way: rare, and
only pessimistic.

cost(bs, tier), seconds per step: the EMA of steps timed at exactly (tier, bs); else that tier's nearest timed batch
size moved along the linear fit; else the fit. Fit: cost = c0 + c1 * bs * num_draft_tokens + c2 * steps (verify
tokens, draft forwards), least squares over every (tier, bs) EMA, ridge-regularised (0.01 of a data point) towards the
prior T * (1 + verify_tokens / ridge_tokens + draft_cost_ratio * steps): a draft forward costs draft_cost_ratio of a
target step; verify cost is flat well below ridge_tokens and linear well above. T, the time scale, is fit to the data
(1 before any timing, when only ratios matter). A timing above OUTLIER_CAP times its tier's EMA enters the EMA as
OUTLIER_CAP times it: a spike moves a cost by 20% at most, where a 20x spike alone had quintupled it.

The first step after a tier change is not timed when the tier then runs for more steps (decide_every > 1): it pays
the switch, not the tier. Under draft-ahead and round-ahead the step before queued the next round for the old tier;
the new tier's first step finds nothing queued and runs its draft, verify and bookkeeping one after another. Timed,
that cold step seeded a tier's first cost (the EMA's start): NGRAM on code edits (H200, batch 1, one call, two trees
in turns) ran at 0.97-1.23x plain against fixed chain 4's 1.35-1.58x, and with the step untimed at 1.44-1.46x
against 1.54-1.57x (benchmarks/results/ngram_ahead_h200.md). For the same reason the worker times neither a step
that runs prefill chunks nor the step after one (speculative/worker.py): nothing was queued ahead for it.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from hyperdraft.speculative.adaptive.tier import Tier

PRIOR_RATE = 0.5  # acceptance assumed at position 0 before any data (optimistic: invites a deeper tier to be measured)
EXTRAPOLATION_CAP = 0.95  # a rate carried past the last observed position never exceeds this
SHRINK = 1.0  # pseudo-verifies pulling each observed rate towards its prior
COST_ALPHA = 0.2  # EMA weight of the newest timing of a (tier, batch size)
# A step timed at more than this many times its tier's EMA (a GC pause, a descheduled thread) counts as this many: one
# spike no longer makes a paying tier look worse than step 0 until exploration returns to it. On synthetic hosts with
# 1-3% spikes of 5-20x, the policy kept 0.907-0.942 of the best tier's tokens/s uncapped and 0.958-0.983 capped;
# steady and drifting hosts are unchanged (benchmarks/probes/goodput_sim.py, results/goodput_sim.md).
OUTLIER_CAP = 2.0
RIDGE = 0.01  # weight of the cost prior in the fit, in data points: it only settles what the data leaves open


def expected_tokens(acceptance_by_position: list[float], steps: int) -> float:
    """Tokens per verify of a chain of `steps` drafts, bonus included: 1 + sum_{j<steps} prod_{i<=j} a_i, where
    a_i = P(draft i accepted | drafts 0..i-1 accepted). Positions past the list take min(last, 0.95); no list: 0.5."""
    e, survive, rate = 1.0, 1.0, PRIOR_RATE
    for j in range(steps):
        if j < len(acceptance_by_position):
            rate = acceptance_by_position[j]
        elif j == len(acceptance_by_position) and j > 0:
            rate = min(rate, EXTRAPOLATION_CAP)
        survive *= rate
        e += survive
    return e


def choose_tier(tiers: list[Tier], E: dict, cost: dict, current: Tier, hysteresis: float) -> Tier:
    """The tier of most E/cost (ties: the smaller tier), unless it beats `current` by no more than the relative
    margin `hysteresis`; then `current`. Batch size multiplies every goodput alike, so it is left out."""
    best = max(sorted(tiers), key=lambda t: E[t] / cost[t])  # max keeps the first of equals: the smallest tier
    if current not in E or best == current:
        return best
    return best if E[best] / cost[best] > (1 + hysteresis) * E[current] / cost[current] else current


class _Acceptance:
    """Kaplan-Meier counts per draft position over the last `window` steps run at a tier above 0."""

    def __init__(self, positions: int, window: int):
        self.at_risk, self.passed = [0] * positions, [0] * positions
        self.recent: deque = deque()
        self.window = window

    def add(self, accepted: list[int], depth: int) -> None:
        """One step's verifies (at least one) of a tier `depth` >= 1 deep: accepted drafts per request."""
        at_risk, passed = [0] * len(self.at_risk), [0] * len(self.at_risk)
        for a in accepted:
            a = max(0, min(a, depth))
            for j in range(min(a + 1, depth)):  # offered more than j, accepted at least j
                at_risk[j] += 1
                passed[j] += a > j
        self.recent.append((at_risk, passed))
        self._sum(at_risk, passed, 1)
        if len(self.recent) > self.window:
            self._sum(*self.recent.popleft(), -1)

    def _sum(self, at_risk, passed, sign):
        for j in range(len(at_risk)):
            self.at_risk[j] += sign * at_risk[j]
            self.passed[j] += sign * passed[j]

    def rates(self, base: list[float] | None = None) -> list[float]:
        """Observed conditional rates, shrunk towards base[j] (given) or the geometric prior; stops at the first
        position with nobody at risk (the rest is expected_tokens' extrapolation, or `base` for a tree)."""
        out: list[float] = []
        for j, (n, k) in enumerate(zip(self.at_risk, self.passed)):
            if n == 0:
                break
            prior = _rate_at(base, j) if base is not None else (min(out[-1], EXTRAPOLATION_CAP) if out else PRIOR_RATE)
            out.append((k + SHRINK * prior) / (n + SHRINK))
        return out


def _rate_at(rates: list[float], j: int) -> float:
    return rates[j] if j < len(rates) else (min(rates[-1], EXTRAPOLATION_CAP) if rates else PRIOR_RATE)


class GoodputSlot:
    """One batch-size slot of the goodput policy; see the module docstring for the model.

    tiers: the candidate tiers (steps 0 = speculation off, a candidate like any other).
    start_steps: the initial tier's steps (the smallest such tier); if no tier has them, the middle tier.
    hysteresis: switch only when the best goodput exceeds the current tier's by more than this fraction.
    window: steps at a tier above 0 whose outcomes form each acceptance estimate.
    decide_every: counted steps (observations with requests) between decisions, once warmup is over.
    warmup: counted steps before the first decision.
    explore_every: every this many decisions, run instead the tier run longest ago (never run first; ties: the
        smaller tier) for one decision interval, so its cost and acceptance stay measured; the next decision then
        compares against the tier left for it. While a tier has never run, every decision not returning from an
        exploration explores one, so each candidate is timed within the first few decisions. 0 disables.
        Deterministic.
    draft_cost_ratio, ridge_tokens: the cost prior (module docstring).
    """

    def __init__(self, tiers: list[Tier], start_steps: int, hysteresis: float = 0.1, window: int = 64,
                 decide_every: int = 5, warmup: int = 3, explore_every: int = 50, draft_cost_ratio: float = 0.2,
                 ridge_tokens: float = 128.0):
        if not tiers:
            raise ValueError("GoodputSlot needs at least one tier")
        if hysteresis < 0 or window < 1 or decide_every < 1 or warmup < 0 or explore_every < 0:
            raise ValueError("GoodputSlot needs hysteresis >= 0, window >= 1, decide_every >= 1, warmup >= 0, "
                             "explore_every >= 0")
        if draft_cost_ratio < 0 or ridge_tokens <= 0:
            raise ValueError("GoodputSlot needs draft_cost_ratio >= 0 and ridge_tokens > 0")
        self.tiers = sorted(set(tiers))
        starts = [t for t in self.tiers if t.steps == start_steps]
        self._tier = starts[0] if starts else self.tiers[len(self.tiers) // 2]
        self.hysteresis, self.decide_every, self.warmup = hysteresis, decide_every, warmup
        self.explore_every = explore_every
        self.prior = (1.0, 1.0 / ridge_tokens, draft_cost_ratio)
        depth = max(t.steps for t in self.tiers)
        self.acceptance = {self._family(t): _Acceptance(depth, window) for t in self.tiers if t.steps > 0}
        self.timed: dict[tuple[Tier, int], float] = {}  # (tier, batch size) -> EMA of step seconds
        self.last_run = {t: -1 for t in self.tiers}  # counted step a tier last ran at (-1: never)
        self.counted = self.decisions = 0
        self.home: Tier | None = None  # the tier an exploration left; None when not exploring
        self.batch_size = 1  # of the latest observed step
        self.switched = False  # the tier changed at the last decision: the next step pays the switch (module doc)
        self.timed_steps = 0  # steps whose wall time fed the cost EMAs

    @property
    def tier(self) -> Tier:
        return self._tier

    @staticmethod
    def _family(t: Tier):
        return "chain" if not t.is_tree else (t.topk, t.num_draft_tokens)

    def observe(self, accepted_drafts: list[int], batch_size: int | None = None,
                step_seconds: float | None = None) -> bool:
        """One step that ran self.tier: accepted draft tokens per request (a request that drafted nothing accepted
        0), the step's batch size (default len(accepted_drafts)) and wall time (None: untimed). True iff the tier
        changed. An empty list is ignored (not counted)."""
        if not accepted_drafts:
            return False
        t, batch_size = self._tier, batch_size or len(accepted_drafts)
        self.batch_size = batch_size
        if t.steps > 0:
            self.acceptance[self._family(t)].add(accepted_drafts, t.steps)  # a tree: its depth
        cold, self.switched = self.switched and self.decide_every > 1, False
        if step_seconds is not None and step_seconds > 0 and not cold:
            key = (t, batch_size)
            old = self.timed.get(key)
            if old is not None:
                step_seconds = min(step_seconds, OUTLIER_CAP * old)
            self.timed[key] = step_seconds if old is None else (1 - COST_ALPHA) * old + COST_ALPHA * step_seconds
            self.timed_steps += 1
        self.counted += 1
        self.last_run[t] = self.counted
        if self.counted <= self.warmup or (self.counted - self.warmup) % self.decide_every:
            return False
        self.switched = self._decide(batch_size)
        return self.switched

    def _decide(self, batch_size: int) -> bool:
        old = self._tier
        self.decisions += 1
        others = [t for t in self.tiers if t != old]
        # A tier never run is explored at once (every other decision until each has run): until then its cost is
        # the fit's guess, and waiting explore_every decisions for each kept a slow CPU on guesses for most of a run.
        due = self.explore_every and (any(self.last_run[t] < 0 for t in others)
                                      or self.decisions % self.explore_every == 0)
        if due and others and self.home is None:
            self.home = old
            self._tier = min(others, key=lambda t: (self.last_run[t], t))
            return True
        E, cost = self.expected(), self.costs(batch_size)
        self._tier = choose_tier(self.tiers, E, cost, self.home or old, self.hysteresis)
        self.home = None
        return self._tier != old

    def expected(self) -> dict[Tier, float]:
        """E(tier): expected tokens per request per verify, bonus included."""
        chain = self.acceptance["chain"].rates() if "chain" in self.acceptance else []
        out = {}
        for t in self.tiers:
            if t.steps == 0:
                out[t] = 1.0
            elif not t.is_tree:
                out[t] = expected_tokens(chain, t.steps)
            else:
                own = self.acceptance[self._family(t)].rates(base=chain)
                out[t] = expected_tokens(own + [_rate_at(chain, j) for j in range(len(own), t.steps)], t.steps)
        return out

    def _features(self, t: Tier, bs: int) -> tuple[float, float, float]:
        return 1.0, float(bs * t.num_draft_tokens), float(t.steps)

    def fit(self) -> list[float]:
        """[c0, c1, c2] of cost = c0 + c1 * verify_tokens + c2 * draft_forwards (non-negative)."""
        pts = [(self._features(t, bs), y) for (t, bs), y in self.timed.items()]
        if not pts:
            return list(self.prior)
        r = [sum(p * x for p, x in zip(self.prior, f)) for f, _ in pts]
        scale = sum(ri * y for ri, (_, y) in zip(r, pts)) / sum(ri * ri for ri in r)
        w = [RIDGE * (sum(f[k] ** 2 for f, _ in pts) / len(pts) or 1.0) for k in range(3)]
        a = [[sum(f[i] * f[k] for f, _ in pts) + (w[i] if i == k else 0.0) for k in range(3)] for i in range(3)]
        b = [sum(f[i] * y for f, y in pts) + w[i] * scale * self.prior[i] for i in range(3)]
        return [max(0.0, float(x)) for x in np.linalg.solve(a, b)]  # the ridge makes `a` positive definite

    def costs(self, batch_size: int) -> dict[Tier, float]:
        """cost(batch_size, tier) in seconds per step (in prior units before any timing)."""
        c = self.fit()
        model = lambda t, bs: sum(ci * x for ci, x in zip(c, self._features(t, bs)))  # noqa: E731
        out = {}
        for t in self.tiers:
            seen = [bs for (u, bs) in self.timed if u == t]
            if not seen:
                est = model(t, batch_size)
            else:
                near = min(seen, key=lambda bs: (abs(bs - batch_size), bs))
                est = self.timed[(t, near)] + model(t, batch_size) - model(t, near)
                est = max(est, 0.25 * self.timed[(t, near)])  # a fit far off the data never makes a tier free
            out[t] = max(est, 1e-12)
        return out

    def state(self) -> dict:
        E = self.expected()
        bs = self.batch_size
        cost = self.costs(bs)
        return {"strategy": "goodput", "tier": self._tier.describe(), "counted": self.counted,
                "timed_steps": self.timed_steps,
                "decisions": self.decisions, "exploring": self.home is not None,
                "acceptance": self.acceptance["chain"].rates() if "chain" in self.acceptance else [],
                "expected_tokens": {t.describe(): round(E[t], 4) for t in self.tiers},
                "cost_ms": {t.describe(): round(cost[t] * 1e3, 4) for t in self.tiers},
                "cost_fit": [round(x, 9) for x in self.fit()], "goodput_at_bs": bs,
                "goodput": {t.describe(): round(bs * E[t] / cost[t], 4) for t in self.tiers}}


GOODPUT_KEYS = ("hysteresis", "window", "decide_every", "warmup", "explore_every", "draft_cost_ratio", "ridge_tokens")


def goodput_slot_factory(cfg) -> Callable[[int, object, int], GoodputSlot]:
    """The AdaptiveController's slot_factory for "strategy": "goodput": every slot runs its ladder (slot_cfg.tiers)
    with the config's "goodput" object as GoodputSlot keyword arguments. Unknown keys raise at start-up."""
    opts = dict(cfg.goodput)
    unknown = sorted(set(opts) - set(GOODPUT_KEYS))
    if unknown:
        raise ValueError(f"speculative_adaptive_config 'goodput': unknown keys {unknown}; allowed {list(GOODPUT_KEYS)}")
    try:
        GoodputSlot([Tier(1)], 1, **opts)  # validate the values once, at start-up
    except (TypeError, ValueError) as e:
        raise ValueError(f"speculative_adaptive_config 'goodput': {e}") from None
    return lambda key, slot_cfg, start_steps: GoodputSlot(list(slot_cfg.tiers), start_steps, **opts)
