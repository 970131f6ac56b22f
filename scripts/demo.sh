#!/usr/bin/env bash
# Demo: set up .venv (if needed), make a tiny random model (once), generate from it.
# Safe to re-run; works on a fresh machine. HYPERDRAFT_CACHE picks where the model lives.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

source scripts/setup_venv.sh

# ---- tiny model (random weights: the text is gibberish, the pipeline is real) ----
MODEL="${HYPERDRAFT_CACHE:-$HOME/.cache/hyperdraft}/tiny-llama"
if [ ! -f "$MODEL/config.json" ]; then
  echo "==> writing a tiny random llama model to $MODEL" >&2
  rm -rf "$MODEL.tmp" && mkdir -p "$(dirname "$MODEL")"
  .venv/bin/hyperdraft make-tiny-model "$MODEL.tmp" --kind llama >/dev/null
  rm -rf "$MODEL" && mv "$MODEL.tmp" "$MODEL"
fi

echo "==> hyperdraft generate --model $MODEL --prompt 'Hello, world' --max-new-tokens 32 --temperature 0" >&2
.venv/bin/hyperdraft generate --model "$MODEL" --prompt "Hello, world" --max-new-tokens 32 --temperature 0
