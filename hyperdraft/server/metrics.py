"""Prometheus metrics of the server, exposed by prometheus_client in the text format (version 0.0.4).

Request-side counters and latency histograms are prometheus_client metrics, updated on the asyncio thread only;
each ServerMetrics has a registry of its own, as one process may run several servers (tests do). Engine state
(running / waiting requests, KV usage, speculation counters, the current tier) is read on the engine thread at
scrape time (engine_snapshot) and turned into metric families by a collector while rendering, so nothing is shared
across threads.

Inter-token latency: a step that emits k tokens after a gap g counts as k observations of g / k, so the mean
ITL of a request is (e2e - ttft) / (tokens - 1) with or without speculation.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from hyperdraft.engine.engine import Engine

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
PREFIX = "hyperdraft_"
FINISH_REASONS = ("stop", "length", "abort", "error")

# The exposition had no <name>_created series before prometheus_client, so scrapers keep seeing none. The switch is
# process-wide: the library has no per-registry one.
disable_created_metrics()


class RepeatedHistogram:
    """A histogram where one observe can stand for several equal observations (a k-token step: k gaps of g/k)."""

    def __init__(self, histogram: Histogram):
        self.histogram = histogram

    def observe(self, value: float, times: int = 1) -> None:
        for _ in range(times):
            self.histogram.observe(value)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        # prometheus_client appends _total to counter names
        self.requests_received = Counter(PREFIX + "requests_received",
                                         "generation requests accepted (one per HTTP request)", registry=r)
        self.requests_finished = Counter(PREFIX + "requests_finished",
                                         "finished choices by finish reason (abort: client gone)", ["reason"],
                                         registry=r)
        for reason in FINISH_REASONS:
            self.requests_finished.labels(reason)  # exposed as 0 until the first such finish
        self.http_errors = Counter(PREFIX + "http_errors", "error answers by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "generated tokens of finished requests",
                                         registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = RepeatedHistogram(Histogram(PREFIX + "inter_token_latency_seconds",
                                               "gap between tokens (a k-token step counts k gaps of g/k)",
                                               buckets=LATENCY_BUCKETS, registry=r))
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self._engine = EngineCollector()
        r.register(self._engine)

    def finished(self, reason: str) -> None:
        self.requests_finished.labels(reason).inc()

    def error(self, status: int) -> None:
        self.http_errors.labels(str(status)).inc()

    def render(self, snap: dict) -> str:
        # render is the registry's only reader and runs on the asyncio thread, so the collector sees this snapshot
        self._engine.snap = snap
        return generate_latest(self.registry).decode()


class EngineCollector:
    """Engine state as metric families, built at scrape time from the snapshot of engine_snapshot."""

    def __init__(self):
        self.snap: dict | None = None

    def collect(self) -> Iterator[Metric]:
        snap = self.snap
        if snap is None:
            return
        yield _gauge("num_running_reqs", "requests running in the engine", snap["running"])
        yield _gauge("num_waiting_reqs", "requests waiting for admission (queued)", snap["waiting"])
        yield _gauge("kv_capacity_tokens", "KV-pool capacity in tokens", snap["kv_capacity"])
        yield _gauge("kv_used_tokens", "KV-pool tokens in use by requests (not counting unreferenced cached ones)",
                 snap["kv_used"])
        yield _gauge("kv_usage", "fraction of the KV pool in use", snap["kv_used"] / max(1, snap["kv_capacity"]))
        yield _gauge("lossy_benchmark_mode", "1 when verification is simulated (benchmark only, lossy)", snap["lossy"])
        if snap["cache"].get("radix_cache"):
            yield from _cache_families(snap["cache"])
        if snap.get("spec") is not None:
            yield from _spec_families(snap["spec"])


def _cache_families(c: dict) -> Iterator[Metric]:
    yield _gauge("cache_tokens", "KV tokens held by the prefix cache (referenced or not)", c["cache_tokens"])
    yield _gauge("cache_evictable_tokens", "prefix-cache tokens no running request references", c["cache_evictable_tokens"])
    yield _counter("cache_lookup_tokens", "prompt tokens of admitted requests looked up in the prefix cache",
                   c["cache_lookup_tokens"])
    yield _counter("cache_hit_tokens", "prompt tokens served from the prefix cache", c["cache_hit_tokens"])
    yield _gauge("cache_hit_rate", "cache_hit_tokens / cache_lookup_tokens", c["cache_hit_rate"])
    yield _counter("cache_evicted_tokens", "prefix-cache tokens evicted to make room (LRU)", c["cache_evicted_tokens"])


def _spec_families(s: dict) -> Iterator[Metric]:
    yield _counter("spec_verify_steps", "target verify forwards (engine steps with decodes)", s["verify_forwards"])
    yield _counter("spec_verifies", "request-verifies (one per decoding request per step)", s["verifies"])
    yield _counter("spec_draft_tokens", "draft tokens proposed", s["draft_tokens"])
    yield _counter("spec_accepted_tokens", "draft tokens accepted", s["accepted_tokens"])
    yield _counter("spec_emitted_tokens", "tokens emitted by verifies (accepted + bonus or recovered)",
                   s["emitted_tokens"])
    yield _gauge("spec_avg_accept_length", "emitted tokens per request-verify",
                 s["emitted_tokens"] / max(1, s["verifies"]))
    # accept length = tokens one verify emits (1 .. K+1), hist[n] verifies emitted n; histogram buckets are cumulative
    hist = s["accept_length_hist"]
    buckets, cumulative = [], 0
    for length in range(1, len(hist)):
        cumulative += hist[length]
        buckets.append((str(float(length)), cumulative))
    buckets.append(("+Inf", cumulative))
    yield HistogramMetricFamily(PREFIX + "spec_accept_length", "tokens emitted per request-verify", buckets,
                                sum_value=sum(i * n for i, n in enumerate(hist)))
    for name, key, help in (("spec_position_proposed", "proposed_by_position", "drafts proposed at position"),
                            ("spec_position_accepted", "accepted_by_position", "drafts accepted at position")):
        family = _counter(name, help, labels=["position"])
        for pos, n in enumerate(s[key]):
            family.add_metric([str(pos)], n)
        yield family
    rate = _gauge("spec_acceptance_rate_by_position", "accepted / proposed drafts at each draft position",
                  labels=["position"])
    for pos, (a, p) in enumerate(zip(s["accepted_by_position"], s["proposed_by_position"])):
        rate.add_metric([str(pos)], a / p if p else 0.0)
    yield rate
    yield _gauge("spec_tier_num_steps", "draft depth of the current tier (0 = plain decode)", s["tier_steps"])
    yield _gauge("spec_tier_topk", "branching factor of the current tier", s["tier_topk"])
    yield _gauge("spec_tier_num_draft_tokens", "tokens verified per round by the current tier",
                 s["tier_draft_tokens"])
    tiers = _counter("spec_tier_steps", "engine steps run with each tier", labels=["tier"])
    for tier, n in sorted(s["steps_per_tier"].items()):
        tiers.add_metric([tier], n)
    yield tiers
    yield _counter("spec_tier_switches", "adaptive tier switches", s["tier_switches"])


def _gauge(name: str, help: str, value: float | None = None, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, help, value, labels)


def _counter(name: str, help: str, value: float | None = None,
             labels: list[str] | None = None) -> CounterMetricFamily:
    # the library appends _total to the sample names (and to HELP / TYPE in the text format)
    return CounterMetricFamily(PREFIX + name, help, value, labels)


def engine_snapshot(engine: Engine, lossy: bool) -> dict:
    """Engine state for /metrics; runs on the engine thread (EngineLoop.call)."""
    sched = engine.scheduler
    snap = {"running": len(sched.running), "waiting": len(sched.waiting), "kv_capacity": engine.kv_capacity_slots,
            # cached pages no request references are reclaimable, so not "in use" (SGLang counts them the same way)
            "kv_used": engine.kv_capacity_slots - engine.page_table.num_available_slots, "lossy": int(lossy), "spec": None,
            "cache": engine.cache_state()}
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
