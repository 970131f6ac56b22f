#!/usr/bin/env bash
# Tests: set up .venv (if needed) and run pytest; extra arguments go to pytest.
# Exits non-zero on any failure, including "no tests collected" (pytest exit 5).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# ---- environment (same block as scripts/demo.sh) ----
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

# pyproject's addopts already pass -q; a second -q (-qq) would hide pytest's closing "N passed" line.
rc=0
.venv/bin/python -m pytest tests "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; treating that as a failure" >&2
  exit 1
fi
exit "$rc"
