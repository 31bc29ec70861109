#!/usr/bin/env bash
# Set up, fetch the built-in default model (SmolLM2-135M-Instruct) and stream a completion with stats.
# Usage: bash scripts/demo.sh ["PROMPT"]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/genfast pull
.venv/bin/genfast generate "${1:-The capital of France is}" --max-new-tokens 64
