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
import sys
import time
from pathlib import Path

from genfast.diffusion.generator import RANDOM_WEIGHTS_WARNING, guidance_kwargs, parse_size, random_seed
from genfast.errors import UserError
from genfast.interface import images
from genfast.storage.files import check_outputs


def generator_arguments(args: argparse.Namespace) -> dict:
    """`ImageGenerator`'s arguments from `genfast imagine`'s flags."""
    size = parse_size(args.size) if args.size is not None else None  # checked before the slow load
    return dict(
        model=args.model, recipe=args.recipe, device=args.device, dtype=args.dtype, threads=args.threads,
        random_weights=args.random_weights, size=size, steps=args.denoising_steps, guidance=args.guidance,
        batch_size=args.batch_size, quant=args.quant,
    )  # fmt: skip


def load_announced(args: argparse.Namespace):
    """The ImageGenerator of the flags, its load and plan said on stderr; on the CPU without
    --threads, computing beside other work on the cores it leaves free."""
    from genfast.diffusion.generator import ImageGenerator
    from genfast.platform.threads import avoid_busy_cores, use_threads

    arguments = generator_arguments(args)
    if args.random_weights:
        print(f"genfast: WARNING: {RANDOM_WEIGHTS_WARNING}", file=sys.stderr)
    other_work = use_threads(args.threads)
    generator = ImageGenerator(**arguments)
    if other_work is not None and generator.device.type == "cpu":
        avoid_busy_cores(other_work, lambda message: print(message, file=sys.stderr))
    for message in generator.messages:
        print(f"genfast: {message}", file=sys.stderr)
    return generator


def describe(generator, args: argparse.Namespace, seeds: str) -> str:
    settings = generator.settings
    # Saved compiles (CPU, static shapes) show their own progress (genfast/compilation/saved.py).
    compiles_lazily = settings.compile != "none" and (settings.dynamic_shapes or generator.device.type != "cpu")
    guidance = generator.guidance_scale if generator.guidance_scale is not None else "none"
    return (
        f"genfast: {generator.description} | recipe {generator.recipe} in {settings.dtype} | "
        f"{generator.width}x{generator.height}, {args.denoising_steps} steps, guidance {guidance}, {seeds} on "
        f"{generator.device}"
        + (" (the first call compiles, for minutes; not saved for later runs)" if compiles_lazily else "")
    )


def imagine_command(args: argparse.Namespace) -> int:
    """`genfast imagine PROMPT -o OUT.png`."""
    if args.prompt is None:
        raise UserError("give a prompt, or --prompts FILE for many")
    if args.output is None:
        raise UserError("give -o OUT.png: the file to write the image to")
    output = Path(args.output).expanduser()
    images.check_png_names([output])  # fail before the slow part
    check_outputs([output], args.force, inputs=[args.model])
    seed = args.seed if args.seed is not None else random_seed()
    start = time.perf_counter()
    generator = load_announced(args)
    guidance_kwargs(generator.pipe, None, args.negative)  # a negative prompt the pipeline takes none of
    print(describe(generator, args, f"seed {seed}"), file=sys.stderr, flush=True)
    generator.pipe.set_progress_bar_config(desc="denoising", file=sys.stderr, disable=False)
    loaded = time.perf_counter()
    [image] = generator.generate(args.prompt, seed=seed, negative=args.negative)
    done = time.perf_counter()
    images.write_files({output: images.png_bytes(image, generator.png_text(args.prompt, seed, args.negative))},
                       args.force)  # fmt: skip
    print(
        f"genfast: wrote {output} | load {loaded - start:.1f} s, generate {done - loaded:.1f} s "
        f"({(done - loaded) / args.denoising_steps:.2f} s/step incl. text encoding and decoding)"
        + (f" | WARNING: {RANDOM_WEIGHTS_WARNING}" if args.random_weights else ""),
        file=sys.stderr,
    )
    return 0
