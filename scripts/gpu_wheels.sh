#!/usr/bin/env bash
# The wheels that `WHEELS=` in scripts/gpu_check.sh installs on a GPU machine without a network:
# the packages genfast and its CUDA tests need that such a machine's image lacks (it has torch,
# Triton, transformers, tokenizers, safetensors, scikit-image and pytest with xdist and timeout).
# Each is downloaded as a CPython 3.12 manylinux wheel at the version this checkout's environment
# has, so that the GPU machine runs what the CPU tests ran.
#
# Usage: bash scripts/gpu_wheels.sh [FOLDER]          (default: .whl, which .git/info/exclude should list)
set -euo pipefail
cd "$(dirname "$0")/.."
folder=${1:-.whl}
python=.venv/bin/python
[ -x "$python" ] || python=$(command -v python3)
# openai 3.x talks through httpx2/httpcore2; without them the serve tests skip (as on an H200,
# 2026-11-27, whose GPU serve-engine test went unrun).
packages=(diffusers segment-anything gguf fastapi starlette annotated-doc pydantic pydantic-core annotated-types
    typing-inspection uvicorn llguidance openai httpx2 httpcore2 jiter sniffio jsonschema
    jsonschema-specifications referencing rpds-py importlib-metadata lazy-importer opentelemetry-api)
pins=$("$python" - "${packages[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

missing = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"gpu_wheels: not installed here, so no version to fetch: {' '.join(missing)} (run scripts/setup.sh test)")
PY
)
platforms=()
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
    manylinux_2_34 manylinux_2_35; do
    platforms+=(--platform "${tag}_x86_64")
done
mkdir -p "$folder"
# shellcheck disable=SC2086  # one NAME==VERSION word per package
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$folder" $pins
echo "gpu_wheels: $(ls "$folder"/*.whl | wc -l) wheels, $(du -sh "$folder" | cut -f1), in $folder" >&2
