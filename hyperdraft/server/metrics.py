"""Prometheus metrics of the server, in the text exposition format (version 0.0.4).

Request-side counters and latency histograms live here and are updated on the asyncio thread only. Engine
state (running / waiting requests, KV usage, speculation counters, the current tier) is read on the engine
thread at scrape time (engine_snapshot), so nothing is shared across threads. The format is written by hand:
prometheus_client is not a dependency of the server.

Inter-token latency: a step that emits k tokens after a gap g counts as k observations of g / k, so the mean
ITL of a request is (e2e - ttft) / (tokens - 1) with or without speculation.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from hyperdraft.engine.engine import Engine

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
PREFIX = "hyperdraft_"


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative), + the +Inf bucket
    sum: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times


class ServerMetrics:
    def __init__(self):
        self.requests_received = 0  # HTTP generation requests accepted by the engine
        self.requests_finished: dict[str, int] = {}  # per choice, by finish reason (stop, length, abort, error)
        self.http_errors: dict[int, int] = {}  # error answers by status
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(LATENCY_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)

    def finished(self, reason: str) -> None:
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1

    def error(self, status: int) -> None:
        self.http_errors[status] = self.http_errors.get(status, 0) + 1

    def render(self, snap: dict) -> str:
        w = _Writer()
        w.family("requests_received_total", "counter", "generation requests accepted (one per HTTP request)")
        w.sample("requests_received_total", self.requests_received)
        w.family("requests_finished_total", "counter", "finished choices by finish reason (abort: client gone)")
        for reason in sorted({"stop", "length", "abort", "error"} | set(self.requests_finished)):
            w.sample("requests_finished_total", self.requests_finished.get(reason, 0), {"reason": reason})
        w.family("http_errors_total", "counter", "error answers by HTTP status")
        for status, n in sorted(self.http_errors.items()):
            w.sample("http_errors_total", n, {"status": str(status)})
        w.counter("prompt_tokens_total", "prompt tokens of finished requests", self.prompt_tokens)
        w.counter("generation_tokens_total", "generated tokens of finished requests", self.generation_tokens)
        w.histogram("time_to_first_token_seconds", "arrival to first token", self.ttft)
        w.histogram("inter_token_latency_seconds", "gap between tokens (a k-token step counts k gaps of g/k)", self.itl)
        w.histogram("e2e_request_latency_seconds", "arrival to last token", self.e2e)
        w.gauge("num_running_reqs", "requests running in the engine", snap["running"])
        w.gauge("num_waiting_reqs", "requests waiting for admission (queued)", snap["waiting"])
        w.gauge("kv_capacity_tokens", "KV-pool capacity in tokens", snap["kv_capacity"])
        w.gauge("kv_used_tokens", "KV-pool tokens in use", snap["kv_used"])
        w.gauge("kv_usage", "fraction of the KV pool in use", snap["kv_used"] / max(1, snap["kv_capacity"]))
        w.gauge("lossy_benchmark_mode", "1 when verification is simulated (benchmark only, lossy)", snap["lossy"])
        if snap.get("spec") is not None:
            _render_spec(w, snap["spec"])
        return w.text()


def _render_spec(w: "_Writer", s: dict) -> None:
    w.counter("spec_verify_steps_total", "target verify forwards (engine steps with decodes)", s["verify_forwards"])
    w.counter("spec_verifies_total", "request-verifies (one per decoding request per step)", s["verifies"])
    w.counter("spec_draft_tokens_total", "draft tokens proposed", s["draft_tokens"])
    w.counter("spec_accepted_tokens_total", "draft tokens accepted", s["accepted_tokens"])
    w.counter("spec_emitted_tokens_total", "tokens emitted by verifies (accepted + bonus or recovered)",
              s["emitted_tokens"])
    w.gauge("spec_avg_accept_length", "emitted tokens per request-verify", s["emitted_tokens"] / max(1, s["verifies"]))
    # accept length = tokens one verify emits (1 .. K+1); histogram buckets are cumulative
    hist = s["accept_length_hist"]
    w.family("spec_accept_length", "histogram", "tokens emitted per request-verify")
    cumulative = 0
    for length in range(1, len(hist)):
        cumulative += hist[length]
        w.sample("spec_accept_length_bucket", cumulative, {"le": str(float(length))})
    w.sample("spec_accept_length_bucket", cumulative, {"le": "+Inf"})
    w.sample("spec_accept_length_sum", sum(i * n for i, n in enumerate(hist)))
    w.sample("spec_accept_length_count", cumulative)
    for name, key, help in (("spec_position_proposed_total", "proposed_by_position", "drafts proposed at position"),
                            ("spec_position_accepted_total", "accepted_by_position", "drafts accepted at position")):
        w.family(name, "counter", help)
        for pos, n in enumerate(s[key]):
            w.sample(name, n, {"position": str(pos)})
    w.family("spec_acceptance_rate_by_position", "gauge", "accepted / proposed drafts at each draft position")
    for pos, (a, p) in enumerate(zip(s["accepted_by_position"], s["proposed_by_position"])):
        w.sample("spec_acceptance_rate_by_position", a / p if p else 0.0, {"position": str(pos)})
    w.gauge("spec_tier_num_steps", "draft depth of the current tier (0 = plain decode)", s["tier_steps"])
    w.gauge("spec_tier_topk", "branching factor of the current tier", s["tier_topk"])
    w.gauge("spec_tier_num_draft_tokens", "tokens verified per round by the current tier", s["tier_draft_tokens"])
    w.family("spec_tier_steps_total", "counter", "engine steps run with each tier")
    for tier, n in sorted(s["steps_per_tier"].items()):
        w.sample("spec_tier_steps_total", n, {"tier": tier})
    w.counter("spec_tier_switches_total", "adaptive tier switches", s["tier_switches"])


def engine_snapshot(engine: Engine, lossy: bool) -> dict:
    """Engine state for /metrics; runs on the engine thread (EngineLoop.call)."""
    sched = engine.scheduler
    snap = {"running": len(sched.running), "waiting": len(sched.waiting), "kv_capacity": engine.kv_capacity_slots,
            "kv_used": engine.kv_capacity_slots - engine.kv_free_slots, "lossy": int(lossy), "spec": None}
    if engine.spec is not None:
        m, tier = engine.worker.metrics, engine.worker.last_tier
        snap["spec"] = {
            "verify_forwards": m.verify_forwards, "verifies": m.verifies, "draft_tokens": m.draft_tokens,
            "accepted_tokens": m.accepted_tokens, "emitted_tokens": m.emitted_tokens,
            "accept_length_hist": list(m.accept_length_hist), "proposed_by_position": list(m.proposed_by_position),
            "accepted_by_position": list(m.accepted_by_position), "steps_per_tier": dict(m.steps_per_tier),
            "tier_switches": m.tier_switches, "tier_steps": tier.steps, "tier_topk": tier.topk,
            "tier_draft_tokens": tier.num_draft_tokens,
        }
    return snap


class _Writer:
    def __init__(self):
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help: str) -> None:
        self.lines += [f"# HELP {PREFIX}{name} {help}", f"# TYPE {PREFIX}{name} {kind}"]

    def sample(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        text = ""
        if labels:
            text = "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"
        self.lines.append(f"{PREFIX}{name}{text} {float(value)!r}")

    def counter(self, name: str, help: str, value: float) -> None:
        self.family(name, "counter", help)
        self.sample(name, value)

    def gauge(self, name: str, help: str, value: float) -> None:
        self.family(name, "gauge", help)
        self.sample(name, value)

    def histogram(self, name: str, help: str, h: Histogram) -> None:
        self.family(name, "histogram", help)
        cumulative = 0
        for bound, n in zip(h.buckets, h.counts):
            cumulative += n
            self.sample(f"{name}_bucket", cumulative, {"le": repr(float(bound))})
        self.sample(f"{name}_bucket", h.count, {"le": "+Inf"})
        self.sample(f"{name}_sum", h.sum)
        self.sample(f"{name}_count", h.count)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
