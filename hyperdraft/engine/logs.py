"""The "hyperdraft" logger at the engine's --log-level."""

from __future__ import annotations

import logging


def configure_logging(level: str) -> None:
    log = logging.getLogger("hyperdraft")
    log.setLevel(level.upper())
    if not log.handlers:  # without a handler, INFO lines (e.g. adaptive tier switches) would be dropped
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[hyperdraft %(levelname)s] %(message)s"))
        log.addHandler(handler)
