"""Compiled pipelines (slow: each compile of the tiny UNet takes 10-30 s on 2 cores): fullgraph
(a graph break raises) and no recompile on the second call."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("diffusers")

from torch._dynamo.utils import counters

from genfast.compilation import artifacts
from genfast.compilation.saved import compile_saved
from genfast.diffusion.compiling import compile_module, compile_regions, repeated_blocks
from genfast.diffusion.pipelines import call_kwargs, initial_latents, tiny_pipeline
from genfast.diffusion.quality import psnr
from genfast.diffusion.recipe import RECIPE, DiffusionSettings, apply_recipe
from genfast.recipe import Target

CPU_BF16 = Target(torch.device("cpu"), "bfloat16")

COMPILED_FP32 = 1e-4  # max abs pixel difference of compiled vs eager fp32
COMPILED_BF16_PSNR = 35.0  # dB, compiled vs eager bf16 (the recipe's bf16 budget)


def generate(pipe, size: int | tuple[int, int]) -> torch.Tensor:
    height, width = size if isinstance(size, tuple) else (size, size)
    return pipe(
        "a red cat",
        num_inference_steps=2,
        height=height,
        width=width,
        **call_kwargs(pipe),
        latents=initial_latents(pipe, height, width, seed=0),
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).images.float()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this PyTorch build")
def test_a_module_holding_opaque_onednn_tensors_compiles_for_the_run(capsys):
    """dynamo cannot serialize a guard on an opaque (mkldnn) tensor kept as an attribute: a module
    holding one is compiled as usual, not saved, and the user is told (saving raised before).
    genfast's own int8 convolutions keep theirs outside the module (tests/quant/test_conv.py)."""

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
            self.opaque = torch.ones(2, 2).to_mkldnn()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.silu(self.linear(x))

    module = Scaled().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = module(x)
        with pytest.raises(ValueError, match=r"opaque tensors \(prepacked weights\) cannot be saved"):
            compile_saved(module, "opaque block", {}, {})
        compile_module(module, saved={"recipe": "test"}, what="opaque block")
        got = module(x)
    assert "the opaque block is compiled for this run only: oneDNN's opaque tensors" in capsys.readouterr().err
    assert artifacts.entries() == []
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_full_compile_no_graph_break_no_recompile():
    """Denoiser + VAE decoder compiled whole (fullgraph: a graph break raises): two graphs, reused
    by a second call."""
    recipe = replace(RECIPE.plan("compile", CPU_BF16).settings, dtype="float32")
    eager = apply_recipe(tiny_pipeline("sd15"), replace(recipe, compile="none"))
    pipe = apply_recipe(tiny_pipeline("sd15"), recipe)
    graphs = counters["stats"]["unique_graphs"]
    image = generate(pipe, 32)
    assert counters["stats"]["unique_graphs"] - graphs == 2
    assert torch.equal(generate(pipe, 32), image)
    assert counters["stats"]["unique_graphs"] - graphs == 2  # the second call did not recompile
    assert (image - generate(eager, 32)).abs().max().item() <= COMPILED_FP32


@pytest.mark.slow
def test_regional_compile_matches_eager():
    """Repeated blocks (transformer and residual) compiled one by one: one graph per distinct
    block shape, shared by the blocks of that shape, not one per block."""
    pipe = apply_recipe(tiny_pipeline("sdxl"), DiffusionSettings(attention="sdpa"))
    unet = pipe.unet
    torch.manual_seed(0)
    sample = torch.randn(2, 4, 16, 16)
    text = torch.randn(2, 77, 64)
    added = {"text_embeds": torch.randn(2, 32), "time_ids": torch.randn(2, 6)}
    with torch.no_grad():
        expected = unet(sample, 10, encoder_hidden_states=text, added_cond_kwargs=added).sample
        graphs = counters["stats"]["unique_graphs"]
        # 4 transformer blocks (down_blocks.0, up_blocks.1 x2: width 16; mid_block: width 32) and
        # the 6 residual blocks of the ModuleLists of two or more (up_blocks.0, up_blocks.1, mid_block).
        blocks = repeated_blocks(unet)
        assert compile_regions(unet) == 10
        shapes = {(type(b), tuple(p.shape for p in b.parameters())) for b in blocks}
        out = unet(sample, 10, encoder_hidden_states=text, added_cond_kwargs=added).sample
        again = unet(sample, 10, encoder_hidden_states=text, added_cond_kwargs=added).sample
    assert counters["stats"]["unique_graphs"] - graphs == len(shapes) < len(blocks)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(out, again)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sd15", "pixart"])
def test_dynamic_shapes_reuse_graphs_at_new_sizes(arch):
    """The dynamic-shapes recipe (bf16, regional + VAE decoder with symbolic sizes): new
    resolutions add no graph after the first call, and each matches the eager recipe at that size.
    (bf16, as the recipe runs: in fp32, ATen picks its native convolution over oneDNN for batch-1
    inputs under 20480 elements, a size guard that recompiles once when a size crosses it.)"""
    recipe = replace(RECIPE.plan("dynamic-shapes", CPU_BF16).settings, dynamic_int8=False)
    eager = apply_recipe(tiny_pipeline(arch), replace(recipe, compile="none", dynamic_shapes=False))
    pipe = apply_recipe(tiny_pipeline(arch), recipe)
    generate(pipe, (128, 128))  # latents 16x16; then 20x12 (not square: no duck sizing) and 12x12
    graphs = counters["stats"]["unique_graphs"]
    for size in ((160, 96), (96, 96)):
        image = generate(pipe, size)
        assert counters["stats"]["unique_graphs"] == graphs, f"recompiled at {size}"
        assert psnr(image, generate(eager, size)) >= COMPILED_BF16_PSNR


def test_cuda_compiles_tune_kernels_unless_told_not_to():
    """diffusion-fast's flags on CUDA; `max_autotune` off drops only the compile-time tuning
    (the GPU tests that check other properties compile so); CUDA graphs for whole static models."""
    from genfast.diffusion.compiling import diffusion_inductor_options

    tuned = diffusion_inductor_options("cuda")
    plain = diffusion_inductor_options("cuda", max_autotune=False)
    assert tuned["max_autotune"] and tuned["coordinate_descent_tuning"] and tuned["conv_1x1_as_mm"]
    assert {k: v for k, v in tuned.items() if k in plain} == plain
    assert not any("autotune" in k or "coordinate" in k for k in plain)
    assert not diffusion_inductor_options("cuda", whole_model=False)["triton.cudagraphs"]
    assert diffusion_inductor_options("cpu", max_autotune=True) == {"freezing": True}
    assert DiffusionSettings().max_autotune  # what users get
