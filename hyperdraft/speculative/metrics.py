"""SpecMetrics: acceptance counters across all requests."""

from __future__ import annotations

import contextlib
import time

import torch


class SpecMetrics:
    def __init__(self, max_draft_tokens: int):
        self.verify_forwards = 0  # target verify forwards (one per engine step with decodes)
        self.verifies = 0  # request-verifies (one per decoding request per step)
        self.draft_tokens = 0  # draft tokens proposed
        self.accepted_tokens = 0  # draft tokens accepted
        self.emitted_tokens = 0  # accepted + recovered/bonus tokens
        self.proposed_by_position = [0] * max_draft_tokens
        self.accepted_by_position = [0] * max_draft_tokens
        self.accept_length_hist = [0] * (max_draft_tokens + 2)  # index = tokens emitted by one verify
        self.steps_per_tier: dict[str, int] = {}  # engine steps run with each tier (adaptive)
        self.tier_switches = 0
        self._last_tier = None

    def observe_tier(self, tier) -> None:
        key = tier.describe()
        self.steps_per_tier[key] = self.steps_per_tier.get(key, 0) + 1
        if self._last_tier is not None and tier != self._last_tier:
            self.tier_switches += 1
        self._last_tier = tier

    def observe(self, lens: list[int], num_accepted: list[int], proposed: list[int] | None = None) -> None:
        """lens: draft depth per request (chain length, or tree depth); proposed: draft tokens verified per
        request when that differs from the depth (tree nodes)."""
        self.verify_forwards += 1
        self.verifies += len(lens)
        self.draft_tokens += sum(proposed if proposed is not None else lens)
        self.accepted_tokens += sum(num_accepted)
        self.emitted_tokens += sum(num_accepted) + len(num_accepted)
        # Per position j: requests whose depth exceeds j proposed there; of those, the ones that accepted more than j
        # (per request, not per (request, position): O(B + K) instead of O(B * K)).
        ends_proposed = [0] * (len(self.proposed_by_position) + 1)
        ends_accepted = [0] * (len(self.proposed_by_position) + 1)
        for k, a in zip(lens, num_accepted):
            self.accept_length_hist[a + 1] += 1
            ends_proposed[k] += 1
            ends_accepted[min(a, k)] += 1
        proposed_left, accepted_left = len(lens), len(lens)
        for j in range(len(self.proposed_by_position)):
            proposed_left -= ends_proposed[j]
            accepted_left -= ends_accepted[j]
            self.proposed_by_position[j] += proposed_left
            self.accepted_by_position[j] += accepted_left

    def observe_idle(self, num_requests: int) -> None:
        """observe() of a step-0 step: every request drafted nothing and emitted one token (no per-request work)."""
        self.verify_forwards += 1
        self.verifies += num_requests
        self.emitted_tokens += num_requests
        self.accept_length_hist[1] += num_requests

    def summary(self) -> dict:
        return {
            "avg_spec_accept_length": self.emitted_tokens / self.verifies if self.verifies else 0.0,
            "spec_verify_forwards": self.verify_forwards,
            "spec_verifies": self.verifies,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "spec_acceptance_by_position": [a / p if p else 0.0 for a, p in zip(self.accepted_by_position, self.proposed_by_position)],
            "spec_accept_length_histogram": list(self.accept_length_hist),
            "spec_steps_per_tier": dict(self.steps_per_tier),
            "spec_tier_switches": self.tier_switches,
        }


class PhaseTimer:
    """Wall time per phase of a speculative step, for benchmarks. Off unless RuntimeOptions.record_step_time
    (HYPERDRAFT_RECORD_STEP_TIME=1): timing a GPU phase needs a device sync, which the hot path must not pay."""

    def __init__(self, device: torch.device, enabled: bool):
        self.enabled = enabled
        self.device = device
        self.seconds: dict[str, float] = {}

    def phase(self, name: str):
        if not self.enabled:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def timed():
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        return timed()
