"""Helpers for the server tests: a tiny chat model, and a real `hyperdraft serve` process on 127.0.0.1.

The server runs as a subprocess through the real command line, so the tests see exactly what a user sees, and a
crash of the server is visible (the process exits) instead of hiding in a thread of the test process.
"""

from __future__ import annotations

import os
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


def add_chat_template(path: str) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m hyperdraft serve` on a free loopback port; a context manager that always stops it."""

    def __init__(self, model: str, *flags: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="hyperdraft-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "hyperdraft", "serve", "--model", model, "--port", str(self.port),
               "--device", "cpu", "--dtype", "float32", *flags]
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


def engine_state(url: str, headers: dict | None = None) -> dict:
    return httpx.get(url + "/server_info", headers=headers, timeout=30).json()["internal_states"][0]


def wait_engine_idle(url: str, headers: dict | None = None, timeout: float = 30.0) -> dict:
    """Poll /server_info until nothing runs or waits and every KV slot is free; fail with the last state."""
    deadline = time.monotonic() + timeout
    while True:
        state = engine_state(url, headers)
        idle = (state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0
                and state["kv_free_tokens"] == state["kv_capacity_tokens"])
        if idle:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine is not idle {timeout} s later: {state}")
        time.sleep(0.05)
