"""The adaptive config: SGLang's (0.5.23) per-batch-size JSON, parsed into frozen slots of tier ladders.

Why per batch size: a deep draft pays off for one request, but at high batch sizes the verify pass is compute-bound
and the drafted-but-rejected tokens cost real throughput. SGLang therefore keys "slots" by batch-size lower bounds,
each with its own ladder of candidate step counts and its own policy state (ema.py, goodput.py).

The config format, the slot policy and the routing follow /work/shared/reference/sglang-speculative.md section 4.
hyperdraft extension: a candidate may be a tier object {"steps", "topk", "num_draft_tokens"} (an adaptive tree);
decisions still compare the EMA against tier.steps, so the ladder must hold one tier per steps value.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from hyperdraft.speculative.adaptive.tier import Tier, max_tree_tokens

logger = logging.getLogger("hyperdraft")

DEFAULT_ADAPTIVE_CONFIG: dict[str, Any] = {
    "ema_alpha": 0.2, "update_interval": 5, "warmup_batches": 10,
    "1": {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
}

STRATEGIES = ("ema", "goodput")
_RESERVED_GLOBALS = ("strategy", "goodput")  # global keys that are not merged into the slots
_SLOT_DEFAULTS: dict[str, float | int] = {"up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0.0,
                                          "ema_alpha": 0.2, "warmup_batches": 10, "update_interval": 5}
_TIER_KEYS = {"steps", "topk", "num_draft_tokens"}


@dataclass(frozen=True)
class SlotConfig:
    """One batch-size slot: its ladder (tiers ordered by steps, one per steps value) and its policy knobs."""

    tiers: tuple[Tier, ...]
    up_hysteresis: float = 0.0  # added to the rise threshold (positive = harder to rise)
    down_hysteresis: float = -0.25  # added to the drop threshold (negative = harder to drop)
    ceiling_coeff: float = 0.0  # 0 = off; else caps non-rising targets at max(1, ceil(ema * coeff))
    ema_alpha: float = 0.2  # EMA weight of the newest batch
    warmup_batches: int = 10  # counted batches before the first decision
    update_interval: int = 5  # decide every N counted batches after warmup

    @property
    def candidate_steps(self) -> list[int]:
        return [t.steps for t in self.tiers]


@dataclass(frozen=True)
class AdaptiveConfig:
    """Slots sorted by their batch-size lower bound; `goodput` is passed through untouched for that strategy."""

    slots: tuple[tuple[int, SlotConfig], ...]
    strategy: str = "ema"
    goodput: dict = field(default_factory=dict, hash=False)

    def candidate_union(self) -> list[Tier]:
        """Every tier any slot can run, sorted by steps, exact duplicates removed: the engine builds each once."""
        return sorted({t for _, slot in self.slots for t in slot.tiers})

    def max_reserve_tokens(self) -> int:
        """Pools are sized once, for the largest tier, so a switch never needs a reallocation."""
        return max(t.reserve_tokens for t in self.candidate_union())


def _int_tier(s: int, topk: int, num_draft_tokens: int | None) -> Tier:
    """A plain int candidate takes the flag's tree shape. Step 0 is always Tier(0). A tree's num_draft_tokens is
    clamped into what that depth allows ([2, max_tree_tokens(s, topk)]) so one flag value fits every rung; unset, a
    tree verifies s + 1 nodes, the chain's width."""
    if s == 0 or topk == 1:
        return Tier(s)
    most = max_tree_tokens(s, topk)
    return Tier(s, topk, min(max(num_draft_tokens if num_draft_tokens is not None else s + 1, 2), most))


def _parse_tiers(key: str, value: Any, topk: int, num_draft_tokens: int | None) -> tuple[Tier, ...]:
    bad = (f"BS {key}: candidate_steps must be a list of non-negative ints or tier objects "
           f"{{\"steps\": S, \"topk\": K, \"num_draft_tokens\": N}}, got {value}")
    if not isinstance(value, list) or not value:
        raise ValueError(bad)
    tiers: set[Tier] = set()
    for item in value:
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            tiers.add(_int_tier(item, topk, num_draft_tokens))
        elif isinstance(item, dict) and "steps" in item and set(item) <= _TIER_KEYS and all(
                isinstance(v, int) and not isinstance(v, bool) for v in item.values()):
            try:
                tiers.add(Tier(item["steps"], item.get("topk", 1), item.get("num_draft_tokens", 0)))
            except ValueError as e:
                raise ValueError(f"{bad} ({e})") from None
        else:
            raise ValueError(bad)
    ladder = tuple(sorted(tiers))  # exact duplicates collapse (SGLang de-duplicates plain ints)
    for lo, hi in zip(ladder, ladder[1:]):
        if lo.steps == hi.steps:
            raise ValueError(f"BS {key}: candidate_steps holds two tiers with steps={lo.steps} ({lo.describe()} and "
                             f"{hi.describe()}); the ladder is ordered by steps, so keep one")
    return ladder


def _parse_slot(key: str, merged: dict[str, Any], topk: int, num_draft_tokens: int | None) -> SlotConfig:
    unknown = set(merged) - set(_SLOT_DEFAULTS) - {"candidate_steps"}
    if unknown:  # SGLang ignores them too; say so, since a typo would otherwise go unnoticed
        logger.warning("speculative_adaptive_config BS %s: ignoring unknown keys %s", key, sorted(unknown))
    v = {name: merged.get(name, default) for name, default in _SLOT_DEFAULTS.items()}
    try:
        cfg = SlotConfig(_parse_tiers(key, merged.get("candidate_steps"), topk, num_draft_tokens),
                         float(v["up_hysteresis"]), float(v["down_hysteresis"]), float(v["ceiling_coeff"]),
                         float(v["ema_alpha"]), int(v["warmup_batches"]), int(v["update_interval"]))
    except (TypeError, ValueError) as e:
        raise ValueError(str(e) if str(e).startswith("BS ") else f"BS {key}: {e}") from None
    # SGLang gives ema_alpha 0 a meaning (the EMA stays where it starts) and ceiling_coeff <= 0 too (no ceiling)
    if not 0.0 <= cfg.ema_alpha <= 1.0 or cfg.warmup_batches < 0 or cfg.update_interval < 1:
        raise ValueError(f"BS {key}: needs 0 <= ema_alpha <= 1, warmup_batches >= 0 and update_interval >= 1, got {v}")
    return cfg


def _read(source: str) -> Any:
    """A JSON file, or a JSON object given inline (a string that starts with '{')."""
    inline = source.lstrip().startswith("{")
    try:
        if inline:
            return json.loads(source)
        with open(source) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"speculative_adaptive_config: cannot read {source!r} ({e.strerror}); give a JSON file "
                         "or a JSON object") from None
    except json.JSONDecodeError as e:
        what = "the inline JSON" if inline else repr(source)
        raise ValueError(f"speculative_adaptive_config: {what} is not valid JSON ({e})") from None


def load_adaptive_config(source: str | dict | None, default_topk: int = 1,
                         default_num_draft_tokens: int | None = None) -> AdaptiveConfig:
    """Parse SGLang's adaptive JSON: a file path, the JSON object itself as a string (hyperdraft extension), an
    already-parsed dict, or None for the built-in default.

    Integer-string keys are slots (batch-size lower bounds); other keys are globals merged into every slot (slot
    values win), except "strategy" and "goodput", which belong to the whole config."""
    if source is None:
        raw: Any = DEFAULT_ADAPTIVE_CONFIG
    elif isinstance(source, str):
        raw = _read(source)
    else:
        raw = source
    if not isinstance(raw, dict):
        raise ValueError("speculative_adaptive_config must be a JSON object")
    strategy = raw.get("strategy", "ema")
    if strategy == "throughput_aware":  # SGLang after 0.5.23; 0.5.23 ignores the key and runs its EMA policy
        logger.warning("speculative_adaptive_config: strategy 'throughput_aware' runs the EMA policy here, as SGLang "
                       "0.5.23 does (hyperdraft's own throughput-driven policy is 'goodput')")
        strategy = "ema"
    if strategy not in STRATEGIES:
        raise ValueError(f"speculative_adaptive_config: 'strategy' must be 'ema' or 'goodput', got {strategy!r}")
    goodput = raw.get("goodput", {})
    if not isinstance(goodput, dict):
        raise ValueError("speculative_adaptive_config: 'goodput' must be a JSON object")
    # ASCII digits only: "²".isdigit() is True, and int("²") failed with an error that named no key
    slot_keys = [k for k in raw if isinstance(k, str) and k.isascii() and k.isdigit()]
    if not slot_keys:
        raise ValueError('speculative_adaptive_config must contain at least one integer-string BS key, '
                         f'e.g. {{"1": {{"candidate_steps": [1,3,7]}}}}. Got keys: {list(raw)}')
    globals_ = {k: v for k, v in raw.items() if k not in slot_keys and k not in _RESERVED_GLOBALS}
    slots: dict[int, SlotConfig] = {}
    for key in slot_keys:
        if int(key) in slots:
            raise ValueError(f"speculative_adaptive_config: BS {key} is given twice")
        value = raw[key]
        own = value if isinstance(value, dict) else {"candidate_steps": value}  # a bare list is the shorthand
        slots[int(key)] = _parse_slot(key, {**globals_, **own}, default_topk, default_num_draft_tokens)
    return AdaptiveConfig(tuple(sorted(slots.items())), strategy, dict(goodput))


def resolve_initial_steps(cfg: AdaptiveConfig, steps: int | None) -> int:
    """The flag value is never injected into the ladders (SGLang 0.5.13+): it must be a candidate; unset, the
    middle of the union of candidate steps."""
    union = sorted({t.steps for t in cfg.candidate_union()})
    if steps is None:
        return union[len(union) // 2]
    if steps not in union:
        raise ValueError(f"--speculative-num-steps={steps} is not in the adaptive config candidate_steps {union}. "
                         "Pass one of those values.")
    return steps
