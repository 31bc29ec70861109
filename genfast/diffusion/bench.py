"""`genfast bench diffusion`: the recipe's ladder (genfast/diffusion/recipe.py) on the user's machine.

Every step runs in a fresh interpreter on the same pipeline (random weights at the real
architecture size: speed does not depend on weight values; `tiny-sd15`/`tiny-sdxl` for smoke
tests), the same prompt and seed: seconds per image (text encoding + N denoising steps + VAE
decode), seconds per denoiser step (the denoiser's own calls, timed around it), compile time
(first call minus a warm one), peak memory, and PSNR of the image against the baseline's (fp32,
explicit-softmax attention) and against the same fp32 pipeline with SDPA attention. Rows compiled
with symbolic sizes also generate one image at a second resolution and report the graphs it added
(0: no recompile).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from genfast.bench.ladder import COMPILE_TIME, NOTE, PEAK_MEMORY, SPEEDUP, STEP, Case, Ladder, Options, Row
from genfast.bench.table import median
from genfast.diffusion.pipelines import DenoiserWrapper
from genfast.diffusion.recipe import RECIPE
from genfast.errors import UserError
from genfast.platform.hardware import synchronize
from genfast.recipe import Plan, Target

ARCHS = ("sd15", "sdxl", "tiny-sd15", "tiny-sdxl")
PROMPT = "a photograph of a lighthouse on a rocky coast at dusk"
# Reference images and the row keys of the PSNR against them; both come from the baseline's process
# (fp32-sdpa: the baseline pipeline switched to SDPA attention, the quality reference).
REFERENCES = {"baseline": "psnr_db", "fp32-sdpa": "psnr_vs_sdpa_db"}


def _pipeline(arch: str, device: torch.device) -> Any:
    from genfast.diffusion.pipelines import random_pipeline, tiny_pipeline

    if arch.startswith("tiny-"):
        return tiny_pipeline(arch.removeprefix("tiny-")).to(device)
    return random_pipeline(arch, device=device).to(device)


class _TimedDenoiser(DenoiserWrapper):
    """Times the denoiser's calls from outside (hooks on a module compiled in place would be
    traced into its graph); device-synchronized on CUDA."""

    def __init__(self, denoiser: torch.nn.Module, device: torch.device) -> None:
        super().__init__(denoiser)
        self.device, self.seconds = device, 0.0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        synchronize(self.device)
        start = time.perf_counter()
        out = self.denoiser(*args, **kwargs)
        synchronize(self.device)
        self.seconds += time.perf_counter() - start
        return out


class DiffusionLadder(Ladder):
    workload = "diffusion"
    recipe = RECIPE
    speed_key = "s_per_image"
    higher_is_faster = False
    # fmt: off
    columns = (
        STEP, ("s_per_image", "s/image", ".2f"), SPEEDUP, ("s_per_denoiser_step", "s/denoiser step", ".3f"),
        COMPILE_TIME, PEAK_MEMORY, ("psnr_db", "PSNR vs baseline dB", ".1f"),
        ("psnr_vs_sdpa_db", "PSNR vs fp32 SDPA dB", ".1f"), ("new_size_graphs", "graphs at new size", "d"), NOTE,
    )
    # fmt: on

    def options(self, args: argparse.Namespace) -> Options:
        if args.arch not in ARCHS:
            raise UserError(f"unknown --arch {args.arch!r}; choose one of {', '.join(ARCHS)}")
        if args.size % 8 or not 8 <= args.size <= 4096:
            raise UserError(f"--size {args.size}: must be a multiple of 8 between 8 and 4096")
        return {**super().options(args), "arch": args.arch, "size": args.size, "denoising_steps": args.denoising_steps}

    def header(self, options: Options, machine: str) -> str:
        from genfast import steps
        from genfast.platform.hardware import resolve_device

        dtype = steps.low_precision_name(Target(resolve_device(options["device"]), options["dtype"])) or "float32"
        return (
            f"genfast bench diffusion: {options['arch']} with RANDOM weights (speed only), {options['size']}x"
            f"{options['size']}, {options['denoising_steps']} denoising steps, on {machine}; median of "
            f"{options['repeats']}; steps from bf16 on in {dtype}"
        )

    def model(self, options: Options) -> str:
        return f"{options['arch']} (random weights)"

    def footnote(self, options: Options, rows: list[dict[str, Any]]) -> str:
        return (
            f"s/image: prompt encoding + {options['denoising_steps']} denoising steps (classifier-free guidance) + "
            f"VAE decode, median of {options['repeats']} after a warm-up. PSNR: same seed and prompt, images in "
            "[0, 1]."
        )

    def build(self, row: Row, plan: Plan | None, options: Options, target: Target, workdir: Path) -> Case:
        from genfast.diffusion.attention import set_attention
        from genfast.diffusion.pipelines import denoiser_name, denoiser_of, initial_latents
        from genfast.diffusion.recipe import apply_recipe

        assert plan is not None  # every row is a recipe step
        settings, size, steps = plan.settings, options["size"], options["denoising_steps"]
        pipe = _pipeline(options["arch"], target.device)
        apply_recipe(pipe, settings)
        timer = _TimedDenoiser(denoiser_of(pipe), target.device)  # around the feature cache too: what the loop calls
        setattr(pipe, denoiser_name(pipe), timer)

        def generate(height: int = size, width: int = size) -> torch.Tensor:
            generator = torch.Generator("cpu").manual_seed(0)
            with torch.inference_mode():
                return (
                    pipe(
                        PROMPT,
                        height=height,
                        width=width,
                        num_inference_steps=steps,
                        latents=initial_latents(pipe, height, width, seed=0),
                        generator=generator,
                        output_type="pt",
                    )
                    .images.float()
                    .cpu()
                )

        denoiser_times: list[float] = []

        def run() -> torch.Tensor:
            timer.seconds = 0.0
            image = generate()
            denoiser_times.append(timer.seconds / steps)
            return image

        def measure(images: list[torch.Tensor], seconds: list[float]) -> dict[str, Any]:
            result: dict[str, Any] = {
                "s_per_image": median(seconds),
                "s_per_denoiser_step": median(denoiser_times[1:]),
                "arch": options["arch"],
                "size": size,
                "denoising_steps": steps,
            }
            if settings.dynamic_shapes:  # a smaller, non-square second size: cheaper than the timed one
                from torch._dynamo.utils import counters

                graphs = counters["stats"]["unique_graphs"]
                generate(height=max(size - 64, 64), width=max(size - 128, 64))
                result["new_size_graphs"] = counters["stats"]["unique_graphs"] - graphs
            if row.step == self.recipe.baseline:  # the references: this image, and SDPA's in fp32
                torch.save(images[-1], workdir / "baseline.pt")
                for model in (timer.denoiser, pipe.vae):
                    set_attention(model, "sdpa")
                torch.save(generate(), workdir / "fp32-sdpa.pt")
            return result

        def notes() -> list[str]:
            from genfast.compilation.saved import compile_notes

            return compile_notes(timer.denoiser) + compile_notes(pipe.vae)

        return Case(run, measure, compiled=settings.compile != "none", notes=notes)

    def compare(self, row: Row, output: Any, workdir: Path) -> dict[str, Any]:
        from genfast.diffusion.quality import psnr

        result = {}
        for reference, key in REFERENCES.items():
            path = workdir / f"{reference}.pt"
            if path.exists() and row.step != self.recipe.baseline:
                result[key] = psnr(output, torch.load(path))
        return result


def bench_command(args: argparse.Namespace) -> int:
    from genfast.bench.ladder import run

    return run(DiffusionLadder(), args)
