#!/usr/bin/env bash
# Create .venv (if needed) and install genfast into it: torch 2.13.0 first (a CPU build where no
# CUDA wheel is wanted; any unpinned torch would pull a multi-GB CUDA build), then the package.
# Usage: bash scripts/setup.sh [EXTRAS]   e.g. EXTRAS=test
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
if [ -n "$extras" ]; then
    .venv/bin/python -m pip install --quiet -e ".[$extras]"
else
    .venv/bin/python -m pip install --quiet -e .
fi
# Meta's official SAM 2 (`sam2`), the reference and baseline of genfast's SAM 2 (test and bench
# extras): installed without its dependencies, because it requires torchvision, whose PyPI wheels
# pin another torch (genfast/sam/sam2/official.py stubs the few torchvision names it imports; its
# other dependencies are in those extras). Built from source without its optional CUDA extension
# and against the torch installed above.
case ",$extras," in
*,test,* | *,bench,*)
    .venv/bin/python -m pip install --quiet "setuptools>=68" wheel
    SAM2_BUILD_CUDA=0 .venv/bin/python -m pip install --quiet --no-deps --no-build-isolation "sam2==1.1.0"
    ;;
esac
