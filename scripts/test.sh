#!/usr/bin/env bash
# Set up with the test extras (transformers is the reference), check lint and formatting, and run
# the whole test suite.
# Usage: bash scripts/test.sh [PYTEST ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Two workers, a test file each at a time (its module fixtures built once): compiling, most of the
# suite's time, runs on one thread. Tests marked `alone` run while the other worker waits. The
# slowest tests are listed at the end: the suite is kept under ~20 minutes on a 2-core CPU.
.venv/bin/python -m pytest -n 2 --dist loadfile --durations=30 "$@"
