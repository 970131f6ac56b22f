"""A tensor-parallel server whose other rank dies (as the OOM killer would end it): requests fail with the reason,
/health and later requests get a 503 naming it, at once; the server used to spin on the failing step (requests
unanswered, /health ok)."""

from __future__ import annotations

import os
import signal
import time

import httpx

from helpers.server_fixtures import ServerProcess, served_name


def _descendants(pid: int) -> list[int]:
    """Every process under pid, by /proc's parent links, oldest first."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    found, frontier = [], [pid]
    while frontier:
        children = sorted(p for p, parent in parents.items() if parent in frontier)
        found += children
        frontier = children
    return found


def test_a_dead_rank_fails_requests_and_health_names_it(llama_path):
    with ServerProcess(llama_path, "--tp-size", "2", "--dist-timeout", "30") as server:
        body = {"model": served_name(llama_path), "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        os.kill(_descendants(server.proc.pid)[-1], signal.SIGKILL)  # the follower: the newest process under it
        time.sleep(0.5)
        start = time.monotonic()
        failed = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert failed.status_code >= 500 and "rank 1 exited" in failed.text and time.monotonic() - start < 30
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and "rank 1 exited" in health.text
        again = httpx.post(server.url + "/v1/completions", json=body, timeout=10)
        assert again.status_code == 503 and "rank 1 exited" in again.text
