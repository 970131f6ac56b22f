"""The `serve` flags (besides every engine flag) and the lossy-benchmark-mode guard. No fastapi import here."""

from __future__ import annotations

import argparse
import errno
import os
import socket
from dataclasses import dataclass

from hyperdraft.options import SIMULATE_ACCEPT_RATE_ENV, RuntimeOptions

# A token rarely spans more than a few characters; 32 per token lets any prompt that fits the context through and
# stops a multi-megabyte one before it costs seconds of tokenization.
PROMPT_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int  # 413 beyond this, before parsing
    max_prompt_chars: int  # prompt text (or message contents, or a rendered template) per request
    max_sequences: int  # prompts x n per request
    render_timeout_s: float  # rendering + tokenization of one request
    allow_client_chat_template: bool


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    max_queued_requests: int | None = None
    served_model_name: str | None = None
    allow_lossy_benchmark_mode: bool = False
    max_request_body_bytes: int = 4 << 20
    max_prompt_chars: int | None = None  # None: PROMPT_CHARS_PER_TOKEN x the context length
    max_sequences_per_request: int = 256
    render_timeout: float = 10.0
    allow_client_chat_template: bool = False

    def limits(self, context_len: int) -> RequestLimits:
        chars = self.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * context_len
        return RequestLimits(self.max_request_body_bytes, chars, self.max_sequences_per_request, self.render_timeout,
                             self.allow_client_chat_template)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    group.add_argument("--port", type=int, default=30000, help="port to bind (default: 30000)")
    group.add_argument("--api-key", metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health (401 otherwise)")
    group.add_argument("--max-queued-requests", type=int, metavar="N",
                       help="answer 503 to a request that would make more than N requests wait for a running slot "
                            "(default: no limit)")
    group.add_argument("--served-model-name", metavar="NAME",
                       help="the model id clients name and answers carry (default: the model directory's or "
                            "file's base name; the path itself never leaves the server)")
    group.add_argument("--max-request-body-bytes", type=int, default=4 << 20, metavar="N",
                       help="answer 413 to a larger request body, before parsing it (default: 4 MiB)")
    group.add_argument("--max-prompt-chars", type=int, metavar="N",
                       help="answer 400 to a request whose prompt text (or rendered chat) is longer, before "
                            f"tokenizing it (default: {PROMPT_CHARS_PER_TOKEN} x the context length)")
    group.add_argument("--max-sequences-per-request", type=int, default=256, metavar="N",
                       help="answer 400 to a request for more sequences (prompts x n) (default: 256)")
    group.add_argument("--render-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="answer 400 to a request whose chat rendering and tokenization take longer (default: 10)")
    group.add_argument("--allow-client-chat-template", action="store_true",
                       help="render chat templates that clients send (chat_template, or chat_template_kwargs."
                            "chat_template) in a sandboxed child process with this timeout and a length cap; "
                            "refused (400) without this flag")
    group.add_argument("--allow-lossy-benchmark-mode", action="store_true",
                       help="allow --speculative-simulate-accept-rate (or $%s): simulated acceptance changes the "
                            "outputs, so the server refuses it unless this is given, and marks every answer "
                            "with \"lossy_benchmark_mode\": true" % SIMULATE_ACCEPT_RATE_ENV)


def serve_options_from_namespace(ns: argparse.Namespace) -> ServeOptions:
    if not 1 <= ns.port <= 65535:
        raise ValueError(f"--port must be in [1, 65535], got {ns.port}")
    if ns.max_queued_requests is not None and ns.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {ns.max_queued_requests}")
    if ns.api_key is not None and not ns.api_key:
        raise ValueError("--api-key must not be empty")
    for name in ("max_request_body_bytes", "max_prompt_chars", "max_sequences_per_request"):
        if getattr(ns, name) is not None and getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    if not ns.render_timeout > 0:
        raise ValueError(f"--render-timeout must be > 0, got {ns.render_timeout}")
    return ServeOptions(ns.host, ns.port, ns.api_key, ns.max_queued_requests, ns.served_model_name,
                        ns.allow_lossy_benchmark_mode, ns.max_request_body_bytes, ns.max_prompt_chars,
                        ns.max_sequences_per_request, ns.render_timeout, ns.allow_client_chat_template)


def served_model_name(args, opts: ServeOptions) -> str:
    return opts.served_model_name or os.path.basename(os.path.normpath(args.model_path))


def lossy_requested(args) -> bool:
    """Simulated acceptance asked for, by the engine flag or its environment variable."""
    return RuntimeOptions.from_args(args).simulate_accept_rate is not None


def check_lossy(lossy: bool, opts: ServeOptions) -> None:
    if lossy and not opts.allow_lossy_benchmark_mode:
        raise ValueError("speculative_simulate_accept_rate (or $%s) simulates acceptance, so outputs are not the "
                         "model's: the server refuses to start with it unless --allow-lossy-benchmark-mode is given"
                         % SIMULATE_ACCEPT_RATE_ENV)


def check_bind(opts: ServeOptions) -> None:
    """Bind --host:--port once, before the model loads: an address that does not resolve, or a port another process
    holds, surfaced only after minutes of loading, as uvicorn's '[Errno -2] Name or service not known' naming no flag.
    The probe binds as asyncio's create_server (uvicorn's) will: every address the host resolves to ("" is every
    interface), IPv6 sockets IPv6-only, an address this machine lacks skipped, SO_REUSEADDR (a port in TIME_WAIT
    passes here as it would there)."""
    try:
        infos = socket.getaddrinfo(opts.host or None, opts.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {opts.host!r} is not an address this machine can bind ({e})") from None
    bound = 0
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRNOTAVAIL:  # asyncio skips it too
                    continue
                raise ValueError(f"--host {opts.host!r} --port {opts.port}: cannot bind {address[0]} "
                                 f"({e.strerror})") from None
            bound += 1
    if not bound:
        raise ValueError(f"--host {opts.host!r}: none of its addresses is this machine's")
