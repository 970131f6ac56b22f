"""Tier sources: which Tier each step runs. StaticTiers without adaptive speculation; with it, the AdaptiveController
routes each batch to its batch-size slot, whose policy (EMA ladder or goodput) holds the tier."""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol

from hyperdraft.speculative.adaptive.config import AdaptiveConfig, SlotConfig
from hyperdraft.speculative.adaptive.ema import EmaSlot
from hyperdraft.speculative.adaptive.tier import Tier

logger = logging.getLogger("hyperdraft")

SlotFactory = Callable[[int, SlotConfig, int], Any]


class AdaptiveController:
    """Routes each batch to its slot and feeds that slot only. A batch-size change switches tier at once (each
    slot keeps its own state); a decision takes effect on the next round, never mid-round."""

    def __init__(self, cfg: AdaptiveConfig, start_steps: int, graph_batch_sizes: list[int] | None = None,
                 slot_factory: SlotFactory | None = None):
        self.cfg = cfg
        self.graph_batch_sizes = sorted(graph_batch_sizes) if graph_batch_sizes else None
        factory = slot_factory or (lambda key, slot_cfg, start: EmaSlot(slot_cfg, start))
        self.slot_cfgs = dict(cfg.slots)
        self.slots = {key: factory(key, slot_cfg, start_steps) for key, slot_cfg in cfg.slots}

    def route(self, batch_size: int) -> int:
        """The slot key for a batch: pad up to the graph that will run it first, then the largest key <= that."""
        g = batch_size
        if self.graph_batch_sizes is not None:
            g = next((s for s in self.graph_batch_sizes if s >= batch_size), batch_size)
        keys = [k for k, _ in self.cfg.slots]
        return max((k for k in keys if k <= g), default=keys[0])

    def tier_for(self, batch_size: int) -> Tier:
        return self.slots[self.route(batch_size)].tier

    def observe(self, batch_size: int, accepted_drafts: list[int],
                step_seconds: float | None = None) -> tuple[Tier, Tier] | None:
        """Feed the routed slot; (old, new) when its tier switched, else None."""
        key = self.route(batch_size)
        slot = self.slots[key]
        old = slot.tier
        slot.observe(accepted_drafts, batch_size=batch_size, step_seconds=step_seconds)
        new = slot.tier
        if new == old:
            return None
        ema = slot.state().get("ema")
        logger.info("Adaptive spec params updated: steps %s -> %s (ema_accept_len=%s, bs slot=%d)", old.describe(),
                    new.describe(), "n/a" if ema is None else f"{ema:.2f}", key)
        return old, new

    def tier_sizes(self, sizes: list[int]) -> dict[Tier, list[int]]:
        """Every candidate tier -> the captured sizes whose routed slot can run its steps."""
        return {tier: self.graph_sizes_for_steps(tier.steps) or [] for tier in self.cfg.candidate_union()}

    def graph_sizes_for_steps(self, steps: int) -> list[int] | None:
        """Captured sizes whose routed slot can run `steps`: graphs for a tier are captured only there."""
        if self.graph_batch_sizes is None:
            return None
        return [g for g in self.graph_batch_sizes if steps in self.slot_cfgs[self.route(g)].candidate_steps]

    def state(self) -> dict[str, dict[str, Any]]:
        return {str(key): slot.state() for key, slot in self.slots.items()}


class TierSource(Protocol):
    """Which tier a step of batch_size decoding requests runs, fed back with what the step achieved."""

    def tier_for(self, batch_size: int) -> Tier: ...

    def observe(self, batch_size: int, accepted_drafts: list[int], step_seconds: float | None) -> None: ...

    def tier_sizes(self, sizes: list[int]) -> dict[Tier, list[int]]:
        """Every tier that can run -> the captured batch sizes that can run it (what CUDA graphs are planned for)."""
        ...

    def state(self) -> dict: ...


class StaticTiers:
    """The tier source without adaptive speculation: one fixed tier."""

    def __init__(self, tier: Tier):
        self.tier = tier

    def tier_for(self, batch_size: int) -> Tier:
        return self.tier

    def observe(self, batch_size: int, accepted_drafts: list[int], step_seconds: float | None) -> None:
        pass

    def tier_sizes(self, sizes: list[int]) -> dict[Tier, list[int]]:
        return {self.tier: list(sizes)}

    def state(self) -> dict:
        return {}


def make_tier_source(initial: Tier, adaptive: AdaptiveConfig | None, graph_sizes: list[int] | None) -> TierSource:
    """StaticTiers(initial) without an adaptive config; else the controller, its slots built by the config's strategy
    (graph_sizes: the captured batch sizes a batch is routed by, None when nothing is captured)."""
    if adaptive is None:
        return StaticTiers(initial)
    factory = None
    if adaptive.strategy == "goodput":
        from hyperdraft.speculative.adaptive.goodput import goodput_slot_factory

        factory = goodput_slot_factory(adaptive)
    return AdaptiveController(adaptive, initial.steps, graph_sizes, slot_factory=factory)
