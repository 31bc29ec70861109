#!/usr/bin/env bash
# Set up with the test extras (transformers is the reference), check lint and formatting, and run
# the whole test suite.
# Usage: bash scripts/test.sh [PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
