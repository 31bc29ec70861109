"""`genfast imagine`: text to image with a diffusers pipeline and genfast's recipe.

    genfast imagine "a lighthouse at dusk" --model ./stable-diffusion-v1-5 -o out.png
    genfast imagine "a lighthouse at dusk" --model stabilityai/sdxl-turbo --denoising-steps 4 -o out.png
    genfast imagine "test" --model tiny-sd15 --random-weights --size 64x64 -o smoke.png   # no weights needed

The PNG carries the prompt, seed, steps, size, model and recipe as text metadata; it is written
atomically and never over an existing file without --force. A progress bar shows each denoising
step on stderr. --random-weights builds a tiny random pipeline (tiny-sd15, tiny-sdxl, tiny-pixart,
tiny-flux, tiny-sd3) for smoke tests and timing only: every output says so. Without --guidance the
pipeline's own default guidance applies (its `__call__`'s: 7.5 for SD 1.5, 5 for SDXL, 3.5 for
FLUX.1, 7 for SD 3.5).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import torch

from genfast.errors import UserError
from genfast.interface import images
from genfast.storage.files import check_outputs

RANDOM_ARCHS = {
    "tiny-sd15": "sd15",
    "tiny-sdxl": "sdxl",
    "tiny-pixart": "pixart",
    "tiny-flux": "flux",
    "tiny-sd3": "sd3",
}
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


def declared_denoiser(model: str) -> str | None:
    """The denoiser class (`unet` or `transformer`) a local pipeline directory's model_index.json
    declares, or None (a hub id, or no readable index): lets the recipe be checked against the
    pipeline before the slow load."""
    index = Path(model).expanduser() / "model_index.json"
    try:
        components = json.loads(index.read_text())
    except (OSError, ValueError):
        return None
    for name in ("unet", "transformer"):
        entry = components.get(name) if isinstance(components, dict) else None
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str):
            return entry[1]
    return None


def guidance_kwargs(pipe: Any, guidance: float | None, negative: str | None) -> dict[str, Any]:
    """The pipeline call's guidance scale (the user's, else the pipeline's own default) and
    negative prompt (only when given: pipelines differ in their default, PixArt's is "").
    Guidance-distilled pipelines (Flux: the scale is an input of the model, `true_cfg_scale` a
    separate, doubled-cost option) take no negative prompt from genfast."""
    parameters = inspect.signature(pipe.__call__).parameters
    kwargs: dict[str, Any] = {}
    if "guidance_scale" in parameters:
        kwargs["guidance_scale"] = parameters["guidance_scale"].default if guidance is None else guidance
    elif guidance is not None:
        raise UserError(f"{type(pipe).__name__} takes no guidance scale: leave out --guidance")
    if negative is not None:
        if "true_cfg_scale" in parameters:
            raise UserError(
                f"{type(pipe).__name__}'s guidance is distilled into the model (--guidance sets it): "
                "it takes no --negative prompt"
            )
        kwargs["negative_prompt"] = negative
    return kwargs


def check_size(pipe: Any, width: int, height: int) -> None:
    """A --size the pipeline cannot generate at exactly is an error, not a silently other size."""
    from genfast.diffusion.pipelines import size_multiple

    multiple = size_multiple(pipe)
    if width % multiple or height % multiple:
        raise UserError(
            f"--size {width}x{height}: {type(pipe).__name__} with this VAE and denoiser takes sides that "
            f"are multiples of {multiple}"
        )


def imagine_command(args: argparse.Namespace) -> int:
    from genfast.diffusion.pipelines import call_kwargs, initial_latents, native_size
    from genfast.diffusion.recipe import RECIPE, PipelineTarget, apply_recipe, pipeline_target
    from genfast.platform.hardware import DTYPES, dtype_name, resolve_device
    from genfast.platform.threads import avoid_busy_cores, use_threads

    size = parse_size(args.size) if args.size is not None else None
    output = Path(args.output).expanduser()
    images.check_png_names([output])  # fail before the slow part
    check_outputs([output], args.force, inputs=[args.model])
    device = resolve_device(args.device)
    dtype = dtype_name(args.dtype)
    # Checked now, before the slow load, against what a local directory declares; planned again
    # (and reported) for the loaded pipeline.
    recipe = RECIPE.plan(args.recipe, PipelineTarget(device, dtype, declared_denoiser(args.model))).settings
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    if args.random_weights:
        print(f"genfast: WARNING: {RANDOM_WEIGHTS_WARNING}", file=sys.stderr)
    start = time.perf_counter()
    other_work = use_threads(args.threads)
    pipe, description = load(args, DTYPES[recipe.dtype], device)
    if other_work is not None and device.type == "cpu":
        avoid_busy_cores(other_work, lambda message: print(message, file=sys.stderr))
    plan = RECIPE.plan(args.recipe, pipeline_target(pipe, dtype))
    recipe = plan.settings
    for message in plan.messages():
        print(f"genfast: {message}", file=sys.stderr)
    width, height = size or native_size(pipe)
    check_size(pipe, width, height)
    guidance = guidance_kwargs(pipe, args.guidance, args.negative)
    apply_recipe(pipe, recipe)
    # Saved compiles (CPU, static shapes) show their own progress (genfast/compilation/saved.py).
    compiles_lazily = recipe.compile != "none" and (recipe.dynamic_shapes or device.type != "cpu")
    print(
        f"genfast: {description} | recipe {args.recipe} in {recipe.dtype} | {width}x{height}, "
        f"{args.denoising_steps} steps, guidance {guidance.get('guidance_scale', 'none')}, seed {seed} on {device}"
        + (" (the first call compiles, for minutes; not saved for later runs)" if compiles_lazily else ""),
        file=sys.stderr,
        flush=True,
    )
    pipe.set_progress_bar_config(desc="denoising", file=sys.stderr)
    loaded = time.perf_counter()
    generator = torch.Generator("cpu").manual_seed(seed)
    with torch.inference_mode():
        image = pipe(
            args.prompt,
            height=height,
            width=width,
            num_inference_steps=args.denoising_steps,
            latents=initial_latents(pipe, height, width, seed),
            generator=generator,
            **guidance,
            **call_kwargs(pipe),
        ).images[0]
    done = time.perf_counter()
    text = {
        "genfast:prompt": args.prompt,
        "genfast:seed": str(seed),
        "genfast:steps": str(args.denoising_steps),
        "genfast:size": f"{width}x{height}",
        "genfast:guidance": str(guidance.get("guidance_scale", "none")),
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
