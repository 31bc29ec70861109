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
from functools import partial
from typing import TYPE_CHECKING

from genfast import steps
from genfast.errors import UserError
from genfast.recipe import Recipe, Stage, Step, Target, Transform, settings_key

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from genfast.sam.modeling import Sam

# Narrower linears stay in floating point: they gain nothing from int8 and cost accuracy. Hiera's
# 1/8-scale stage (192 wide) gains; its 1/4-scale stage (96 wide) does not (sam2.1-hiera-small,
# Zen 4: docs/notes.md).
INT8_MIN_FEATURES = 192
# What `genfast segment` runs unless told otherwise: the exact steps (with --dtype float32, its
# default, the bf16 step is left out); compiling costs minutes on a CPU's first run.
DEFAULT_STEP = "fused-attention"


@dataclass(frozen=True)
class SamSettings(steps.StepSettings):
    """What the recipe's steps set; `apply_recipe` makes a model so."""

    attention: str = "math"  # genfast.sam.modeling.attention.ATTENTION_IMPLS
    compile: bool = False
    # CUDA: the compiled encoder's matrix products tuned at compile time (compile.inductor_options);
    # the GPU tests turn it off where they check other properties of the compiled encoder.
    max_autotune: bool = True
    batched_prompts: bool = False  # how the predictor is called (predict_batch), not a model change
    dynamic_int8: bool = False
    sparse_2_4: bool = False


def _fused_attention_note(target: Target) -> str | None:
    """How the fused-attention step runs here when not as its native CPU kernel (CUDA: the folded bias)."""
    return steps.attention_kernel_cpu_note(target) if target.device.type == "cpu" else None


def _sparse_2_4_unavailable(target: Target) -> str | None:
    from genfast.quant.sparse import sparse_2_4_unavailable

    return sparse_2_4_unavailable(target.device)


# The steps' transforms; the parts are "model" (a Sam) and "image_encoder".


def _cast(model: Sam, settings: SamSettings) -> None:
    from genfast.platform.hardware import DTYPES

    model.to(DTYPES[settings.dtype])


def _set_attention(model: Sam, settings: SamSettings) -> None:
    from genfast.sam.modeling.attention import set_attention

    set_attention(model, settings.attention)


def _quantize_dynamic_int8(encoder: torch.nn.Module, settings: SamSettings) -> None:
    """The encoder's linears, and (SAM 2) its attention's products where the model asks for them
    (Hiera's global blocks: genfast/sam/sam2/modeling/hiera.py)."""
    from genfast.quant.linear import narrower_than, quantize_dynamic_int8

    quantize_dynamic_int8(encoder, keep=narrower_than(INT8_MIN_FEATURES))
    _use_int8_attention(encoder)


def _use_int8_attention(module: torch.nn.Module) -> None:
    """Every attention under `module` that can compute its products on int8 codes (where the
    native kernel has them: AVX-512) is asked to (`use_int8_attention`; each decides where they
    pay): the scores q k^T on q and k with a scale per query row and per key, the output P v on P
    and v with scales per block of keys (genfast/kernels/rel_pos_attention): the kernel's products
    at twice the rate."""
    for sub in module.modules():
        if hasattr(sub, "use_int8_attention"):
            sub.use_int8_attention()


def _quantize_memory(model: Sam, settings: SamSettings) -> None:
    """SAM 2's video modules: the memory attention's linears as the encoder's, and its attention's
    products on int8 codes (`_use_int8_attention`); the memory encoder's linears (its fuser's
    ConvNeXt MLPs, 4096 tokens of 256 -> 1024 -> 256 a frame) too. SAM has neither: nothing
    changes."""
    from genfast.quant.linear import narrower_than, quantize_dynamic_int8

    for name in ("memory_attention", "memory_encoder"):
        module = getattr(model, name, None)
        if module is not None:
            quantize_dynamic_int8(module, keep=narrower_than(INT8_MIN_FEATURES))
            _use_int8_attention(module)


def _sparsify_2_4(encoder: torch.nn.Module, settings: SamSettings) -> None:
    from genfast.quant.sparse import sparsify_2_4_

    sparsify_2_4_(encoder)


def _rewrite_for_compiling(model: Sam, settings: SamSettings) -> None:
    """SAM 2's rewrites of the compile step, where the model has them: its decoder's projections
    of the fine levels folded into the neck's (Sam2.fold_high_res_projections), and its trunk's
    position embedding made once (Sam2.precompute_position_embedding). SAM has neither: its
    position table is learned at the input's size already."""
    for name in ("fold_high_res_projections", "precompute_position_embedding"):
        rewrite = getattr(model, name, None)
        if rewrite is not None:
            rewrite()


def _compile_in_place(
    module: torch.nn.Module, what: str, device: torch.device, settings: SamSettings, method: str = "forward"
) -> None:
    """Compile `module`'s `method` (fullgraph, static shapes) in place: on the CPU saved for later
    runs (genfast/compilation/saved.py), on CUDA in-process (its matrix products tuned where
    settings.max_autotune)."""
    from genfast.compilation.inductor import compile_fn, inductor_options
    from genfast.compilation.saved import compile_saved

    if device.type == "cpu":
        options = inductor_options(device, decode=False)
        compile_saved(module, what, settings_key(settings), options, method=method)
    else:
        compiled = compile_fn(getattr(module, method), device, decode=False, max_autotune=settings.max_autotune)
        setattr(module, method, compiled)


def _compile_encoder(model: Sam, settings: SamSettings) -> None:
    _compile_in_place(model.image_encoder, "SAM image encoder", model.device, settings)
    if hasattr(model, "grid_decoder_compiler"):  # SAM 2: its automatic generator's decoder too
        model.grid_decoder_compiler = partial(_compile_grid_decoder, device=model.device, settings=settings)


# The memory attention layer's methods whose shapes are the frame's alone (MemoryAttentionLayer).
LAYER_PARTS = ("frame_side", "output_side")


def _compile_memory(model: Sam, settings: SamSettings) -> None:
    """SAM 2's video modules, static shapes: the memory encoder whole, and each memory-attention
    layer's parts whose shapes are the frame's (its self-attention, the cross-attention's queries,
    its output and feed-forward). The keys and values of the memory stay eager: the memory grows
    over a video's first frames (up to num_maskmem frames and max_obj_ptrs_in_encoder pointers),
    which would compile a graph per length. SAM has neither."""
    if not hasattr(model, "memory_attention"):
        return
    _compile_in_place(model.memory_encoder, "SAM 2 memory encoder", model.device, settings)
    for layer in model.memory_attention.layers:
        for method in LAYER_PARTS:
            what = f"SAM 2 memory attention's {method.replace('_', ' ')}"
            _compile_in_place(layer, what, model.device, settings, method)


def _compile_grid_decoder(decoder: torch.nn.Module, device: torch.device, settings: SamSettings) -> Callable:
    """SAM 2's automatic generator's batched decoder (one batch size of points: static shapes).
    Its elementwise work (the per-prompt image tokens' residuals, LayerNorms and GELUs at
    4096-16384 positions) is most of its eager time."""
    _compile_in_place(decoder, "SAM 2 grid decoder", device, settings)
    return decoder


RECIPE = Recipe(
    "sam",
    SamSettings,
    [
        steps.baseline(
            "genfast's model in fp32, attention computed like the original (explicit softmax)",
            [Transform(_cast, ("model",), Stage.PRECISION), Transform(_set_attention, ("model",), Stage.KERNELS)],
        ),
        steps.bf16("mask-logit error <= 5% of the logit range, mask IoU >= 0.95"),
        Step("sdpa", "scaled_dot_product_attention with the bias as a float mask", "as bf16", {"attention": "sdpa"}),
        Step(
            "fused-attention",
            "relative-position bias inside the attention: a native kernel on CPU, folded into SDPA's product on CUDA; "
            "on CPU the mask decoder's attention (and SAM 2's) takes the same kernel without a bias; the mask "
            "decoder's cross-attentions absorb their projections into the few prompt tokens' side",
            "as bf16",
            {"attention": "fused"},
            fallback=_fused_attention_note,
        ),
        steps.compile_step(
            "torch.compile of the image encoder (and of SAM 2's automatic generator's batched decoder, its memory "
            "encoder and the frame-shaped parts of its memory attention; fullgraph, static shapes), saved for later "
            "runs; SAM 2's decoder's 1x1 projections of the fine levels folded into the neck's, and its trunk's "
            "position embedding made once",
            "as bf16",
            {"compile": True},
            [
                Transform(_rewrite_for_compiling, ("model",), Stage.REWRITE),
                Transform(_compile_encoder, ("model",), Stage.COMPILE),
                Transform(_compile_memory, ("model",), Stage.COMPILE),
            ],
        ),
        Step(
            "batched-prompts",
            "one mask-decoder call for the prompts of all images (predict_batch)",
            "as bf16",
            {"batched_prompts": True},
        ),
        steps.dynamic_int8(
            "int8 activations x int8 weights in the image encoder's linears (SAM 2: and the memory "
            "attention's and memory encoder's; Hiera's global attention and the memory attention compute "
            "their scores q k^T on int8 codes where the CPU kernel has them)",
            "logit error <= 10%, IoU >= 0.95",
            {"dynamic_int8": True},
            [
                Transform(_quantize_dynamic_int8, ("image_encoder",), Stage.QUANTIZE),
                Transform(_quantize_memory, ("model",), Stage.QUANTIZE),
            ],
        ),
        # No kernel combines int8 and 2:4 sparsity: the sparse step replaces dynamic int8.
        Step(
            "sparse-2:4",
            "2:4 magnitude pruning of the encoder's linears + sparse kernels, instead of dynamic-int8",
            "not accuracy-preserving: pruning changes the model; measured, not bounded",
            {"sparse_2_4": True},
            needs=_sparse_2_4_unavailable,
            replaces=("dynamic-int8",),
            transforms=(Transform(_sparsify_2_4, ("image_encoder",), Stage.QUANTIZE),),
        ),
    ],
)


def validate(settings: SamSettings) -> None:
    """Reject combinations that cannot run, before anything is changed."""
    if settings.sparse_2_4 and settings.dynamic_int8:
        raise UserError("2:4 sparsity and dynamic int8 cannot be combined (no kernel does both)")


def apply_recipe(model: Sam, settings: SamSettings) -> Sam:
    """Make `model` run as `settings` say, in place (and return it): the recipe's transforms
    (genfast/recipe.py). batched_prompts is a property of how the predictor is called
    (predict_batch), so it changes nothing here."""
    validate(settings)
    RECIPE.apply(settings, {"model": model, "image_encoder": model.image_encoder}, Target(model.device, settings.dtype))
    return model
