"""SAM 2's image predictor under each step of the SAM recipe (genfast/sam/recipe.py): seconds per
`set_image` of one 640x480 image (the image encoder, nearly all of it), then of one point prompt
(`predict`); median and fastest of --repeats calls after a warm-up; speed-ups against genfast's fp32
baseline and, with --official, against Meta's sam2 package in fp32 eager (same weights, the same
image and point), with each row's mask IoU against the official mask.

    python benchmarks/sam2_encoder.py [--model sam2.1-hiera-tiny] [--steps baseline,bf16,...]
                                      [--official] [--repeats 5]

Weights are random (`build_random_sam2`): speed does not depend on their values. Each step builds
its own model. The compile step's first call compiles the encoder (or loads it from GENFAST_HOME):
that is the warm-up, not timed. The fastest call is the one to compare when other processes share
the CPU (the header gives the load average before and after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from genfast.bench.machine import describe_machine, machine_info
from genfast.errors import UserError
from genfast.recipe import Target
from genfast.sam.recipe import RECIPE, apply_recipe
from genfast.sam.sam2.build import build_random_sam2, to_official_keys
from genfast.sam.sam2.predictor import SAM2ImagePredictor

STEPS = ("baseline", "bf16", "sdpa", "fused-attention", "compile", "dynamic-int8")
COLUMNS = ("step", "set_image s (median)", "fastest", "predict s", "speed-up vs baseline", "vs official",
           "mask IoU vs official")  # fmt: skip
POINT = {"point_coords": np.array([[320.0, 240.0]]), "point_labels": np.array([1]), "multimask_output": False}


def timed(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, fastest) seconds of `repeats` calls after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return float(np.logical_and(a, b).sum() / union) if union else 1.0


def official_predictor(model: torch.nn.Module) -> object:
    """Meta's image predictor over the official model with `model`'s weights (fp32)."""
    from genfast.sam.sam2.official import build_official_sam2, import_sam2

    import_sam2()
    from sam2.sam2_image_predictor import SAM2ImagePredictor as Official

    official = build_official_sam2(model.config)
    official.load_state_dict(to_official_keys(model.state_dict()))
    return Official(official)


def measure(predictor: object, image: np.ndarray, repeats: int) -> tuple[float, float, float, np.ndarray]:
    """set_image (median, fastest), predict (median) seconds, and the mask of the point prompt."""
    with torch.inference_mode():
        encode, fastest = timed(lambda: predictor.set_image(image), repeats)
        decode, _ = timed(lambda: predictor.predict(**POINT), repeats)
        masks = predictor.predict(**POINT)[0][0]
    return encode, fastest, decode, np.asarray(masks) > 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sam2.1-hiera-tiny")
    parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated recipe steps")
    parser.add_argument("--official", action="store_true", help="add Meta's package (fp32 eager) as a row")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    image = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    target = Target(torch.device("cpu"), "auto")
    print(f"{args.model}, random weights, one 640x480 image; {describe_machine(machine_info('cpu'))}")
    print(f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f} before the run\n")
    row(*COLUMNS)
    row(*["---"] * len(COLUMNS))
    reference = official_seconds = baseline_seconds = None
    if args.official:
        official = official_predictor(build_random_sam2(args.model))
        encode, fastest, decode, reference = measure(official, image, args.repeats)
        official_seconds = encode + decode
        row("official fp32 eager", f"{encode:.3f}", f"{fastest:.3f}", f"{decode:.3f}", "", "1.00x", "1.000")
    for step in args.steps.split(","):
        try:
            settings = RECIPE.plan(step, target).settings
        except UserError as e:  # e.g. bf16 without native bf16 arithmetic: the later steps run in fp32
            row(step, f"skipped: {e}", *[""] * (len(COLUMNS) - 2))
            continue
        model = apply_recipe(build_random_sam2(args.model), settings)
        encode, fastest, decode, masks = measure(SAM2ImagePredictor(model), image, args.repeats)
        baseline_seconds = baseline_seconds or encode
        versus = f"{official_seconds / (encode + decode):.2f}x" if official_seconds else ""
        iou = f"{mask_iou(masks, reference):.3f}" if reference is not None else ""
        speedup = f"{baseline_seconds / encode:.2f}x"
        row(step, f"{encode:.3f}", f"{fastest:.3f}", f"{decode:.3f}", speedup, versus, iou)
    print(f"\nload average {os.getloadavg()[0]:.2f} after the run; 'vs official' compares set_image + predict")


def row(*cells: str) -> None:
    print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
