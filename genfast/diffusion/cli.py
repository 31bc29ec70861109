"""Diffusion's commands on the command line: imagine and bench diffusion. Torch-free: handlers are
imported to run."""

from __future__ import annotations

import argparse

from genfast.diffusion.recipe import BLOCK_CACHE_THRESHOLD, DEFAULT_STEP, RECIPE
from genfast.interface.arguments import (
    add_bench_args,
    add_device,
    add_ray,
    add_recipe,
    add_threads,
    lazy,
    non_negative_float,
    positive_int,
    seed,
)

IMAGINE_DESCRIPTION = """Generate an image from a prompt with a diffusers pipeline, made fast by genfast's recipe
(genfast/diffusion/recipe.py). Needs diffusers: pip install 'genfast[diffusion]'."""
BENCH_DIFFUSION_HELP = "text-to-image ladder (random weights at the real size) vs fp32"
BENCH_DIFFUSION_DESCRIPTION = """Seconds per image and per denoiser step, compile time, peak memory and PSNR against
the fp32 baseline for each step of the recipe (genfast/diffusion/recipe.py), on random weights at the real
architecture size."""


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "imagine", help="text to image with a diffusers pipeline (PNG out)", description=IMAGINE_DESCRIPTION
    )
    p.add_argument("prompt", nargs="?", default=None, help="what to draw (or --prompts FILE)")
    p.add_argument(
        "--model",
        "-m",
        required=True,
        help="a diffusers pipeline directory (with model_index.json) or a hub id (downloaded when "
        "online); with --random-weights: tiny-sd15, tiny-sdxl, tiny-pixart, tiny-flux, tiny-sd3, or at the real "
        "size sd15, sdxl, flux-schnell, flux-dev, sd35-medium, sd35-large",
    )
    p.add_argument(
        "--output", "-o", default=None, metavar="OUT.png", help="the image file (PNG); with --prompts, a folder"
    )
    p.add_argument("--denoising-steps", type=positive_int, default=30, metavar="N", help="denoising steps (default 30)")
    p.add_argument(
        "--size",
        default=None,
        metavar="WxH",
        help="pixels, multiples of 8 (default: the size the model was trained at, e.g. 512x512 for SD 1.5, "
        "1024x1024 for SDXL)",
    )
    p.add_argument(
        "--seed",
        type=seed,
        default=None,
        help="default: random (printed, and stored in the PNG); with --prompts, the base seed (default 0): an item "
        "without its own seed gets it plus its line number less one",
    )
    p.add_argument(
        "--guidance",
        type=non_negative_float,
        default=None,
        help="guidance scale (default: the pipeline's own, e.g. 7.5 for SD 1.5, 3.5 for FLUX.1); classifier-free "
        "guidance: 1 or less turns it off; FLUX.1-dev: the distilled guidance the model takes as input",
    )
    p.add_argument("--negative", default=None, metavar="TEXT", help="negative prompt")
    p.add_argument(
        "--quant",
        choices=("none", "int8"),
        default="none",
        help="int8: load a transformer pipeline (FLUX.1, SD 3/3.5; a local directory or --random-weights) "
        "in int8 to fit in less memory: the text encoders' linears weight-only int8, then the transformer read "
        "block by block, each block's linears quantized as the dynamic-int8 recipe step does as soon as it is "
        "read (its whole bf16 weights never exist; FLUX.1-schnell at 512x512 peaked at 19.4 GiB). Before loading, a "
        "pipeline that would not fit in the available memory is refused with the GiB it needs (default none)",
    )
    add_recipe(p, RECIPE, DEFAULT_STEP)
    add_device(p)
    add_threads(p, beside_other_work=True)
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="random weights: a tiny pipeline, or a real architecture's size (smoke tests and timing only; "
        "labelled in every output)",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    g = p.add_argument_group("many prompts from a file (genfast/diffusion/prompts_file.py)")
    g.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help='one prompt a line (OUTDIR/00001.png ...), or .jsonl: {"id": ..., "prompt": "..."} a line with '
        "optionally its own seed and negative (OUTDIR/ID.png); a re-run skips the PNGs already there",
    )
    g.add_argument("--batch-size", type=positive_int, default=1, help="prompts drawn in one pipeline call (default 1)")
    add_ray(g, "with --prompts; the PNGs come back to OUTDIR here")
    p.set_defaults(run=_imagine)


def _imagine(args: argparse.Namespace) -> int:
    """`genfast imagine`: one prompt (genfast/diffusion/commands.py), a file of them (--prompts:
    genfast/diffusion/prompts_file.py) or a file of them on a Ray cluster (--ray: genfast/ray/diffusion.py)."""
    if args.ray is not None:
        return lazy("genfast.ray.diffusion", "imagine_command")(args)
    if args.prompts is not None:
        return lazy("genfast.diffusion.prompts_file", "imagine_file_command")(args)
    return lazy("genfast.diffusion.commands", "imagine_command")(args)


def register_bench(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("diffusion", help=BENCH_DIFFUSION_HELP, description=BENCH_DIFFUSION_DESCRIPTION)
    g = b.add_argument_group("diffusion")
    g.add_argument(
        "--arch",
        default="sd15",
        help="sd15, sdxl, flux-schnell, flux-dev, sd35-medium or sd35-large (tiny-sd15, tiny-sdxl, tiny-flux, "
        "tiny-sd3: smoke tests) (default sd15)",
    )
    g.add_argument(
        "--blocks",
        type=positive_int,
        default=None,
        metavar="N",
        help="FLUX.1 and SD 3.5: transformer blocks to build at the real width, the text encoders cut to the same "
        "fraction of their layers (default: what a 2-core CPU can time: 3 of FLUX.1's 57, 4 of SD 3.5-medium's "
        "24, 2 of -large's 38)",
    )
    g.add_argument("--size", type=positive_int, default=512, help="image side in pixels (default 512)")
    g.add_argument(
        "--denoising-steps", type=positive_int, default=4, metavar="N", help="denoising steps per image (default 4)"
    )
    g.add_argument(
        "--cache-threshold",
        type=float,
        default=None,
        metavar="T",
        help="FLUX.1 and SD 3.5: the threshold of both cache rows (feature-cache's block cache, cache-dit's "
        "residual_diff_threshold): the first block's relative residual change under which a step skips the "
        f"other blocks (default: the recipe's, {BLOCK_CACHE_THRESHOLD}, under which random weights at the real width "
        "cache no step: a higher one shows what a cached step costs)",
    )
    g.add_argument(
        "--cache-blocks",
        default=None,
        metavar="F,B",
        help="FLUX.1 and SD 3.5: both cache rows' front blocks, computed before the decision, and back blocks, "
        "computed after the cached ones on every step (cache-dit's Fn_compute_blocks and Bn_compute_blocks; "
        "default: the recipe's, 1,0)",
    )
    add_bench_args(b, "diffusion", repeats=3)
    b.set_defaults(run=lazy("genfast.diffusion.bench", "bench_command"))
