"""`hyperdraft serve`, with a fault injected through the server's output hook: a request whose OpenAI `user` field
equals argv[1] fails inside the engine thread when its first output is handed back (while it holds KV), so the
tests can check that one request's internal error stays its own. The remaining arguments are serve's flags.

Run as: python tests/helpers/serve_with_fault.py USER --model M --port P ...
"""

from __future__ import annotations

import sys

from hyperdraft.cli import build_parser
from hyperdraft.config import engine_args_from_namespace
from hyperdraft.server.launch import serve
from hyperdraft.server.options import serve_options_from_namespace


def main() -> None:
    fault_user, flags = sys.argv[1], sys.argv[2:]

    def hook(tag: str | None) -> None:
        if tag == fault_user:
            raise RuntimeError(f"fault injected for user={fault_user!r}")

    ns = build_parser().parse_args(["serve", *flags])
    serve(engine_args_from_namespace(ns), serve_options_from_namespace(ns), output_hook=hook)


if __name__ == "__main__":
    main()
