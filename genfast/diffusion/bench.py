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
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from genfast.bench.isolated import run_row
from genfast.bench.machine import describe_machine, machine_info
from genfast.bench.table import check_writable, median, report, write_json_atomic
from genfast.diffusion import DIFFUSION_STEPS
from genfast.diffusion.pipelines import DenoiserWrapper
from genfast.errors import UserError
from genfast.hardware import peak_memory_bytes, synchronize

ARCHS = ("sd15", "sdxl", "tiny-sd15", "tiny-sdxl")
PROMPT = "a photograph of a lighthouse on a rocky coast at dusk"
# Reference images and the row keys of the PSNR against them; both come from the baseline's process
# (fp32-sdpa: the baseline pipeline switched to SDPA attention, the quality reference).
REFERENCES = {"baseline": "psnr_db", "fp32-sdpa": "psnr_vs_sdpa_db"}
COLUMNS = [
    ("step", "step", ""), ("s_per_image", "s/image", ".2f"), ("speedup", "vs baseline", ".2f"),
    ("s_per_denoiser_step", "s/denoiser step", ".3f"), ("compile_s", "compile s", ".0f"),
    ("peak_mem_gb", "peak mem GB", ".2f"), ("psnr_db", "PSNR vs baseline dB", ".1f"),
    ("psnr_vs_sdpa_db", "PSNR vs fp32 SDPA dB", ".1f"), ("new_size_graphs", "graphs at new size", "d"),
    ("note", "note", ""),
]


def _pipeline(arch: str) -> Any:
    from genfast.diffusion.pipelines import random_pipeline, tiny_pipeline

    return tiny_pipeline(arch.removeprefix("tiny-")) if arch.startswith("tiny-") else random_pipeline(arch)


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


def run_step(step: str, arch: str, size: int, steps: int, repeats: int, device: torch.device,
             reference_dir: Path, low_precision: torch.dtype | None = torch.bfloat16) -> dict[str, Any]:
    """One row, in this process; the reference steps save their images to reference_dir."""
    from genfast.diffusion.pipelines import denoiser_name, denoiser_of
    from genfast.diffusion.quality import psnr
    from genfast.diffusion.recipe import apply_recipe, recipe_for_step
    from genfast.hardware import low_precision_note

    if step == "bf16" and low_precision is None:
        return {"step": step, "note": f"skipped: {low_precision_note(device)}"}
    recipe = recipe_for_step(step, low_precision)
    pipe = _pipeline(arch).to(device)
    apply_recipe(pipe, recipe)
    timer = _TimedDenoiser(denoiser_of(pipe), device)  # around the feature cache too: what the loop calls
    setattr(pipe, denoiser_name(pipe), timer)

    def generate(height: int = size, width: int = size) -> torch.Tensor:
        generator = torch.Generator("cpu").manual_seed(0)
        with torch.inference_mode():
            return pipe(PROMPT, height=height, width=width, num_inference_steps=steps, generator=generator,
                        output_type="pt").images.float().cpu()

    start = time.perf_counter()
    image = generate()  # warm-up (and compilation)
    first_s = time.perf_counter() - start
    times, denoiser_times = [], []
    for _ in range(repeats):
        timer.seconds = 0.0
        start = time.perf_counter()
        image = generate()
        times.append(time.perf_counter() - start)
        denoiser_times.append(timer.seconds / steps)
    seconds = median(times)
    row: dict[str, Any] = {"step": step, "s_per_image": seconds, "s_per_denoiser_step": median(denoiser_times),
                           "peak_mem_gb": peak_memory_bytes(device) / 1e9, "arch": arch, "size": size,
                           "denoising_steps": steps}
    if recipe.compile != "none":
        row["compile_s"] = max(first_s - seconds, 0.0)
    if recipe.dynamic_shapes:  # a smaller, non-square second size: cheaper than the timed one
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        generate(height=max(size - 64, 64), width=max(size - 128, 64))
        row["new_size_graphs"] = counters["stats"]["unique_graphs"] - graphs
    if step == "baseline":
        from genfast.diffusion.attention import set_attention

        torch.save(image, reference_dir / "baseline.pt")
        for model in (timer.denoiser, pipe.vae):
            set_attention(model, "sdpa")
        torch.save(generate(), reference_dir / "fp32-sdpa.pt")
    for reference, key in REFERENCES.items():
        path = reference_dir / f"{reference}.pt"
        if path.exists() and step != "baseline":
            row[key] = psnr(image, torch.load(path))
    return row


def bench_command(args: argparse.Namespace) -> int:
    from genfast.hardware import low_precision_dtype, resolve_device

    if args.arch not in ARCHS:
        raise UserError(f"unknown --arch {args.arch!r}; choose one of {', '.join(ARCHS)}")
    if args.size % 8 or not 8 <= args.size <= 4096:
        raise UserError(f"--size {args.size}: must be a multiple of 8 between 8 and 4096")
    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    low_precision = low_precision_dtype(args.dtype, device)
    if args.one_step:
        row = run_step(args.one_step, args.arch, args.size, args.steps, args.repeats, device, Path(args.reference_dir),
                       low_precision)
        write_json_atomic(args.json_path, row)
        return 0
    if args.json_path:
        check_writable(args.json_path, args.force)
    ladder = args.only.split(",") if args.only else list(DIFFUSION_STEPS)
    unknown = [s for s in ladder if s not in DIFFUSION_STEPS]
    if unknown:
        raise UserError(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(DIFFUSION_STEPS)}")
    ladder.sort(key=DIFFUSION_STEPS.index)
    info = machine_info(device)
    print(f"genfast bench diffusion: {args.arch} with RANDOM weights (speed only), {args.size}x{args.size}, "
          f"{args.steps} steps, on {describe_machine(info)}; median of {args.repeats}; steps from bf16 on in "
          f"{str(low_precision or torch.float32).removeprefix('torch.')}", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory(prefix="genfast-bench-diffusion-") as reference_dir:
        for step in ladder:
            print(f"  {step} ...", file=sys.stderr, flush=True)
            argv = ["bench", "diffusion", "--one-step", step, "--arch", args.arch, "--size", str(args.size),
                    "--steps", str(args.steps), "--repeats", str(args.repeats), "--device", args.device,
                    "--dtype", args.dtype,
                    "--reference-dir", reference_dir]
            if args.threads:
                argv += ["--threads", str(args.threads)]
            rows.append(run_row(argv, f"step {step}"))
    base = next((r for r in rows if r["step"] == "baseline"), None)
    for row in rows:
        if base is not None and row.get("s_per_image"):
            row["speedup"] = base["s_per_image"] / row["s_per_image"]
    report(rows, COLUMNS, info, f"{args.arch} (random weights)",
           f"s/image: prompt encoding + {args.steps} denoising steps (classifier-free guidance) + VAE decode, "
           f"median of {args.repeats} after a warm-up. PSNR: same seed and prompt, images in [0, 1].", args.json_path)
    return 0
