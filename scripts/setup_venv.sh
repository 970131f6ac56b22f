#!/usr/bin/env bash
# Create .venv if needed and install hyperdraft[dev] into it. Sourced by demo.sh and test.sh; idempotent.
TORCH_PIN="torch==2.13.0"  # served from local disk; a bare `torch` would pull a multi-GB CUDA build
[ -x .venv/bin/python ] || python3 -m venv .venv
STAMP=.venv/.hyperdraft-installed
WANT="$TORCH_PIN $(cksum < pyproject.toml)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "==> installing $TORCH_PIN and hyperdraft[dev] into .venv" >&2
  .venv/bin/python -m pip install -qq "$TORCH_PIN"
  .venv/bin/python -m pip install -qq -e '.[dev]' "$TORCH_PIN"
  echo "$WANT" > "$STAMP"
fi
