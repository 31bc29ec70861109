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
from genfast.recipe import Recipe, Step, Target

DEFAULT_STEP = "compile"  # what generate, chat and serve run unless told otherwise


@dataclass(frozen=True)
class LlmSettings:
    """What the recipe's steps set; genfast.llm.session.load and make_generator take them."""

    dtype: str = "float32"  # a --dtype value: auto, bfloat16, float32 or float16 (CUDA)
    compile: bool = False
    quant: str = "none"  # weight-only quantization on load: none, int8 or int4
    transforms: tuple[Step, ...] = ()  # steps that bring their own transform (genfast.recipe.apply_transforms)


# What the only end-to-end CUDA measurement so far found (docs/performance.md, "CUDA (NVIDIA H100)").
CUDA_QUANT_NOTE = (
    "on CUDA, int8 decode measured slower than compiled bf16 so far (117 against 174 tok/s, Llama-2-7B "
    "shape on an H100; under investigation) and int4 is not yet measured end to end: quantized "
    "weights save memory"
)


def _quantized_decode_note(target: Target) -> str | None:
    """What quantized weights cost here when genfast's native kernel cannot run them."""
    if target.device.type == "cpu":
        why = steps.native_int8_note(target)
    elif target.device.type == "cuda":
        from genfast.quant.linear import triton_available

        if triton_available():
            return CUDA_QUANT_NOTE
        why = "Triton is not installed"
    else:
        why = f"no quantized kernel for {target.device.type}"
    if not why:
        return None
    return (
        f"quantized weights use the slow dequantize path ({why}): they save memory, but decode is slower "
        "than unquantized here (`genfast info` says why)"
    )


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
            fallback=_quantized_decode_note,
        ),
        Step(
            "int4",
            "int4 weights in groups of 32 (int8 output head), instead of int8",
            "logits cosine >= 0.998 on average vs bf16",
            {"quant": "int4"},
            fallback=_quantized_decode_note,
        ),
    ],
)
