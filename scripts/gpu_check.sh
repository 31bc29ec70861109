#!/usr/bin/env bash
# The CUDA check: set-up, the CUDA tests, then the GPU benchmarks, every table into one markdown
# file. Runs on any machine where torch sees an NVIDIA GPU, from a fresh clone.
#
# Usage: bash scripts/gpu_check.sh [OUTPUT.md]          (default: gpu-check.md)
#   STAGES   which parts, comma-separated (default: all of them, in this order):
#            tests       pytest tests/cuda (plus what else PYTEST_ARGS names)
#            decode      benchmarks/cuda_decode.py: a compiled decode step's time, GPU-busy share,
#                        launches and CUDA-graph replays per token, per weight format and kernel
#            linear      benchmarks/cuda_linear.py: the Triton kernels' block sizes, then decode's
#                        matrix-vector products per weight format
#            stalls      benchmarks/cuda_kernel_stalls.py under Nsight Compute: each linear kernel's
#                        DRAM GB/s, occupancy and stall reasons (why a kernel streams slower than bf16's)
#            llm-7b      genfast bench llm on Llama-2-7B's shape (--model random:llama-2-7b)
#            llm-8b      the same on Llama-3.1-8B's shape
#            llm-70b     Llama-2-70B's shape in int4 (its bf16 weights do not fit one GPU), alone and
#                        with a Llama-2-7B draft
#            serve       benchmarks/serve_load.py at --max-batch 1 and 8 on the 8B shape
#            sam-attention  benchmarks/sam_attention.py on CUDA: ViT-B's two attention shapes, each
#                        way of adding the relative-position bias (materialized, folded, FlexAttention)
#            sam-b, sam-h  genfast bench sam on CUDA, vit_b and vit_h
#            sam-amg     genfast bench sam --automatic on CUDA (vit_b, the automatic mask generator
#                        against the original package's)
#            diffusion   genfast bench diffusion (SDXL 1024x1024, 30 steps) on CUDA
#            flux        genfast bench diffusion on CUDA, the whole FLUX.1-schnell at 1024x1024, 4 steps:
#                        diffusers' bf16 pipeline, then the GPU's rows to dynamic-fp8 and the block cache
#                        (flux-fast's recipe: bf16, fused QKV, compile, fp8; its published ~2.5x on an H100)
#   WORKDIR  where logs and JSON rows go (default /tmp/genfast-gpu)
#   WHEELS   a folder of wheels to install offline (no index, no dependencies) into WORKDIR/site
#            instead of `pip install -e .[test]`: for machines with torch but no network
#            (scripts/gpu_wheels.sh downloads the ones such a machine lacks).
#   LLM_STEPS, NEW_TOKENS, REPEATS: the LLM ladder's rows (default bf16,compile,int8,int4,spec-int4), 256, 3;
#            LLM_ARGS more `genfast bench llm` flags (split at spaces), e.g. LLM_ARGS="--int4-group-size 128".
#   DECODE_VARIANTS  the decode stage's weight formats and kernels, comma-separated (default: all of
#            benchmarks/cuda_decode.py's), e.g. DECODE_VARIANTS="bf16,int8 triton,int4 g32 torch";
#            DECODE_ARGS its other flags (split at spaces), e.g. DECODE_ARGS="--layers 32 --top 12" for the
#            whole 7B-shape model's step.
#   LINEAR_ARGS  the linear stage's cuda_linear.py flags (split at spaces; default "--rows 1,8 --sweep"),
#            LINEAR_VARIANTS its variants, comma-separated, kept whole (default: all of them), e.g.
#            LINEAR_ARGS="--rows 8 --shapes llama-2-7b" LINEAR_VARIANTS="bf16 F.linear,int4 g32 triton".
#   STALLS_ARGS, STALLS_VARIANTS  the same for the stalls stage (default "--shapes llama-2-7b --rows 1,8";
#            variants "bf16 F.linear,int8 triton,int4 g32 triton,int4 g32 triton x-sums,int4 g32 tinygemm
#            k-tiles 8").
#   SAM_ARGS, DIFFUSION_ARGS: more `genfast bench sam|diffusion` flags (split at spaces; they come
#            last, so they override), e.g. SAM_ARGS="--batch-size 1 --steps original,baseline,compile".
#   PYTEST_ARGS  more pytest arguments for the tests stage (split at spaces)
#   PYTEST_K     a pytest -k expression for the tests stage, kept whole (e.g. "dequantized_weight or per_rank")
#   STAGE_TIMEOUT  seconds a stage may run before it is stopped and reported: N for every stage, or
#            NAME=N,NAME=N for those named (default: no limit). A stopped stage keeps what it printed:
#            every benchmark prints each row as it finishes, the tests each outcome.
# GPU time is scarce: one pass gives every table; a stage that fails is reported in the file and
# the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
out=$(realpath -m "${1:-gpu-check.md}")
work=${WORKDIR:-/tmp/genfast-gpu}
stages=${STAGES:-tests,decode,linear,stalls,llm-7b,llm-8b,llm-70b,serve,sam-attention,sam-b,sam-h,sam-amg,diffusion,flux}
python=${PYTHON:-python3}
mkdir -p "$work"
export PYTHONUNBUFFERED=1

if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch sees no CUDA GPU here; nothing to check" >&2
    exit 1
fi
if [ -n "${WHEELS:-}" ]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$work/site" "$WHEELS"/*.whl
    export PYTHONPATH="$repo:$work/site${PYTHONPATH:+:$PYTHONPATH}"
else
    "$python" -m pip install -q -e ".[test]"
fi
genfast=("$python" -m genfast)

{
    echo "# genfast GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1
    "$python" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)'
    # genfast's Triton kernels are laid out by Triton's compiler, which differs between versions
    "$python" -c 'import triton; print("triton", triton.__version__)' 2>&1 | tail -n 1
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo '```'
    # A machine whose own torch is older than genfast's pin (WHEELS installs no torch): say what
    # differs there, so that its tables are read with it.
    "$python" - <<'PY'
import torch
from torch.torch_version import TorchVersion
if TorchVersion(torch.__version__) < (2, 13):
    print(f"\n**torch {torch.__version__} is older than the 2.13 genfast requires.** Known differences: "
          "`genfast serve` decodes without CUDA graphs (torch < 2.13 cannot replay them on its scheduler "
          "thread), so serving throughput is understated.")
PY
} > "$out"

stage_limit() {  # STAGE_TIMEOUT's seconds for stage $1 (0: no limit)
    local spec=${STAGE_TIMEOUT:-0} item
    if [[ $spec != *=* ]]; then
        echo "$spec"
        return
    fi
    for item in ${spec//,/ }; do
        if [[ ${item%%=*} == "$1" ]]; then
            echo "${item#*=}"
            return
        fi
    done
    echo 0
}

# stage NAME TITLE COMMAND...: run a stage if STAGES names it; its output (a markdown table at the
# end, as every benchmark here prints) and wall time go to the file, its whole log beside it.
stage() {
    local name=$1 title=$2
    shift 2
    [[ ",$stages," == *",$name,"* ]] || return 0
    local log="$work/$name.log" start=$SECONDS
    echo "== $name: $*" >&2
    # SIGINT, not TERM: pytest then still prints its failures' tracebacks and summary (a stage cut
    # at its limit on an H100 lost the one failure's cause), and a benchmark its traceback.
    timeout -s INT -k 30 "$(stage_limit "$name")" "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    {
        echo
        echo "## $title"
        echo
        echo "\`$*\` (exit $rc, $((SECONDS - start)) s)"
        echo
        grep -E '^(\||#|[0-9]+ (passed|failed)|=+ .*(passed|failed|error|skipped)|(FAILED|ERROR) )' "$log" | grep -v '^#$' || true
        if [ "$rc" != 0 ]; then
            echo
            echo '```'
            tail -n 30 "$log"
            echo '```'
        fi
    } >> "$out"
}

read -ra llm_args <<< "${LLM_ARGS:-}"
llm_ladder() {  # sets `ladder`: random weights at the shape, drawn on the GPU (genfast/llm/checkpoints/random_model.py)
    ladder=("${genfast[@]}" bench llm --model "random:$1" --device cuda --steps "$2" --prompt-tokens 128
        --new-tokens "${NEW_TOKENS:-256}" --repeats "${REPEATS:-3}" --json "$work/llm-$1.json" --force "${@:3}"
        "${llm_args[@]}")
}

read -ra pytest_args <<< "${PYTEST_ARGS:-}"
if [ -n "${PYTEST_K:-}" ]; then pytest_args+=(-k "$PYTEST_K"); fi
# The tests compile small models: CPU-bound, so they run in parallel where pytest-xdist is installed,
# each worker with few compile threads. -v names every outcome as it comes (a stage stopped at its
# limit keeps them); pytest-timeout, where installed, ends a hung test rather than the stage.
compile_threads=()
if "$python" -c 'import xdist' 2>/dev/null; then
    # (an H200 machine's 16 cores: 14 workers of one compile thread ran 52 of the 57 tests in 205 s)
    # worksteal: an idle worker takes tests queued behind a long one (three tests never started
    # behind the max-autotune compiles on an H100, 2026-11-26, with the default load scheduling)
    pytest_args=(-n "$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))" --dist worksteal "${pytest_args[@]}")
    compile_threads=(env "TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}")
fi
if "$python" -c 'import pytest_timeout' 2>/dev/null; then
    pytest_args=(--timeout 600 "${pytest_args[@]}")
fi
stage tests "CUDA tests" "${compile_threads[@]}" "$python" -m pytest -v -rfEs --tb=short -p no:cacheprovider tests/cuda \
    "${pytest_args[@]}"
read -ra decode_args <<< "${DECODE_ARGS:-}"
if [ -n "${DECODE_VARIANTS:-}" ]; then decode_args+=(--variants "$DECODE_VARIANTS"); fi
stage decode "A compiled decode step, Llama-2-7B shape (4 blocks unless DECODE_ARGS says)" "$python" \
    benchmarks/cuda_decode.py "${decode_args[@]}"
read -ra linear_args <<< "${LINEAR_ARGS:---rows 1,8 --sweep}"
if [ -n "${LINEAR_VARIANTS:-}" ]; then linear_args+=(--variants "$LINEAR_VARIANTS"); fi
stage linear "Decode's matrix-vector products" "$python" benchmarks/cuda_linear.py "${linear_args[@]}"
read -ra stalls_args <<< "${STALLS_ARGS:---shapes llama-2-7b --rows 1,8}"
stall_variants="bf16 F.linear,int8 triton,int4 g32 triton,int4 g32 triton x-sums,int4 g32 tinygemm k-tiles 8"
stalls_args+=(--variants "${STALLS_VARIANTS:-$stall_variants}")
stage stalls "Decode's linear kernels under Nsight Compute" "$python" benchmarks/cuda_kernel_stalls.py \
    "${stalls_args[@]}"
ladder_steps=${LLM_STEPS:-bf16,compile,int8,int4,spec-int4}
llm_ladder llama-2-7b "$ladder_steps"
stage llm-7b "LLM ladder, Llama-2-7B shape (random weights)" "${ladder[@]}"
llm_ladder llama-3.1-8b "$ladder_steps"
stage llm-8b "LLM ladder, Llama-3.1-8B shape (random weights)" "${ladder[@]}"
# 70B fits one GPU only quantized: int4, then speculative decoding of that int4 model with a bf16
# Llama-2-7B draft (gpt-fast's 70B pairing).
llm_ladder llama-2-70b int4,spec-model:random:llama-2-7b --spec-target int4
stage llm-70b "Llama-2-70B shape in int4 on one GPU, with a Llama-2-7B draft (random weights)" "${ladder[@]}"
stage serve "Serving throughput, Llama-3.1-8B shape (random weights)" "$python" benchmarks/serve_load.py \
    --model random:llama-3.1-8b --clients 8 --tokens 128 --batches 1,8 --repeats 3
read -ra sam_args <<< "${SAM_ARGS:-}"
read -ra diffusion_args <<< "${DIFFUSION_ARGS:-}"
stage sam-attention "SAM's attention with the relative-position bias, vit_b's shapes" "$python" \
    benchmarks/sam_attention.py --device cuda
stage sam-b "SAM ladder, vit_b (random weights)" "${genfast[@]}" bench sam --device cuda --model vit_b \
    --json "$work/sam-vit_b.json" --force "${sam_args[@]}"
stage sam-h "SAM ladder, vit_h (random weights)" "${genfast[@]}" bench sam --device cuda --model vit_h \
    --json "$work/sam-vit_h.json" --force "${sam_args[@]}"
stage sam-amg "SAM automatic mask generator, vit_b (random weights)" "${genfast[@]}" bench sam --automatic \
    --device cuda --model vit_b --batch-size 1 --json "$work/sam-amg.json" --force "${sam_args[@]}"
stage diffusion "Diffusion ladder, SDXL 1024x1024, 30 steps (random weights)" "${genfast[@]}" bench diffusion \
    --device cuda --arch sdxl --size 1024 --denoising-steps 30 --json "$work/diffusion.json" --force \
    "${diffusion_args[@]}"
stage flux "FLUX.1-schnell whole, 1024x1024, 4 steps (random weights)" "${genfast[@]}" bench diffusion \
    --device cuda --arch flux-schnell --blocks 57 --size 1024 --denoising-steps 4 \
    --steps diffusers,sdpa,fused-qkv,dynamic-int8,dynamic-fp8,regional-compile,feature-cache,cache-dit \
    --json "$work/flux.json" --force "${diffusion_args[@]}"
echo "gpu_check: wrote $out" >&2
