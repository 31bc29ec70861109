"""The steps several workloads' recipes share (genfast/recipe.py): one name, one requirement and
one description per idea, declared here once, and the settings they share (`StepSettings`, which
every workload's settings extend). Each workload's recipe adds one line per step with the settings
it sets there, its accuracy budget on that workload and the transforms that do it to its parts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from genfast.recipe import Requirement, Step, Target, Transform, no_requirement


@dataclass(frozen=True)
class StepSettings:
    """The settings fields the shared steps set, in every workload's settings."""

    dtype: str = "float32"  # a --dtype value: auto, bfloat16, float32 or float16 (CUDA)


def baseline(changes: str, transforms: Sequence[Transform] = ()) -> Step:
    """The first step of every recipe: the unoptimized model, the reference of every budget. Its
    transforms always run: they put the model in the settings' dtype and kernels, which later steps
    only change."""
    return Step("baseline", changes, "the reference", transforms=tuple(transforms))


def low_precision_name(target: Target) -> str | None:
    """The dtype the bf16 step computes in on `target` ('bfloat16', or 'float16' on CUDA when
    --dtype asks for it), or None where the step is left out (genfast.platform.hardware.low_precision_dtype)."""
    from genfast.platform.hardware import low_precision_dtype

    dtype = low_precision_dtype(target.dtype, target.device)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def attention_kernel_cpu_note(target: Target) -> str | None:
    """The fused-attention steps' note on a CPU `target` where genfast's attention kernel computes
    by SDPA instead (none is loaded, or its variant takes no dtype the recipe computes in there);
    None where the kernel runs."""
    import torch

    from genfast.kernels.rel_pos_attention.ops import cpu_fallback_note

    return cpu_fallback_note(getattr(torch, low_precision_name(target) or "float32"))


def _float32_asked(target: Target) -> str | None:
    return "--dtype float32 asks for fp32 throughout" if target.dtype == "float32" else None


def _low_precision_unavailable(target: Target) -> str | None:
    from genfast.platform.hardware import low_precision_note

    return low_precision_note(target.device) if low_precision_name(target) is None else None


def bf16(budget: str, fallback: Requirement = no_requirement) -> Step:
    """Weights and activations in bfloat16. Left out under --dtype float32, and under --dtype auto
    on CPUs that emulate bf16 arithmetic (slower than fp32 there): every later step then computes
    in fp32. `fallback`: how a workload runs it in a lesser form on a target."""
    return Step(
        "bf16",
        "weights and activations in bfloat16 (or the --dtype given)",
        budget,
        lambda target: {"dtype": low_precision_name(target)},
        needs=_low_precision_unavailable,
        declined=_float32_asked,
        fallback=fallback,
    )


def _emulated_bf16_note(target: Target) -> str | None:
    """An explicit --dtype bfloat16 on a CPU that emulates bf16 arithmetic runs, slower than auto
    (which keeps bf16 weights and computes in fp32 there, as the load line says)."""
    from genfast.platform.hardware import has_native_bf16

    if target.dtype != "bfloat16" or target.device.type != "cpu" or has_native_bf16():
        return None
    return "bfloat16 arithmetic is emulated on this CPU: --dtype auto is faster"


def bf16_weights(budget: str) -> Step:
    """The bf16 step of a bandwidth-bound workload (LLM decode), which gains from bf16 weights even
    where bf16 arithmetic is emulated: there --dtype auto keeps the weights in bf16 and computes in
    fp32 instead of leaving the step out (genfast.nn.auto_weight_dtype)."""
    return Step(
        "bf16",
        "weights in bfloat16; arithmetic too where the hardware has it natively (or the --dtype given)",
        budget,
        lambda target: {"dtype": target.dtype},
        declined=_float32_asked,
        fallback=_emulated_bf16_note,
    )


def compile_step(changes: str, budget: str, sets: Mapping[str, Any], transforms: Sequence[Transform] = ()) -> Step:
    """torch.compile of the workload's hot path (fullgraph: a graph break is a bug)."""
    return Step("compile", changes, budget, sets, transforms=tuple(transforms))


def native_int8_note(target: Target) -> str | None:
    """How int8 linears run on `target` when genfast's native kernel cannot (None: it runs)."""
    if target.device.type != "cpu":
        return None
    from genfast.kernels.qlinear import ops as qlinear

    reason = qlinear.unavailable_reason()
    return f"native int8 kernel unavailable ({reason}): dequantize fallback" if reason else None


def dynamic_int8(changes: str, budget: str, sets: Mapping[str, Any], transforms: Sequence[Transform] = ()) -> Step:
    """int8 activations (quantized per call) times int8 weights in the linears a shape rule picks
    (genfast.quant.linear.narrower_than); genfast's native kernel on x86 CPUs."""
    return Step("dynamic-int8", changes, budget, sets, fallback=native_int8_note, transforms=tuple(transforms))
