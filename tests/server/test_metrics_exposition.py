"""/metrics exposition without a server: ServerMetrics.render, parsed back by prometheus_client's parser, exposes the
metric names, types, labels and values that scrapers saw before prometheus_client wrote the format."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hyperdraft.server.metrics import LATENCY_BUCKETS, ServerMetrics

SPEC = {"verify_forwards": 9, "verifies": 6, "draft_tokens": 24, "accepted_tokens": 10, "emitted_tokens": 16,
        "accept_length_hist": [0, 3, 2, 1], "proposed_by_position": [5, 4], "accepted_by_position": [3, 1],
        "steps_per_tier": {"chain3": 7, "tree2": 2}, "tier_switches": 1, "tier_steps": 3, "tier_topk": 1,
        "tier_draft_tokens": 4}


CACHE = {"radix_cache": True, "cache_tokens": 640, "cache_evictable_tokens": 512, "cache_evicted_tokens": 96,
         "cache_lookup_tokens": 2000, "cache_hit_tokens": 1500, "cache_hit_rate": 0.75}


def snapshot(spec: dict | None = SPEC, cache: dict = CACHE) -> dict:
    return {"running": 2, "waiting": 1, "kv_capacity": 4096, "kv_used": 1024, "lossy": 1, "spec": spec, "cache": cache}


def parse(text: str) -> tuple[dict[str, str], dict[tuple, float]]:
    """({family name: type}, {(sample name, (label, value), ...): value})."""
    types, samples = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, *sorted(s.labels.items()))] = s.value
    return types, samples


@pytest.fixture
def scraped() -> tuple[dict[str, str], dict[tuple, float]]:
    m = ServerMetrics()
    for _ in range(3):
        m.requests_received.inc()
    for reason in ("stop", "stop", "length", "abort"):
        m.finished(reason)
    m.error(400)
    m.error(503)
    m.error(503)
    m.prompt_tokens.inc(17)
    m.generation_tokens.inc(42)
    for v in (0.004, 0.03, 0.3, 3.0):
        m.ttft.observe(v)
    m.itl.observe(0.02, 3)  # one 3-token step: 3 gaps of 0.02 s
    m.itl.observe(0.0005)
    m.itl.observe(100.0)  # past the last bucket: +Inf only
    m.e2e.observe(1.5)
    return parse(m.render(snapshot()))


def test_family_names_and_types(scraped):
    types, samples = scraped
    counters = ["requests_received", "requests_finished", "http_errors", "prompt_tokens", "generation_tokens",
                "spec_verify_steps", "spec_verifies", "spec_draft_tokens", "spec_accepted_tokens",
                "spec_emitted_tokens", "spec_position_proposed", "spec_position_accepted", "spec_tier_steps",
                "spec_tier_switches", "cache_lookup_tokens", "cache_hit_tokens", "cache_evicted_tokens"]
    gauges = ["num_running_reqs", "num_waiting_reqs", "kv_capacity_tokens", "kv_used_tokens", "kv_usage",
              "lossy_benchmark_mode", "cache_tokens", "cache_evictable_tokens", "cache_hit_rate", "spec_avg_accept_length", "spec_acceptance_rate_by_position",
              "spec_tier_num_steps", "spec_tier_topk", "spec_tier_num_draft_tokens"]
    histograms = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                  "spec_accept_length"]
    expected = {f"hyperdraft_{n}": "counter" for n in counters} | {f"hyperdraft_{n}": "gauge" for n in gauges} | {
        f"hyperdraft_{n}": "histogram" for n in histograms}
    assert types == expected
    # counter samples end in _total exactly once, and prometheus_client adds no _created series
    names = {key[0] for key in samples}
    assert {f"hyperdraft_{n}_total" for n in counters} <= names
    assert not names & {f"hyperdraft_{n}" for n in counters}
    assert not [name for name in names if name.endswith(("_total_total", "_created"))]


def test_request_counters(scraped):
    _, samples = scraped
    assert samples[("hyperdraft_requests_received_total",)] == 3
    finished = {key[1][1]: v for key, v in samples.items() if key[0] == "hyperdraft_requests_finished_total"}
    assert finished == {"stop": 2, "length": 1, "abort": 1, "error": 0}  # every reason, 0 when unseen
    errors = {key[1][1]: v for key, v in samples.items() if key[0] == "hyperdraft_http_errors_total"}
    assert errors == {"400": 1, "503": 2}
    assert samples[("hyperdraft_prompt_tokens_total",)] == 17
    assert samples[("hyperdraft_generation_tokens_total",)] == 42


def test_latency_histograms(scraped):
    _, samples = scraped

    def buckets(name: str) -> dict[str, float]:
        return {key[1][1]: v for key, v in samples.items() if key[0] == f"hyperdraft_{name}_bucket"}

    ttft = buckets("time_to_first_token_seconds")
    assert set(ttft) == {repr(float(b)) for b in LATENCY_BUCKETS} | {"+Inf"}
    assert [ttft[b] for b in ("0.001", "0.0025", "0.005", "0.025", "0.05", "0.25", "0.5", "2.5", "5.0", "80.0")] == [
        0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert ttft["+Inf"] == samples[("hyperdraft_time_to_first_token_seconds_count",)] == 4
    assert samples[("hyperdraft_time_to_first_token_seconds_sum",)] == pytest.approx(3.334)
    itl = buckets("inter_token_latency_seconds")
    assert [itl[b] for b in ("0.001", "0.01", "0.025", "80.0")] == [1, 1, 4, 4]
    assert itl["+Inf"] == samples[("hyperdraft_inter_token_latency_seconds_count",)] == 5  # 3 + 1 + 1
    assert samples[("hyperdraft_inter_token_latency_seconds_sum",)] == pytest.approx(3 * 0.02 + 0.0005 + 100.0)
    e2e = buckets("e2e_request_latency_seconds")
    assert (e2e["1.0"], e2e["2.5"], samples[("hyperdraft_e2e_request_latency_seconds_count",)]) == (0, 1, 1)


def test_engine_gauges(scraped):
    _, samples = scraped
    assert samples[("hyperdraft_num_running_reqs",)] == 2
    assert samples[("hyperdraft_num_waiting_reqs",)] == 1
    assert samples[("hyperdraft_kv_capacity_tokens",)] == 4096
    assert samples[("hyperdraft_kv_used_tokens",)] == 1024
    assert samples[("hyperdraft_kv_usage",)] == 0.25
    assert samples[("hyperdraft_lossy_benchmark_mode",)] == 1


def test_prefix_cache_metrics(scraped):
    _, samples = scraped
    assert samples[("hyperdraft_cache_tokens",)] == 640 and samples[("hyperdraft_cache_evictable_tokens",)] == 512
    assert samples[("hyperdraft_cache_hit_tokens_total",)] == 1500
    assert samples[("hyperdraft_cache_lookup_tokens_total",)] == 2000
    assert samples[("hyperdraft_cache_hit_rate",)] == 0.75 and samples[("hyperdraft_cache_evicted_tokens_total",)] == 96
    _, off = parse(ServerMetrics().render(snapshot(cache={"radix_cache": False})))
    assert not [k for k in off if k[0].startswith("hyperdraft_cache_")]  # --disable-radix-cache: no cache families


def test_spec_metrics(scraped):
    _, samples = scraped
    assert samples[("hyperdraft_spec_verify_steps_total",)] == 9
    assert samples[("hyperdraft_spec_verifies_total",)] == 6
    assert samples[("hyperdraft_spec_draft_tokens_total",)] == 24
    assert samples[("hyperdraft_spec_accepted_tokens_total",)] == 10
    assert samples[("hyperdraft_spec_emitted_tokens_total",)] == 16
    assert samples[("hyperdraft_spec_avg_accept_length",)] == pytest.approx(16 / 6)
    accept = {key[1][1]: v for key, v in samples.items() if key[0] == "hyperdraft_spec_accept_length_bucket"}
    assert accept == {"1.0": 3, "2.0": 5, "3.0": 6, "+Inf": 6}  # cumulative over [_, 3, 2, 1]
    assert samples[("hyperdraft_spec_accept_length_sum",)] == 1 * 3 + 2 * 2 + 3 * 1
    assert samples[("hyperdraft_spec_accept_length_count",)] == 6

    def by(name: str, label: str) -> dict[str, float]:
        return {dict(key[1:])[label]: v for key, v in samples.items() if key[0] == f"hyperdraft_{name}"}

    assert by("spec_position_proposed_total", "position") == {"0": 5, "1": 4}
    assert by("spec_position_accepted_total", "position") == {"0": 3, "1": 1}
    assert by("spec_acceptance_rate_by_position", "position") == {"0": 0.6, "1": 0.25}
    assert samples[("hyperdraft_spec_tier_num_steps",)] == 3
    assert samples[("hyperdraft_spec_tier_topk",)] == 1
    assert samples[("hyperdraft_spec_tier_num_draft_tokens",)] == 4
    assert by("spec_tier_steps_total", "tier") == {"chain3": 7, "tree2": 2}
    assert samples[("hyperdraft_spec_tier_switches_total",)] == 1


def test_no_spec_section_without_speculation():
    types, samples = parse(ServerMetrics().render(snapshot(spec=None)))
    assert "hyperdraft_kv_usage" in types
    assert not [name for name in types if name.startswith("hyperdraft_spec_")]
    # before any request: counters at 0, every finish reason present, no HTTP error series yet
    assert samples[("hyperdraft_requests_received_total",)] == 0
    assert {key[1][1] for key in samples if key[0] == "hyperdraft_requests_finished_total"} == {
        "stop", "length", "abort", "error"}
    assert not [key for key in samples if key[0] == "hyperdraft_http_errors_total"]


def test_each_server_metrics_has_its_own_registry():
    a, b = ServerMetrics(), ServerMetrics()
    a.requests_received.inc()
    a.finished("stop")
    _, sa = parse(a.render(snapshot(spec=None)))
    _, sb = parse(b.render(snapshot(spec=None)))
    assert sa[("hyperdraft_requests_received_total",)] == 1
    assert sb[("hyperdraft_requests_received_total",)] == 0
    assert sb[("hyperdraft_requests_finished_total", ("reason", "stop"))] == 0


def test_render_reads_the_snapshot_it_is_given():
    m = ServerMetrics()
    m.render(snapshot())
    _, samples = parse(m.render(dict(snapshot(spec=None), running=5, kv_used=0)))
    assert samples[("hyperdraft_num_running_reqs",)] == 5
    assert samples[("hyperdraft_kv_usage",)] == 0
    assert not [key for key in samples if key[0].startswith("hyperdraft_spec_")]
