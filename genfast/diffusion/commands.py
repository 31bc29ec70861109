"""`genfast imagine`: text to image with a diffusers pipeline and genfast's recipe.

    genfast imagine "a lighthouse at dusk" --model ./stable-diffusion-v1-5 -o out.png
    genfast imagine "a lighthouse at dusk" --model stabilityai/sdxl-turbo --denoising-steps 4 -o out.png
    genfast imagine "test" --model tiny-sd15 --random-weights --size 64x64 -o smoke.png   # no weights needed

The PNG carries the prompt, seed, steps, size, model and recipe as text metadata; it is written
atomically and never over an existing file without --force. A progress bar shows each denoising
step on stderr. --random-weights builds a tiny random pipeline (tiny-sd15, tiny-sdxl) for smoke
tests and timing only: every output says so.
"""

from __future__ import annotations

import argparse
import re
import secrets
import sys
import time
from pathlib import Path

import torch

from genfast.errors import UserError
from genfast.interface import images
from genfast.storage.files import check_outputs

RANDOM_ARCHS = {"tiny-sd15": "sd15", "tiny-sdxl": "sdxl", "tiny-pixart": "pixart"}
RANDOM_WEIGHTS_WARNING = "random weights (--random-weights): for smoke tests and timing only; the image is noise"
MAX_SIDE = 4096


def parse_size(text: str) -> tuple[int, int]:
    """'WxH' -> (width, height), each a positive multiple of 8 (the VAE's downscale factor)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match:
        raise UserError(f"--size takes WIDTHxHEIGHT in pixels, e.g. 512x512; got {text!r}")
    width, height = int(match.group(1)), int(match.group(2))
    if not (8 <= width <= MAX_SIDE and 8 <= height <= MAX_SIDE) or width % 8 or height % 8:
        raise UserError(f"--size {width}x{height}: both sides must be multiples of 8 between 8 and {MAX_SIDE}")
    return width, height


def load(args: argparse.Namespace, dtype: torch.dtype, device: torch.device):
    from genfast.diffusion.pipelines import load_pipeline, tiny_pipeline

    if args.random_weights:
        if args.model not in RANDOM_ARCHS:
            raise UserError(
                f"--random-weights builds one of {', '.join(RANDOM_ARCHS)}, not {args.model!r} "
                "(real-size random architectures come with `genfast bench diffusion`)"
            )
        return tiny_pipeline(RANDOM_ARCHS[args.model]).to(device), f"{args.model} with RANDOM weights"
    if args.model in RANDOM_ARCHS:
        raise UserError(f"{args.model} exists only with random weights: add --random-weights")
    return load_pipeline(args.model, dtype=dtype, device=device), args.model


def imagine_command(args: argparse.Namespace) -> int:
    from genfast.diffusion.pipelines import call_kwargs, initial_latents, native_size
    from genfast.diffusion.recipe import RECIPE, apply_recipe
    from genfast.platform.hardware import DTYPES, dtype_name, resolve_device
    from genfast.platform.threads import avoid_busy_cores, use_threads
    from genfast.recipe import Target

    size = parse_size(args.size) if args.size is not None else None
    output = Path(args.output).expanduser()
    images.check_png_names([output])  # fail before the slow part
    check_outputs([output], args.force, inputs=[args.model])
    device = resolve_device(args.device)
    plan = RECIPE.plan(args.recipe, Target(device, dtype_name(args.dtype)))
    recipe = plan.settings
    for message in plan.messages():
        print(f"genfast: {message}", file=sys.stderr)
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    if args.random_weights:
        print(f"genfast: WARNING: {RANDOM_WEIGHTS_WARNING}", file=sys.stderr)
    start = time.perf_counter()
    other_work = use_threads(args.threads)
    pipe, description = load(args, DTYPES[recipe.dtype], device)
    if other_work is not None and device.type == "cpu":
        avoid_busy_cores(other_work, lambda message: print(message, file=sys.stderr))
    width, height = size or native_size(pipe)
    apply_recipe(pipe, recipe)
    # Saved compiles (CPU, static shapes) show their own progress (genfast/compilation/saved.py).
    compiles_lazily = recipe.compile != "none" and (recipe.dynamic_shapes or device.type != "cpu")
    print(
        f"genfast: {description} | recipe {args.recipe} in {recipe.dtype} | {width}x{height}, "
        f"{args.denoising_steps} steps, seed {seed} on {device}"
        + (" (the first call compiles, for minutes; not saved for later runs)" if compiles_lazily else ""),
        file=sys.stderr,
        flush=True,
    )
    pipe.set_progress_bar_config(desc="denoising", file=sys.stderr)
    loaded = time.perf_counter()
    generator = torch.Generator("cpu").manual_seed(seed)
    with torch.inference_mode():
        # Only a given negative prompt is passed: pipelines differ in their default (PixArt's is "").
        negative = {} if args.negative is None else {"negative_prompt": args.negative}
        image = pipe(
            args.prompt,
            height=height,
            width=width,
            num_inference_steps=args.denoising_steps,
            guidance_scale=args.guidance,
            latents=initial_latents(pipe, height, width, seed),
            generator=generator,
            **negative,
            **call_kwargs(pipe),
        ).images[0]
    done = time.perf_counter()
    text = {
        "genfast:prompt": args.prompt,
        "genfast:seed": str(seed),
        "genfast:steps": str(args.denoising_steps),
        "genfast:size": f"{width}x{height}",
        "genfast:model": description,
        "genfast:recipe": args.recipe,
        "genfast:random-weights": str(bool(args.random_weights)).lower(),
    }
    if args.random_weights:
        text["Warning"] = RANDOM_WEIGHTS_WARNING
    images.write_files({output: images.png_bytes(image, text)}, args.force)
    print(
        f"genfast: wrote {output} | load {loaded - start:.1f} s, generate {done - loaded:.1f} s "
        f"({(done - loaded) / args.denoising_steps:.2f} s/step incl. text encoding and decoding)"
        + (f" | WARNING: {RANDOM_WEIGHTS_WARNING}" if args.random_weights else ""),
        file=sys.stderr,
    )
    return 0
