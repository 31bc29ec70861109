"""diffusers' own FLUX.1 or SD 3.5 pipeline, eager, its denoiser timed alone: the `diffusers` row of
`genfast bench diffusion` without the VAE decode (the pipeline returns latents).

    bash scripts/with_isa.sh avx2 python benchmarks/diffusers_denoiser_step.py --arch flux-schnell

For CPUs where the whole image cannot be timed in reasonable time: capped to AVX2, diffusers' bf16
VAE decode of one 512x512 image ran for over ten minutes (bf16 convolutions without bf16
arithmetic), while its denoiser steps take seconds. Same random weights, block count, prompt
length, guidance and latents as the bench's row; the table gives the median seconds per denoiser
call over the images after the first, to set beside the bench's `s/denoiser step` column.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sd35-medium", help="flux-schnell, flux-dev, sd35-medium or sd35-large")
    parser.add_argument("--blocks", type=int, default=None, help="transformer blocks (default: the bench's)")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--denoising-steps", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", help="the pipeline's dtype (the bench's row: bfloat16)")
    parser.add_argument("--images", type=int, default=3, help="pipeline calls; the first is not counted")
    args = parser.parse_args()

    from diffusers.utils import logging as diffusers_logging

    from genfast.diffusion.pipelines import (
        DenoiserWrapper,
        call_kwargs,
        denoiser_name,
        denoiser_of,
        initial_latents,
        random_pipeline,
    )
    from genfast.diffusion.transformer_archs import ARCHS
    from genfast.interface.process import prepare_process
    from genfast.platform.hardware import describe_isa

    prepare_process()
    spec = ARCHS[args.arch]
    blocks = args.blocks or spec.bench_blocks
    pipe = random_pipeline(args.arch, blocks=blocks)
    diffusers_logging.set_verbosity_error()  # its warning on every cast that no module asks for fp32
    pipe.to(dtype=getattr(torch, args.dtype))
    with torch.inference_mode():
        latents = initial_latents(pipe, args.size, args.size, seed=0)
    seconds: list[float] = []

    class Timed(DenoiserWrapper):
        def forward(self, *call_args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = self.denoiser(*call_args, **kwargs)
            seconds.append(time.perf_counter() - start)
            return out

    setattr(pipe, denoiser_name(pipe), Timed(denoiser_of(pipe)))
    per_image: list[float] = []
    for _ in range(args.images):
        seconds.clear()
        with torch.inference_mode():
            pipe(
                "a photograph of a lighthouse on a rocky coast at dusk",
                height=args.size,
                width=args.size,
                num_inference_steps=args.denoising_steps,
                latents=latents,
                generator=torch.Generator("cpu").manual_seed(0),
                output_type="latent",
                **{**call_kwargs(pipe), **dict(spec.call)},
            )
        per_image.append(sum(seconds) / len(seconds))
    print(
        f"\ndiffusers {type(pipe).__name__}, {args.arch} (random weights, {blocks} of {spec.full_blocks} blocks), "
        f"{args.dtype}, eager; {args.size}x{args.size}, {args.denoising_steps} steps; {describe_isa()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}\n"
    )
    print("| images timed | s/denoiser step (median) | each image's |")
    print("|---|---|---|")
    timed_images = per_image[1:] or per_image
    each = ", ".join(f"{s:.3f}" for s in timed_images)
    print(f"| {len(timed_images)} | {statistics.median(timed_images):.3f} | {each} |")


if __name__ == "__main__":
    main()
