"""Where a CPU's bf16 products are slower than its fp32 ones (`genfast info`: "bf16 products"), the
diffusion recipe's bf16 step keeps bf16 tensors but multiplies in fp32 (genfast.nn.use_fp32_products).
This times one part of a random-weight pipeline at the real size in four forms, alternating them
call by call in one process so that a change in the host's speed reaches every form alike:

- bf16 products: the bf16 module as diffusers runs it;
- fp32 products in the linears (`Fp32ProductsLinear`);
- fp32 products in the linears and convolutions (`Fp32ProductsConv2d` too: what the recipe does);
- fp32 throughout: the module and its inputs in fp32.

    python benchmarks/fp32_products.py --arch flux-schnell --part vae              # VAE decoder, 512x512
    python benchmarks/fp32_products.py --arch flux-schnell --part vae --compiled   # as the recipe runs it
    python benchmarks/fp32_products.py --arch flux-schnell --part denoiser         # 3 blocks (--blocks)
    python benchmarks/fp32_products.py --arch sd15 --part denoiser --repeats 5     # the UNet, batch 2

The denoiser's inputs are those of its first call in the pipeline (one denoising step, the
architecture's guidance: SD 1.5 and SD 3.5 run a batch of two), the VAE's a latent of the image's
size. The error column is each form's output against the fp32 form's, relative to its norm.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from genfast.bench.machine import describe_machine, machine_info
from genfast.diffusion.pipelines import random_pipeline
from genfast.diffusion.transformer_archs import ARCHS as DIT_ARCHS
from genfast.nn import use_fp32_products

ARCH_CHOICES = ("sd15", "sdxl", *DIT_ARCHS)


def denoiser_inputs(pipe: Any, arch: str, size: int) -> tuple[nn.Module, tuple, dict[str, Any]]:
    """The denoiser and the arguments of its first call in one denoising step of the pipeline."""
    denoiser = pipe.transformer if arch in DIT_ARCHS else pipe.unet
    seen: dict[str, Any] = {}

    def keep(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        seen.setdefault("call", (args, kwargs))

    handle = denoiser.register_forward_pre_hook(keep, with_kwargs=True)
    call = dict(DIT_ARCHS[arch].call) if arch in DIT_ARCHS else {}
    try:
        with torch.inference_mode():
            pipe("a lighthouse", num_inference_steps=1, height=size, width=size, output_type="latent", **call)
    finally:
        handle.remove()
    args, kwargs = seen["call"]
    kwargs = {k: v for k, v in kwargs.items() if k not in ("return_dict", "joint_attention_kwargs")}
    return denoiser, args, {**kwargs, "return_dict": False}


def vae_inputs(pipe: Any, size: int) -> tuple[nn.Module, tuple, dict[str, Any]]:
    factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    latents = torch.randn(1, pipe.vae.config.latent_channels, size // factor, size // factor)
    latents = latents.to(torch.bfloat16).to(memory_format=torch.channels_last)
    return pipe.vae.decoder.to(memory_format=torch.channels_last), (latents,), {}


def forms(module: nn.Module) -> dict[str, nn.Module]:
    linears, both = copy.deepcopy(module), copy.deepcopy(module)
    use_fp32_products(linears, kinds=(nn.Linear,))
    use_fp32_products(both)
    return {
        "bf16 products": module,
        "fp32 products: linears": linears,
        "fp32 products: linears and convolutions": both,
        "fp32 throughout": copy.deepcopy(module).float(),
    }


def widened(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
        return value.float()
    if isinstance(value, (tuple, list)):
        return type(value)(widened(v) for v in value)
    if isinstance(value, dict):
        return {k: widened(v) for k, v in value.items()}
    return value


def first_tensor(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else first_tensor(out[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=ARCH_CHOICES, default="flux-schnell")
    parser.add_argument("--part", choices=("vae", "denoiser"), default="vae")
    parser.add_argument("--blocks", type=int, help="FLUX.1 and SD 3.5: transformer blocks (default: the bench's)")
    parser.add_argument("--size", type=int, default=512, help="image side in pixels (default 512)")
    parser.add_argument("--compiled", action="store_true", help="torch.compile each form (default: eager)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each form (default 3)")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.arch in DIT_ARCHS:
        blocks = args.blocks or DIT_ARCHS[args.arch].bench_blocks
        pipe = random_pipeline(args.arch, blocks=blocks)
        depth = f", {blocks} blocks"
    else:
        pipe, depth = random_pipeline(args.arch, dtype=torch.bfloat16), ""
    module, call_args, call_kwargs = (
        vae_inputs(pipe, args.size) if args.part == "vae" else denoiser_inputs(pipe, args.arch, args.size)
    )
    mode = "compiled" if args.compiled else "eager"
    print(
        f"{args.arch} {args.part}{depth}, {args.size}x{args.size}, {mode}, on {describe_machine(machine_info('cpu'))}"
    )
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    for name, form in forms(module.eval()).items():
        run = torch.compile(form) if args.compiled else form
        wide = name == "fp32 throughout"
        form_args, form_kwargs = (widened(call_args), widened(call_kwargs)) if wide else (call_args, call_kwargs)
        calls[name] = lambda run=run, a=form_args, k=form_kwargs: first_tensor(run(*a, **k))
    with torch.inference_mode():
        first, outputs = {}, {}
        for name, call in calls.items():
            start = time.perf_counter()
            outputs[name] = call().float()
            first[name] = time.perf_counter() - start
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    reference = outputs["fp32 throughout"]
    bf16 = statistics.median(times["bf16 products"])
    median_of = f"s a call (median of {args.repeats})"
    print(f"\n| form | first call s | {median_of} | x bf16 products | error vs fp32 | calls s |")
    print("|---|---|---|---|---|---|")
    for name, seconds in times.items():
        error = ((outputs[name] - reference).norm() / reference.norm()).item()
        median = statistics.median(seconds)
        calls = ", ".join(f"{t:.2f}" for t in seconds)
        print(f"| {name} | {first[name]:.2f} | {median:.3f} | {bf16 / median:.2f} | {error:.2e} | {calls} |")


if __name__ == "__main__":
    main()
