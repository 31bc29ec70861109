#!/usr/bin/env bash
# Run a command as it would run on a CPU of a lower ISA level: genfast's kernels capped with
# GENFAST_ISA, and PyTorch's own (ATen, inductor, oneDNN, MKL) capped to match, so that an AVX-512
# machine measures and tests the AVX2 paths end to end (genfast.platform.hardware.torch_isa_env).
# Usage: bash scripts/with_isa.sh avx2 genfast bench llm ...
set -euo pipefail
level=${1:?usage: with_isa.sh LEVEL COMMAND...}
shift
python=$(command -v python || command -v python3)
[ -x "$(dirname "$0")/../.venv/bin/python" ] && python="$(dirname "$0")/../.venv/bin/python"
vars=$("$python" -c 'import sys; from genfast.platform.hardware import torch_isa_env; print(" ".join(f"{k}={v}" for k, v in torch_isa_env(sys.argv[1]).items()))' "$level")
# shellcheck disable=SC2086  # the variables are NAME=VALUE words without spaces
exec env $vars "$@"
