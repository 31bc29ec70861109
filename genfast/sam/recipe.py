"""segment-anything-fast's recipe as named steps, each applied on top of the previous ones.

| step | what changes | accuracy budget vs the fp32 model (tested on tiny models) |
|---|---|---|
| fp32 | genfast's model, attention computed like the original (explicit softmax) | identical to the original package (1e-5) |
| bf16 | weights and activations in bfloat16 | mask-logit error <= 5% of the logit range, mask IoU >= 0.95 |
| sdpa | `scaled_dot_product_attention` with the bias as a float mask | as bf16 |
| fused-attention | relative-position bias inside a native kernel (CPU; FlexAttention on CUDA) | as bf16 |
| compile | torch.compile of the image encoder (fullgraph, static shapes, freezing) | as bf16 |
| batched-prompts | one mask-decoder call for the prompts of all images (predict_batch) | as bf16 |
| dynamic-int8 | int8 activations x int8 weights in the encoder's linears (`encoder_int8_filter`) | logit error <= 10%, IoU >= 0.9 |
| sparse-2:4 | instead of dynamic-int8: 2:4 magnitude pruning of the encoder's linears + sparse kernels (CUDA only) | not an accuracy-preserving step: pruning random weights changes the model; measured, not bounded |

On a CPU without native bf16 arithmetic (no AVX512-BF16 or AMX: bf16 is emulated and slower than
fp32) the bf16 step is left out and every later step computes in fp32 (`recipe_for_step(step,
low_precision=None)`; `genfast bench sam --dtype auto` does so there).

"GPU-sync-free prompt handling" is not a step: the predictor's torch path never reads device
values (genfast/sam/predictor.py), in every step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from genfast.compile import compile_fn
from genfast.quant.linear import quantize_dynamic_int8
from genfast.sam.modeling import Sam
from genfast.sam.modeling.attention import set_attention

SAM_STEPS = ("fp32", "bf16", "sdpa", "fused-attention", "compile", "batched-prompts", "dynamic-int8", "sparse-2:4")
INT8_MIN_FEATURES = 256  # smaller linears gain nothing from int8 and cost accuracy


@dataclass(frozen=True)
class SamRecipe:
    dtype: torch.dtype = torch.float32
    attention: str = "math"
    compile: bool = False
    batched_prompts: bool = False
    dynamic_int8: bool = False
    sparse_2_4: bool = False


def recipe_for_step(step: str, low_precision: torch.dtype | None = torch.bfloat16) -> SamRecipe:
    """The recipe with every step up to and including `step`. `low_precision` is the dtype the
    "bf16" step switches to; None leaves that step out, so every later step computes in fp32 (what
    a CPU without native bf16 arithmetic should do: genfast.hardware.auto_dtype)."""
    if step not in SAM_STEPS:
        raise ValueError(f"unknown SAM step {step!r}; choose one of {', '.join(SAM_STEPS)}")
    changes = {
        "bf16": {"dtype": low_precision} if low_precision is not None else {},
        "sdpa": {"attention": "sdpa"},
        "fused-attention": {"attention": "fused"},
        "compile": {"compile": True},
        "batched-prompts": {"batched_prompts": True},
        "dynamic-int8": {"dynamic_int8": True},
        # No kernel combines int8 and 2:4 sparsity here: the sparse step replaces dynamic int8.
        "sparse-2:4": {"sparse_2_4": True, "dynamic_int8": False},
    }
    recipe = SamRecipe()
    for name in SAM_STEPS[: SAM_STEPS.index(step) + 1]:
        recipe = replace(recipe, **changes.get(name, {}))
    return recipe


def encoder_int8_filter(name: str, linear: nn.Linear) -> bool:
    """True for the linears dynamic int8 leaves alone: those with fewer than INT8_MIN_FEATURES
    inputs or outputs (all of SAM's encoder linears are larger, so all are quantized)."""
    return min(linear.in_features, linear.out_features) < INT8_MIN_FEATURES


def sparse_2_4_unavailable(device: torch.device) -> str | None:
    """Why 2:4 sparse kernels cannot run on `device`, or None."""
    if device.type != "cuda":
        return f"torch has no 2:4 semi-structured sparse kernels for {device.type} (CUDA only)"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return "2:4 sparse kernels need an Ampere or newer GPU"
    return None


@torch.no_grad()
def prune_2_4_(linear: nn.Linear) -> None:
    """Zero the two smallest-magnitude weights of every 4 consecutive inputs, in place."""
    weight = linear.weight
    if weight.shape[1] % 4:
        raise ValueError(f"2:4 pruning needs in_features divisible by 4, got {weight.shape[1]}")
    groups = weight.view(weight.shape[0], -1, 4)
    smallest = groups.abs().argsort(dim=-1)[..., :2]
    groups.scatter_(-1, smallest, 0)


def sparsify_2_4_(module: nn.Module) -> list[str]:
    """Prune every linear of `module` to 2:4 and store it in torch's semi-structured sparse format
    (CUDA only: call sparse_2_4_unavailable first). Returns the names of the changed linears."""
    from torch.sparse import to_sparse_semi_structured

    names = []
    for name, linear in module.named_modules():
        if isinstance(linear, nn.Linear) and linear.in_features % 64 == 0 and linear.out_features % 64 == 0:
            prune_2_4_(linear)
            linear.weight = nn.Parameter(to_sparse_semi_structured(linear.weight), requires_grad=False)
            names.append(name)
    return names


def apply_recipe(model: Sam, recipe: SamRecipe) -> Sam:
    """Apply `recipe` to `model` in place (and return it). batched_prompts is a property of how
    the predictor is called (predict_batch), so it changes nothing here."""
    if recipe.sparse_2_4 and recipe.dynamic_int8:
        raise ValueError("2:4 sparsity and dynamic int8 cannot be combined (no kernel does both)")
    model.to(recipe.dtype)
    set_attention(model, recipe.attention)
    if recipe.sparse_2_4:
        reason = sparse_2_4_unavailable(model.device)
        if reason:
            raise ValueError(f"cannot apply 2:4 sparsity: {reason}")
        sparsify_2_4_(model.image_encoder)
    if recipe.dynamic_int8:
        quantize_dynamic_int8(model.image_encoder, keep=encoder_int8_filter)
    if recipe.compile:
        model.image_encoder = compile_fn(model.image_encoder, model.device, decode=False)
    return model
