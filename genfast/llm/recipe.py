"""gpt-fast's recipe as named steps (genfast/recipe.py), each on top of the previous, and the one
place it is applied.

The steps, in ladder order, with what each changes and its accuracy budget (tests/llm), are the
`RECIPE` below; `genfast bench llm --list-steps` prints them as a table with how each runs on
this machine. Applying them (`apply_recipe` then `make_generator`): the dtype and quantization
happen as the weights load, block by block (the whole model never exists at full size); then the
steps' transforms run on the loaded model (part "model"); compiling is the generator's, which
compiles prefill and decode (or the serving engine's, which takes `settings.compile`).

`--dtype auto` on a CPU that emulates bf16 arithmetic keeps the bf16 step as bf16 weights with
fp32 arithmetic: decode reads half the bytes. `--dtype float32`
leaves the step out. Speculative decoding is not a step: it needs a draft (--draft, --self-draft,
--prompt-lookup) and combines with any step.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from genfast import steps
from genfast.errors import UserError
from genfast.quant import QUANT_MODES
from genfast.recipe import Plan, Recipe, Requirement, Step, Target

if TYPE_CHECKING:
    from genfast.llm.decoding.generate import Generator
    from genfast.llm.loading import LoadedModel

DEFAULT_STEP = "compile"  # what generate, chat and serve run unless told otherwise


@dataclass(frozen=True)
class LlmSettings(steps.StepSettings):
    """What the recipe's steps set; `apply_recipe` and `make_generator` make a model run so."""

    compile: bool = False
    quant: str = "none"  # weight-only quantization on load: none, int8 or int4
    # Every row's logits the same bits however it is batched (genfast/llm/model/invariance.py):
    # on, off, or None: where the model and machine allow.
    batch_invariant: bool | None = None


# What CUDA's quantized kernels measured, said to the user with the step (docs/performance.md has
# the current figures): int8's Triton GEMV in a compiled decode step of 4 Llama-2-7B-shaped blocks
# on an H100; int4 on tinygemm in the whole model's ladder.
CUDA_STEP_MEASURED = "in a Llama-2-7B-shaped decode step (4 blocks) on an H100; whole-model decode not measured yet"
CUDA_INT4_MEASURED = (
    "1.68x compiled bf16 decode on the whole Llama-2-7B shape on an H100 (287.7 against 171.6 tok/s); "
    "prefill dequantizes into cuBLAS (through tinygemm a 128-token prefill took 7x bf16's, TTFT 60 against "
    "8 ms; the dequantized prefill is not measured yet)"
)


def _cuda_quantized_note(bits: int, target: Target) -> str:
    """Which kernel `bits`-bit weights run on CUDA (genfast.quant.linear's rule, for the recipe's
    weights: int4 in groups of 32, int8 per channel, an Ampere or later GPU) and what it measured."""
    import torch

    from genfast.platform.hardware import resolve_dtype
    from genfast.quant.linear import cuda_weight_only_kernel

    dtype = resolve_dtype(target.dtype, target.device)
    kernel = cuda_weight_only_kernel(bits, per_channel=bits == 8, dtype=dtype, int4pack_ok=bits == 4)
    if kernel == "int4pack" and dtype == torch.bfloat16:  # (other activations dequantize: QuantLinear.forward)
        return f"int4 decode runs tinygemm (torch's _weight_int4pack_mm): {CUDA_INT4_MEASURED}"
    if kernel == "triton":
        if bits == 8:
            return f"int8 runs a Triton GEMV: 1.26x compiled bf16 {CUDA_STEP_MEASURED}"
        return (
            "int4 runs a Triton GEMV (tinygemm takes bf16 activations only): it streamed 0.7-0.8 TB/s on an H100 "
            "and an H200, slower than bf16 decode"
        )
    return (
        "Triton is not installed (torch's CUDA wheels bring it): torch's own int8 op or the dequantize "
        "path, measured slower than unquantized decode"
    )


def _quantized_decode_note(bits: int) -> Requirement:
    """What `bits`-bit weights cost here when genfast's fast kernels cannot run them; on CUDA, the
    kernel they run and what it measured."""

    def note(target: Target) -> str | None:
        if target.device.type == "cuda":
            return _cuda_quantized_note(bits, target)
        if target.device.type == "cpu":
            why = steps.native_int8_note(target)
            if not why:
                return None
        else:
            why = f"no quantized kernel for {target.device.type}"
        return (
            f"quantized weights use the slow dequantize path ({why}): they save memory, but decode is slower "
            "than unquantized here (`genfast info` says why)"
        )

    return note


RECIPE = Recipe(
    "llm",
    LlmSettings,
    [
        steps.baseline("eager PyTorch in fp32 with a static KV cache"),
        steps.bf16_weights("logits cosine >= 0.999 on average vs fp32"),
        steps.compile_step(
            "torch.compile of prefill and decode (fullgraph; freezing on CPU, CUDA graphs on CUDA)",
            "greedy tokens equal to eager's",
            {"compile": True},
        ),
        Step(
            "int8",
            "int8 weights (one scale per output channel), quantized on load",
            "next-token KL vs bf16 <= 0.02 nats on average, 0.15 at worst; top-1 agreement >= 90%",
            {"quant": "int8"},
            fallback=_quantized_decode_note(8),
        ),
        Step(
            "int4",
            "int4 weights in groups of 32 (int8 output head), instead of int8",
            "logits cosine >= 0.998 on average vs bf16",
            {"quant": "int4"},
            fallback=_quantized_decode_note(4),
        ),
    ],
)


def plan(
    step: str,
    device: str = "auto",
    dtype: str = "auto",
    quant: str | None = None,
    compile: bool = True,
    batch_invariant: bool | None = None,
) -> Plan[LlmSettings]:
    """The LLM recipe up to `step` on `device`, `dtype` being the bf16 step's; `quant` (when given)
    and `compile=False` override what the steps set: the flags --quant and --no-compile are
    shorthands on top of --recipe. `batch_invariant`: --(no-)batch-invariant, with any step."""
    from genfast.platform.hardware import dtype_name, resolve_device

    result = RECIPE.plan(step, Target(resolve_device(device), dtype_name(dtype)))
    settings = result.settings
    if quant is not None:
        if quant not in QUANT_MODES:
            raise UserError(f"unknown --quant {quant!r}; use one of {', '.join(QUANT_MODES)}")
        settings = replace(settings, quant=quant)
    if not compile:
        settings = replace(settings, compile=False)
    settings = replace(settings, batch_invariant=batch_invariant)
    return replace(result, settings=settings)


def apply_recipe(
    model: str | None,
    settings: LlmSettings,
    device: str = "auto",
    threads: int | None = None,
    group_size: int | None = None,
    tp: int = 1,
) -> LoadedModel:
    """The model `model` names, loaded to run as `settings` say: in their dtype and quantization
    (`group_size` columns per scale), this rank's shard when `tp` > 1, batch-invariant where they
    say so, then the steps' transforms. Compiling is the generator's: make_generator."""
    from genfast.llm import loading

    loaded = loading.load(
        model, device, settings.dtype, threads, settings.quant, group_size, tp, settings.batch_invariant
    )
    loaded.transforms = RECIPE.apply(settings, {"model": loaded.model}, Target(loaded.device, settings.dtype))
    return loaded


def make_generator(
    loaded: LoadedModel,
    max_seq_len: int | None,
    batch_size: int,
    compile: bool,
    draft: str | None = None,
    speculate_k: int | None = None,
) -> Generator:
    """A Generator (compiled when `compile`: the recipe's compile step), or with `draft`
    (genfast.llm.decoding.drafters.parse_draft) a SpeculativeGenerator drafting `speculate_k`
    tokens per target pass."""
    from genfast.llm.decoding.drafters import make_drafter
    from genfast.llm.decoding.generate import Generator
    from genfast.llm.decoding.speculative import DEFAULT_K, SpeculativeGenerator

    if draft is None:
        if speculate_k is not None:
            raise UserError("--speculate-k needs --draft, --self-draft or --prompt-lookup")
        return Generator(
            loaded.model, loaded.tokenizer, max_seq_len=max_seq_len, max_batch_size=batch_size, compile=compile
        )
    if batch_size != 1:
        raise UserError(f"speculative decoding runs one prompt at a time; got {batch_size} prompts")
    if loaded.tp > 1:
        raise UserError("speculative decoding does not combine with --tp yet; drop one of them")
    return SpeculativeGenerator(
        loaded.model,
        loaded.tokenizer,
        make_drafter(draft, loaded),
        k=speculate_k or DEFAULT_K,
        max_seq_len=max_seq_len,
        compile=compile,
    )


def load_for_command(args: argparse.Namespace, settings: LlmSettings, log: Callable[[str], None],
                     tp: int = 1) -> LoadedModel:  # fmt: skip
    """The model that a run command's flags name (--model, --device, --threads, --group-size),
    loaded and run as `settings` say. Without --threads, on the CPU and in one process, the thread
    count leaves the cores that other processes kept busy while it loaded to them
    (genfast/platform/threads.py), and `log` says so."""
    from genfast.platform.threads import OtherWork, avoid_busy_cores

    other_work = OtherWork() if args.threads is None else None
    loaded = apply_recipe(args.model, settings, args.device, args.threads, args.group_size, tp)
    if other_work is not None and genfast_chooses_threads(args, loaded):
        avoid_busy_cores(other_work, log)
    return loaded


def genfast_chooses_threads(args: argparse.Namespace, loaded: LoadedModel) -> bool:
    """Whether the thread count is genfast's to fit beside other work: no --threads, on the CPU, in
    one process (genfast/platform/threads.py also leaves a count from OMP_NUM_THREADS alone)."""
    return args.threads is None and loaded.device.type == "cpu" and loaded.tp == 1
