"""EmaSlot: SGLang's adaptive slot policy, an EMA of accepted drafts per request over a ladder of tiers."""

from __future__ import annotations

import math
from typing import Any

from hyperdraft.speculative.adaptive.config import SlotConfig
from hyperdraft.speculative.adaptive.tier import Tier


class EmaSlot:
    """SGLang's AdaptiveStepSlot: an EMA of accepted drafts per request and a threshold ladder over tier.steps.

    The bonus token is not counted. Step 0 gives no signal, so the EMA freezes there and the slot leaves it only by
    a periodic blind probe one rung up. Drops may skip several rungs; a rise happens only when nothing dropped."""

    def __init__(self, cfg: SlotConfig, start_steps: int):
        self.cfg = cfg
        steps = [t.steps for t in cfg.tiers]
        self._i = steps.index(start_steps) if start_steps in steps else len(steps) // 2
        self._ema = float(self.tier.steps - 1)  # neutral; -1 for a slot that starts at 0
        self._counted = 0

    @property
    def tier(self) -> Tier:
        return self.cfg.tiers[self._i]

    @property
    def steps(self) -> int:
        return self.tier.steps

    @property
    def ema(self) -> float:
        return self._ema

    @property
    def counted(self) -> int:
        return self._counted

    def observe(self, accepted_drafts: list[int], **_: Any) -> bool:
        """Feed one batch (accepted drafts per request); True iff the tier changed. Extra keyword arguments (the
        goodput strategy's batch size and step time) are accepted and ignored."""
        if not accepted_drafts:  # no signal: counts toward neither warmup nor interval
            return False
        if self.steps > 0:
            a = self.cfg.ema_alpha
            self._ema = (1 - a) * self._ema + a * (sum(accepted_drafts) / len(accepted_drafts))
        self._counted += 1
        past = self._counted - self.cfg.warmup_batches
        if past <= 0 or past % self.cfg.update_interval != 0:
            return False
        return self._decide()

    def _decide(self) -> bool:
        c, ladder, old = self.cfg, [t.steps for t in self.cfg.tiers], self._i
        i, last = old, len(ladder) - 1
        if ladder[old] == 0:  # periodic blind probe upward
            i = min(i + 1, last)
            if ladder[i] > 0 and self._ema < 0:
                self._ema = float(ladder[i] - 1)
        else:
            while i > 0 and self._ema <= (0.5 if ladder[i - 1] == 0 else ladder[i - 1] - 0.5) + c.down_hysteresis:
                i -= 1
            if i == old:
                while i < last and self._ema > ladder[i] - 0.5 + c.up_hysteresis:
                    i += 1
            if c.ceiling_coeff > 0:
                cap = max(1, math.ceil(self._ema * c.ceiling_coeff))
                if cap < ladder[i] <= ladder[old]:  # the cap never blocks a rise
                    while i > 0 and ladder[i] > cap:
                        i -= 1
        self._i = i
        return i != old

    def state(self) -> dict[str, Any]:
        t = self.tier
        return {"steps": t.steps, "topk": t.topk, "num_draft_tokens": t.num_draft_tokens, "ema": self._ema,
                "counted": self._counted}
