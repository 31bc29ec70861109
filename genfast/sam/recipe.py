"""segment-anything-fast's recipe as named steps (genfast/recipe.py), each on top of the previous.

The steps, in ladder order, with what each changes and its accuracy budget against the baseline
(tested on tiny models in tests/sam/test_recipe.py), are the `RECIPE` below; `genfast bench sam
--list-steps` prints them as a table with how each runs on this machine.

On a CPU without native bf16 arithmetic (no AVX512-BF16 or AMX: bf16 is emulated and slower than
fp32) `--dtype auto` leaves the bf16 step out and every later step computes in fp32.

"GPU-sync-free prompt handling" is not a step: the predictor's torch path never reads device
values (genfast/sam/predictor.py), in every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from genfast import steps
from genfast.errors import UserError
from genfast.recipe import Recipe, Step, Target, apply_transforms, settings_key

if TYPE_CHECKING:
    from genfast.sam.modeling import Sam

INT8_MIN_FEATURES = 256  # smaller linears gain nothing from int8 and cost accuracy
# What `genfast segment` runs unless told otherwise: the exact steps (with --dtype float32, its
# default, the bf16 step is left out); compiling costs minutes on a CPU's first run.
DEFAULT_STEP = "fused-attention"


@dataclass(frozen=True)
class SamSettings:
    """What the recipe's steps set; `apply_recipe` makes a model so."""

    dtype: str = "float32"
    attention: str = "math"  # genfast.sam.modeling.attention.ATTENTION_IMPLS
    compile: bool = False
    # CUDA: the compiled encoder's matrix products tuned at compile time (compile.inductor_options);
    # the GPU tests turn it off where they check other properties of the compiled encoder.
    max_autotune: bool = True
    batched_prompts: bool = False  # how the predictor is called (predict_batch), not a model change
    dynamic_int8: bool = False
    sparse_2_4: bool = False
    transforms: tuple[Step, ...] = ()  # steps that bring their own transform (genfast.recipe.apply_transforms)


def _fused_attention_note(target: Target) -> str | None:
    """How the fused-attention step runs here when not as its native CPU kernel (CUDA: the folded bias)."""
    if target.device.type != "cpu":
        return None
    import torch

    from genfast.sam import fused_attention

    reason = fused_attention.unavailable_reason()
    if reason:
        return f"fused kernel unavailable ({reason}): SDPA"
    dtype = getattr(torch, steps.low_precision_name(target) or "float32")
    if not fused_attention.takes(dtype):
        return f"the {fused_attention.loaded_isa()} kernel takes no {str(dtype).removeprefix('torch.')}: SDPA"
    return None


def _sparse_2_4_unavailable(target: Target) -> str | None:
    from genfast.quant.sparse import sparse_2_4_unavailable

    return sparse_2_4_unavailable(target.device)


RECIPE = Recipe(
    "sam",
    SamSettings,
    [
        steps.baseline("genfast's model in fp32, attention computed like the original (explicit softmax)"),
        steps.bf16("mask-logit error <= 5% of the logit range, mask IoU >= 0.95"),
        Step("sdpa", "scaled_dot_product_attention with the bias as a float mask", "as bf16", {"attention": "sdpa"}),
        Step(
            "fused-attention",
            "relative-position bias inside the attention: a native kernel on CPU, folded into SDPA's product on CUDA",
            "as bf16",
            {"attention": "fused"},
            fallback=_fused_attention_note,
        ),
        steps.compile_step(
            "torch.compile of the image encoder (fullgraph, static shapes), saved for later runs",
            "as bf16",
            {"compile": True},
        ),
        Step(
            "batched-prompts",
            "one mask-decoder call for the prompts of all images (predict_batch)",
            "as bf16",
            {"batched_prompts": True},
        ),
        steps.dynamic_int8(
            "int8 activations x int8 weights in the image encoder's linears",
            "logit error <= 10%, IoU >= 0.9",
            {"dynamic_int8": True},
        ),
        # No kernel combines int8 and 2:4 sparsity: the sparse step replaces dynamic int8.
        Step(
            "sparse-2:4",
            "2:4 magnitude pruning of the encoder's linears + sparse kernels, instead of dynamic-int8",
            "not accuracy-preserving: pruning changes the model; measured, not bounded",
            {"sparse_2_4": True},
            needs=_sparse_2_4_unavailable,
            replaces=("dynamic-int8",),
        ),
    ],
)


def apply_recipe(model: Sam, settings: SamSettings) -> Sam:
    """Make `model` run as `settings` say, in place (and return it). batched_prompts is a property
    of how the predictor is called (predict_batch), so it changes nothing here."""
    from genfast.compilation.inductor import compile_fn, inductor_options
    from genfast.compilation.saved import compile_saved
    from genfast.platform.hardware import DTYPES
    from genfast.quant.linear import narrower_than, quantize_dynamic_int8
    from genfast.quant.sparse import sparse_2_4_unavailable, sparsify_2_4_
    from genfast.sam.modeling.attention import set_attention

    if settings.sparse_2_4 and settings.dynamic_int8:
        raise UserError("2:4 sparsity and dynamic int8 cannot be combined (no kernel does both)")
    if settings.sparse_2_4 and (reason := sparse_2_4_unavailable(model.device)):
        raise UserError(f"cannot apply 2:4 sparsity: {reason}")
    model.to(DTYPES[settings.dtype])
    set_attention(model, settings.attention)
    if settings.sparse_2_4:
        sparsify_2_4_(model.image_encoder)
    if settings.dynamic_int8:
        quantize_dynamic_int8(model.image_encoder, keep=narrower_than(INT8_MIN_FEATURES))
    apply_transforms(settings, {"image_encoder": model.image_encoder, "prompt_encoder": model.prompt_encoder,
                                "mask_decoder": model.mask_decoder})  # fmt: skip
    if settings.compile and model.device.type == "cpu":  # saved for later runs (CUDA: not yet run)
        options = inductor_options(model.device, decode=False)
        compile_saved(model.image_encoder, "SAM image encoder", settings_key(settings), options)
    elif settings.compile:
        model.image_encoder = compile_fn(
            model.image_encoder, model.device, decode=False, max_autotune=settings.max_autotune
        )
    return model
