#!/usr/bin/env bash
# Set up with the test extras (transformers is the reference) and run the whole test suite.
# Usage: bash scripts/test.sh [PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/python -m pytest "$@"
