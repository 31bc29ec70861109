"""gpt-fast's recipe as named steps (genfast/recipe.py), each on top of the previous.

The steps, in ladder order, with what each changes and its accuracy budget (tests/llm), are the
`RECIPE` below; `genfast bench llm --list-steps` prints them as a table with how each runs on
this machine.

`--dtype auto` on a CPU that emulates bf16 arithmetic keeps the bf16 step as bf16 weights with
fp32 arithmetic: decode reads half the bytes (docs/performance.md, "AVX2"). `--dtype float32`
leaves the step out. Speculative decoding is not a step: it needs a draft (--draft, --self-draft,
--prompt-lookup) and combines with any step.
"""

from __future__ import annotations

from dataclasses import dataclass

from genfast import steps
from genfast.recipe import Recipe, Requirement, Step, Target

DEFAULT_STEP = "compile"  # what generate, chat and serve run unless told otherwise


@dataclass(frozen=True)
class LlmSettings:
    """What the recipe's steps set; genfast.llm.session.load and make_generator take them."""

    dtype: str = "float32"  # a --dtype value: auto, bfloat16, float32 or float16 (CUDA)
    compile: bool = False
    quant: str = "none"  # weight-only quantization on load: none, int8 or int4
    transforms: tuple[Step, ...] = ()  # steps that bring their own transform (genfast.recipe.apply_transforms)


# What CUDA's kernels measured so far (docs/performance.md): int8's Triton GEMV in a compiled decode
# step of 4 Llama-2-7B-shaped blocks on an H100 ("CUDA (NVIDIA H100), 2026-11-27"); int4 on tinygemm
# in the whole model's ladder ("CUDA (NVIDIA H100), 2026-11-28").
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
