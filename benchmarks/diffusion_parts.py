"""The parts of an SD 1.5 image that the int8-conv and group-norm-kernel steps were chosen by
(docs/notes.md, "int8 convolutions, a GroupNorm kernel, ..."), medians on this machine:

    python benchmarks/diffusion_parts.py vae          # VAE decode at 512x512: int8 thresholds, GroupNorm kernel
    python benchmarks/diffusion_parts.py group-norm [--dtype float32]  # one GroupNorm+SiLU: ATen, inductor,
                                                                     # genfast's kernel
    python benchmarks/diffusion_parts.py attention [--dtype float32]  # the UNet's self-attention shapes:
                                                                    # SDPA and alternatives
    python benchmarks/diffusion_parts.py dit-attention [--dtype float32]  # FLUX.1's and SD 3.5's at 512x512
                                                                        # and 1024x1024: SDPA, genfast's kernel

Random weights at the real size (`random_pipeline("sd15")`); bf16, channels-last, compiled as the
recipe compiles them. PSNR of the VAE variants is against the bf16 decode of the same latents.
"""

import argparse

import torch
import torch.nn.functional as F

from genfast.bench.machine import device_name
from genfast.bench.timing import median_seconds


def vae() -> None:
    from genfast.diffusion.compiling import compile_vae_decoder
    from genfast.diffusion.group_norm import use_channels_last_group_norm
    from genfast.diffusion.pipelines import random_pipeline
    from genfast.diffusion.quality import psnr
    from genfast.diffusion.recipe import RECIPE, apply_recipe
    from genfast.quant.conv import fewer_channels_than, quantize_dynamic_int8_convs
    from genfast.recipe import Target

    latents = torch.randn(1, 4, 64, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    latents = latents.to(memory_format=torch.channels_last)
    reference = None
    print("| VAE decoder | s per 512x512 decode | PSNR vs bf16 dB |\n|---|---|---|")
    for min_channels, group_norm in ((0, False), (512, False), (256, False), (128, False), (128, True)):
        torch.manual_seed(0)
        vae_model = apply_recipe(
            random_pipeline("sd15"), RECIPE.plan("conv1x1-linear", Target(torch.device("cpu"), "bfloat16")).settings
        ).vae
        if min_channels:
            quantize_dynamic_int8_convs(vae_model.decoder, keep=fewer_channels_than(min_channels))
        if group_norm:
            use_channels_last_group_norm(vae_model.decoder)
        compile_vae_decoder(vae_model)
        with torch.inference_mode():
            seconds = median_seconds(lambda: vae_model.decode(latents), repeats=3)
            image = (vae_model.decode(latents).sample.float().clamp(-1, 1) + 1) / 2
        reference = image if reference is None else reference
        name = ("bf16" if not min_channels else f"int8 convs >= {min_channels} channels") + (
            " + GroupNorm kernel" if group_norm else ""
        )
        quality = "-" if image is reference else f"{psnr(image, reference):.1f}"
        print(f"| {name} | {seconds:.2f} | {quality} |")


def group_norm(dtype: torch.dtype) -> None:
    from genfast.diffusion.group_norm import ChannelsLastGroupNorm

    print("| batch x channels x size | ATen eager ms | inductor ms | genfast kernel, compiled ms |\n|---|---|---|---|")
    # The VAE decoder's (batch 1) and then the SD 1.5 UNet's (batch 2: classifier-free guidance) shapes.
    shapes = (
        (1, 128, 512),
        (1, 256, 256),
        (1, 512, 128),
        (1, 512, 64),
        (2, 320, 64),
        (2, 640, 64),
        (2, 640, 32),
        (2, 1280, 32),
        (2, 1280, 16),
        (2, 1280, 8),
    )
    for batch, channels, size in shapes:
        norm = torch.nn.GroupNorm(32, channels, eps=1e-6).to(dtype)
        native = ChannelsLastGroupNorm(norm)
        x = torch.randn(batch, channels, size, size, dtype=dtype).to(memory_format=torch.channels_last)
        options = {"freezing": True}
        inductor = torch.compile(lambda t: F.silu(norm(t)), options=options)
        ours = torch.compile(lambda t: F.silu(native(t)), fullgraph=True, options=options)
        with torch.inference_mode():
            row = [
                median_seconds(lambda f=f: f(x), repeats=5) * 1e3 for f in (lambda t: F.silu(norm(t)), inductor, ours)
            ]
        print(f"| {batch} x {channels} x {size}x{size} | " + " | ".join(f"{ms:.1f}" for ms in row) + " |")


def attention(dtype: torch.dtype) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    print(
        "| B, heads, tokens, head dim | SDPA ms (TFLOP/s) | math ms | flex ms | SDPA, head dim padded to 64 ms |\n"
        "|---|---|---|---|---|"
    )
    for b, h, n, d in ((2, 8, 4096, 40), (2, 8, 1024, 80)):
        q, k, v = (torch.randn(b, h, n, d, dtype=dtype) for _ in range(3))
        padded = [F.pad(t, (0, 64 - d)) for t in (q, k, v)]

        def math() -> torch.Tensor:
            return torch.softmax((q @ k.transpose(-1, -2)) * d**-0.5, -1) @ v

        with torch.inference_mode():
            ms = [
                median_seconds(f, repeats=3) * 1e3
                for f in (
                    lambda: F.scaled_dot_product_attention(q, k, v),
                    math,
                    lambda: flex(q, k, v),
                    lambda: F.scaled_dot_product_attention(*padded, scale=d**-0.5),
                )
            ]
        tflops = 4 * b * h * n * n * d / (ms[0] * 1e-3) / 1e12
        print(f"| {b}, {h}, {n}, {d} | {ms[0]:.0f} ({tflops:.2f}) | {ms[1]:.0f} | {ms[2]:.0f} | {ms[3]:.0f} |")


def dit_attention(dtype: torch.dtype) -> None:
    """The fused-attention step's choice: FLUX.1's and SD 3.5's joint attention, SDPA against
    genfast's native kernel (the variant loaded here), with the kernel's max error against SDPA."""
    from genfast.kernels.rel_pos_attention import ops as kernels

    print("| model, B x heads x tokens x head dim | SDPA ms | kernel ms (TFLOP/s) | max abs diff |\n|---|---|---|---|")
    shapes = {
        "FLUX.1 512x512": (1, 24, 1024 + 256, 128),
        "SD 3.5 512x512 (CFG)": (2, 24, 1024 + 333, 64),
        "FLUX.1 1024x1024": (1, 24, 4096 + 256, 128),
    }
    for name, (b, h, n, d) in shapes.items():
        # (B, heads, tokens, head dim) views of (B, tokens, heads, head dim), as the projections give them
        q, k, v = (torch.randn(b, n, h, d, dtype=dtype).transpose(1, 2) for _ in range(3))
        if not kernels.supports(q):
            print(f"| {name} | - | the loaded kernel does not take {dtype} x {d}: {kernels.unavailable_reason()} | - |")
            continue
        with torch.inference_mode():
            sdpa, kernel = (
                median_seconds(f, repeats=5) * 1e3
                for f in (lambda: F.scaled_dot_product_attention(q, k, v), lambda: kernels.attention(q, k, v, d**-0.5))
            )
            reference = F.scaled_dot_product_attention(q, k, v).float()
            error = (kernels.attention(q, k, v, d**-0.5).float() - reference).abs().max().item()
        tflops = 4 * b * h * n * n * d / (kernel * 1e-3) / 1e12
        print(f"| {name}, {b} x {h} x {n} x {d} | {sdpa:.1f} | {kernel:.1f} ({tflops:.2f}) | {error:.4f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("vae", "group-norm", "attention", "dit-attention"))
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="group-norm's and attention's dtype"
    )
    args = parser.parse_args()
    machine = device_name(torch.device("cpu"))
    print(f"{args.part} on {machine}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    if args.part == "group-norm":
        group_norm(getattr(torch, args.dtype))
    elif args.part == "attention":
        attention(getattr(torch, args.dtype))
    elif args.part == "dit-attention":
        dit_attention(getattr(torch, args.dtype))
    else:
        vae()
