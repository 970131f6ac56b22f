"""Helpers for the server tests: a tiny chat model, and a real `hyperdraft serve` process on 127.0.0.1.

The server runs as a subprocess through the real command line, so the tests see exactly what a user sees, and a
crash of the server is visible (the process exits) instead of hiding in a thread of the test process.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

# Roles other than these make the template raise, which the server must answer with a 400.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role: ' + m['role']) }}"
    "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
API_KEY = "test-key"
STARTUP_TIMEOUT_S = 120


def add_chat_template(path: str, template: str = CHAT_TEMPLATE) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = template
    tok.save_pretrained(path)
    return path


def served_name(model_path: str) -> str:
    """The model id a server answers to by default: the model directory's base name, never its path."""
    return os.path.basename(os.path.normpath(model_path))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m hyperdraft serve` on a free loopback port; a context manager that always stops it."""

    def __init__(self, model: str, *flags: str, env: dict[str, str] | None = None, fault_user: str | None = None):
        """fault_user: serve through serve_with_fault.py, which fails this `user`'s requests in the engine thread."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="hyperdraft-serve-", suffix=".log", delete=False)
        serve = ([sys.executable, "-m", "hyperdraft", "serve"] if fault_user is None else
                 [sys.executable, os.path.join(os.path.dirname(__file__), "serve_with_fault.py"), fault_user])
        cmd = [*serve, "--model", model, "--port", str(self.port), "--device", "cpu", "--dtype", "float32", *flags]
        # One intra-op thread, as in the test process: two processes on two cores must not oversubscribe.
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} during start-up:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the server did not answer /health within {STARTUP_TIMEOUT_S} s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def assert_alive(self) -> None:
        assert self.proc.poll() is None, f"the server died (exit {self.proc.returncode}):\n{self.output()}"

    def stop(self) -> bool:
        """SIGTERM, then SIGKILL if it hangs. True when the shutdown was graceful: the engine thread stopped and the
        process ended by the re-raised SIGTERM, as uvicorn does after a graceful shutdown."""
        if self.log.closed:  # stopped before
            return self._graceful
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._graceful = self.proc.returncode == -signal.SIGTERM and "hyperdraft: server stopped" in self.output()
        self.log.close()
        os.unlink(self.log.name)
        return self._graceful

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def scrape_metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    """GET /metrics, parsed by prometheus_client's parser: {'name' or 'name{"label": "value"}': value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    return {s.name + json.dumps(s.labels, sort_keys=True) * bool(s.labels): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def engine_state(url: str, headers: dict | None = None) -> dict:
    return httpx.get(url + "/server_info", headers=headers, timeout=30).json()["internal_states"][0]


def client_aborts(url: str, headers: dict | None = None) -> int:
    return httpx.get(url + "/server_info", headers=headers, timeout=30).json()["server_state"]["client_aborts"]


def wait_client_aborts(url: str, count: int, headers: dict | None = None, timeout: float = 30.0) -> dict:
    """Poll /server_info until the server has aborted `count` requests whose client left; return the engine state
    read in the same engine-thread call, i.e. right after those aborts ran."""
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(url + "/server_info", headers=headers, timeout=30).json()
        if info["server_state"]["client_aborts"] >= count:
            return info["internal_states"][0]
        if time.monotonic() > deadline:
            raise AssertionError(f"{count} client aborts expected, {info['server_state']} after {timeout} s")
        time.sleep(0.02)


def assert_idle(state: dict) -> None:
    assert (state["num_running_reqs"], state["num_waiting_reqs"]) == (0, 0), state
    assert state["kv_free_tokens"] + state.get("cache_evictable_tokens", 0) == state["kv_capacity_tokens"], state


def wait_engine_idle(url: str, headers: dict | None = None, timeout: float = 30.0) -> dict:
    """Poll /server_info until nothing runs or waits and every KV slot is free or in the prefix cache unreferenced;
    fail with the last state."""
    deadline = time.monotonic() + timeout
    while True:
        state = engine_state(url, headers)
        idle = (state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0
                and state["kv_free_tokens"] + state.get("cache_evictable_tokens", 0) == state["kv_capacity_tokens"])
        if idle:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine is not idle {timeout} s later: {state}")
        time.sleep(0.05)


# ---- prompts and stream helpers -------------------------------------------------------------------------------

WORDS = ["你好", "世界", "今天", "天气", "很好", "🙂", "🚀", "naïve", "café", "hello", "fox", "the", "quick", "1 2 3"]


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) for _ in range(n)]


def stream_text(stream) -> tuple[str, str | None]:
    text, reason = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason


def split_characters(tok, ids: list[int]) -> list[str]:
    """Non-ASCII characters of decode(ids) whose bytes straddle a token boundary."""
    full, found = tok.decode(ids), []
    for j in range(1, len(ids)):
        head = tok.decode(ids[:j])
        if head.endswith("\ufffd") and full.startswith(head.rstrip("\ufffd")):
            nxt = full[len(head.rstrip("\ufffd")):][:1]
            if nxt and nxt != "\ufffd" and ord(nxt) > 127:
                found.append(nxt)
    return found
