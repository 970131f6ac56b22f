#!/usr/bin/env bash
# Tests: set up .venv (if needed) and run pytest; extra arguments go to pytest.
# Exits non-zero on any failure, including "no tests collected" (pytest exit 5).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

source scripts/setup_venv.sh

# pyproject's addopts already pass -q; a second -q (-qq) would hide pytest's closing "N passed" line.
# Two workers, whole files each (module fixtures built once): most tests run tiny models whose steps are Python-bound,
# so two processes on two cores took the suite from 747 s to 463 s. `-n 0` (in "$@", which comes later) runs serially.
rc=0
.venv/bin/python -m pytest tests -n 2 --dist loadfile "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; treating that as a failure" >&2
  exit 1
fi
exit "$rc"
