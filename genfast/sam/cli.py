"""Segment Anything's commands on the command line: segment and bench sam. Torch-free: handlers
are imported to run."""

from __future__ import annotations

import argparse

from genfast.interface.arguments import (
    add_bench_args,
    add_device,
    add_ray,
    add_recipe,
    add_threads,
    lazy,
    positive_int,
    unit_float,
)
from genfast.sam.recipe import DEFAULT_STEP, RECIPE

DTYPE_HELP = """the recipe's bf16 step: float32 (the default: no bf16 step, masks as the original model makes them),
auto (bfloat16 where the hardware computes in it natively), bfloat16 or float16 (CUDA only)"""
SEGMENT_DESCRIPTION = """Segment an image with SAM or SAM 2 (--model sam2.1-hiera-tiny ...). Prompts: --point X,Y
(repeatable, with one --label 1|0 per point; default foreground) and/or --box X0,Y0,X1,Y1, in
pixels (x right, y down); or --auto for every object."""
BENCH_SAM_HELP = "Segment Anything ladder (random weights, real images) vs the original package"
BENCH_SAM_DESCRIPTION = """Images/s, peak memory and agreement with the original segment-anything fp32 predictor for
each step of the recipe (genfast/sam/recipe.py), on random weights at the real architecture size. --steps also takes
'original' (the original package's predictor, the first row by default)."""

SEGMENT_EPILOG = """outputs (never overwritten without --force; written atomically, all or nothing):
  -o OUT.png       prompts: the best-scoring mask (8-bit, 0/255); with --multimask the
                   k-th best also to OUT-k.png (k = 2, 3). --auto: a label map (0 =
                   background, i = i-th mask by decreasing area; 16-bit beyond 255).
  OUT-overlay.png  masks tinted over the image with the prompt drawn (see --overlay).
  --json PATH      masks as uncompressed RLE ({size: [H, W], counts}, column-major,
                   zeros first) with predicted IoU, area and XYWH box ('-' = stdout).
many images: -o OUTDIR gets NAME.png, NAME-overlay.png and NAME.json for each image NAME.EXT,
  written as each is done; a re-run skips the images already done, and a bad image is named
  and left out while the others run (exit status 1 if any was).
video (SAM 2): -o OUTDIR gets masks/obj{ID}/{FRAME:05d}.png, masks.json (RLE per object and
  frame) and overlay.mp4; objects are tracked forwards from their first prompted frame, then
  backwards; frames are decoded as needed (memory does not grow with the video). The model
  defaults to sam2.1-hiera-tiny.
weights: not shipped; `genfast pull sam-vit-b` (or sam2.1-hiera-tiny ...) downloads the
official checkpoint into the cache, where --model finds it (or pass --checkpoint PATH)."""


def _segment(args: argparse.Namespace) -> int:
    """`genfast segment`: here (genfast/sam/segment.py), or many images on a Ray cluster (--ray:
    genfast/ray/sam.py)."""
    if args.ray is not None:
        return lazy("genfast.ray.sam", "segment_command")(args)
    return lazy("genfast.sam.segment", "segment")(args)


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "segment",
        help="Segment Anything: masks for points/a box, or every object (--auto)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=SEGMENT_DESCRIPTION,
        epilog=SEGMENT_EPILOG,
    )
    p.add_argument(
        "image",
        metavar="INPUT",
        help="an image file (any format Pillow reads; EXIF orientation is applied); many images: a folder or a "
        "quoted glob pattern ('photos/*.jpg'); or a video (.mp4, .mov, .mkv, .webm ...) or a folder of its "
        "frames (named by frame number), which SAM 2 tracks (see below)",
    )
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--images", action="store_true", help="INPUT is a folder of separate images, whatever the names")
    kind.add_argument("--video", action="store_true", help="INPUT is a video, or a folder of frames whatever the names")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=1,
        help="many images with a prompt: images per image-encoder call (default 1)",
    )
    g = p.add_argument_group("prompt")
    g.add_argument("--point", action="append", metavar="X,Y", help="a point on the object (repeatable)")
    g.add_argument(
        "--label",
        action="append",
        metavar="1|0",
        help="per --point, in order: 1 foreground, 0 background (default: all foreground)",
    )
    g.add_argument("--box", action="append", metavar="X0,Y0,X1,Y1", help="a box around the object")
    g.add_argument(
        "--multimask",
        action="store_true",
        help="keep all of SAM's 3 candidate masks (default: only the best-scoring one)",
    )
    g.add_argument("--auto", action="store_true", help="segment everything (a grid of points; no prompts)")
    g.add_argument(
        "--object",
        action="append",
        metavar="ID",
        help="video: the object a prompt belongs to (once for all prompts, or once per --point then --box; default 1)",
    )
    g.add_argument(
        "--frame",
        action="append",
        metavar="N",
        help="video: the frame a prompt is given on (once for all, or once per prompt as --object; default 0)",
    )
    g.add_argument(
        "--points-per-side", type=positive_int, default=32, metavar="N", help="--auto: grid size (default 32)"
    )
    g.add_argument(
        "--points-per-batch",
        type=positive_int,
        default=64,
        metavar="N",
        help="--auto: points decoded and filtered together (default 64)",
    )
    g.add_argument(
        "--pred-iou-thresh",
        type=unit_float,
        default=None,
        metavar="T",
        help="--auto: drop masks with a lower predicted IoU (default: 0.88 for SAM, 0.8 for SAM 2, as the official "
        "generators)",
    )
    g.add_argument(
        "--stability-score-thresh",
        type=unit_float,
        default=0.95,
        metavar="T",
        help="--auto: drop masks with a lower stability score (default 0.95)",
    )
    g = p.add_argument_group("output")
    g.add_argument("--output", "-o", default=None, metavar="OUT.png", help="the mask PNG (see below)")
    g.add_argument("--overlay", default=None, metavar="PATH", help="the overlay PNG (default: OUT-overlay.png)")
    g.add_argument("--no-overlay", action="store_true", help="do not write an overlay")
    g.add_argument(
        "--json",
        dest="json_path",
        default=None,
        metavar="PATH",
        help="masks (uncompressed RLE), scores and boxes as JSON ('-' = stdout)",
    )
    g.add_argument("--force", action="store_true", help="overwrite existing output files")
    add_ray(
        g,
        "many images only: the actors segment them, this process writes OUTDIR's files as without --ray",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--checkpoint",
        default=None,
        metavar="PATH",
        help="a SAM or SAM 2 checkpoint (official sam_vit_*.pth or sam2*_hiera_*.pt, or a Hugging Face SAM 2 "
        "folder with config.json and model.safetensors)",
    )
    g.add_argument(
        "--model",
        "-m",
        default=None,
        help="from the cache (`genfast pull NAME`): sam-vit-b, sam-vit-l, sam-vit-h, or SAM 2: sam2.1-hiera-tiny, "
        "-small, -base-plus, -large (and sam2-hiera-* for 2.0); default sam-vit-b",
    )
    g.add_argument(
        "--random-weights",
        action="store_true",
        help="BENCHMARKING ONLY: randomly initialized weights with the --model architecture "
        "(or --checkpoint's; its weights are not used); the masks are meaningless and "
        "every output is labelled so",
    )
    add_device(g)
    add_threads(g, beside_other_work=True)
    add_recipe(g, RECIPE, DEFAULT_STEP, dtype_default="float32", dtype_help=DTYPE_HELP)
    p.set_defaults(run=_segment)


def register_bench(bench: argparse._SubParsersAction) -> None:
    b = bench.add_parser("sam", help=BENCH_SAM_HELP, description=BENCH_SAM_DESCRIPTION)
    g = b.add_argument_group("sam")
    g.add_argument(
        "--model",
        "-m",
        default="vit_b",
        help="vit_b, vit_l, vit_h, or SAM 2: sam2.1-hiera-tiny, -small, -base-plus, -large (sam2-hiera-* for 2.0), "
        "timed against Meta's sam2 package (default: vit_b)",
    )
    g.add_argument("--config", default=None, help="an architecture as JSON (SamConfig fields) instead of --model")
    g.add_argument("--batch-size", default="1,8", help="comma-separated images per batch (default: 1,8)")
    g.add_argument(
        "--automatic",
        action="store_true",
        help="time the automatic mask generator (every object, from a grid of points) against the original "
        "package's instead of one point per image; --batch-size: images per timed call",
    )
    g.add_argument(
        "--video",
        action="store_true",
        help="SAM 2: time video tracking (two objects clicked on the first frame of a synthetic clip, propagated "
        "to its end) against the official package's video predictor",
    )
    g.add_argument("--frames", type=positive_int, default=8, help="--video: frames in the clip (default 8)")
    g.add_argument("--points-per-side", type=positive_int, default=32, help="--automatic: grid size (default 32)")
    g.add_argument(
        "--points-per-batch",
        type=positive_int,
        default=64,
        help="--automatic: points decoded and filtered together (default 64)",
    )
    g.add_argument(
        "--all-masks",
        action="store_true",
        help="--automatic: quality filters off, every candidate mask kept until NMS (random weights pass few "
        "through the default filters, trained weights many)",
    )
    add_bench_args(b, "sam", repeats=3)
    b.set_defaults(run=lazy("genfast.sam.bench_command", "bench_command"))
