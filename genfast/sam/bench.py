"""`genfast bench sam`: the recipe's ladder (genfast/sam/recipe.py) on the user's machine.

Every step at every batch size runs in a fresh interpreter (genfast/bench/ladder.py), on the same
images with one point prompt each (the image centre, one mask per prompt), timing `set_images` +
decoding: images per second is batch size / median seconds per batch. The first row, `original`,
is the original segment-anything package's predictor, fp32 eager, one image at a time: the
reference of the speed-ups and of the agreement figures (when it is installed; otherwise genfast's
baseline step stands in, and the header says so).
Agreement with the baseline, per image: mask IoU at the original resolution, and the relative
error ||logits - baseline|| / ||baseline|| of the low-res mask logits.

Weights are random (`build_random_sam`): speed does not depend on their values, and no SAM
weights need downloading. Images are scikit-image's bundled samples when it is installed, else
deterministic synthetic ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genfast.bench.ladder import COMPILE_TIME, NOTE, PEAK_MEMORY, SPEEDUP, STEP, Case, Ladder, Options, Row
from genfast.compilation.saved import compile_notes
from genfast.errors import UserError
from genfast.platform.hardware import available_memory_bytes
from genfast.recipe import Plan, Target
from genfast.sam.config import SamConfig, sam_preset
from genfast.sam.recipe import RECIPE

ORIGINAL = "original"  # the original package's predictor: a row of the ladder, not a recipe step
_SKIMAGE_SAMPLES = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "camera",
    "immunohistochemistry",
    "hubble_deep_field",
    "coins",
)


def bench_images(count: int) -> tuple[list[np.ndarray], str]:
    """`count` HxWx3 uint8 RGB images (cycling through the available ones) and where they are from."""
    try:
        from skimage import data
    except ImportError:
        data = None
    images, source = [], "synthetic (install scikit-image for real photos)"
    if data is not None:
        for name in _SKIMAGE_SAMPLES:
            try:
                image = np.asarray(getattr(data, name)())
            except (OSError, ValueError, AttributeError):  # a sample that would need a download
                continue
            if image.ndim == 2:
                image = np.repeat(image[..., None], 3, axis=2)
            images.append(np.ascontiguousarray(image[..., :3]).astype(np.uint8))
        source = f"scikit-image samples ({len(images)})"
    if not images:
        rng = np.random.default_rng(0)
        y, x = np.mgrid[0:480, 0:640]
        for i in range(4):
            base = np.stack([(x + 40 * i) % 256, (y * 2) % 256, ((x + y) // 3) % 256], axis=2)
            noise = rng.integers(0, 32, base.shape)
            images.append((base + noise).clip(0, 255).astype(np.uint8))
    return [images[i % len(images)] for i in range(count)], source


def _centre_prompt(image: np.ndarray) -> dict[str, np.ndarray]:
    h, w = image.shape[:2]
    return {"point_coords": np.array([[w / 2, h / 2]]), "point_labels": np.array([1])}


def _config(args: argparse.Namespace) -> SamConfig:
    if args.config:
        try:
            fields = json.loads(Path(args.config).read_text())
            return SamConfig(**fields)
        except (OSError, ValueError, TypeError) as e:
            raise UserError(f"cannot read SAM config {args.config}: {e}") from e
    return sam_preset(args.model)


def _run_original(config: SamConfig, model: torch.nn.Module, images: list[np.ndarray], prompts: list[dict]):
    from genfast.sam.original import import_segment_anything
    from genfast.sam.transforms import ResizeLongestSide

    original = _original_model(config, model)
    device = next(original.parameters()).device
    predictor = import_segment_anything().SamPredictor(original)
    resize = ResizeLongestSide(config.image_size)

    def run() -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for image, prompt in zip(images, prompts):
            # Its own set_image resizes through PIL (torchvision, unavailable): same pixels, given as a tensor.
            predictor.set_torch_image(
                torch.from_numpy(resize.apply_image(image)).permute(2, 0, 1)[None].to(device), image.shape[:2]
            )
            masks, _, low_res = predictor.predict(**prompt, multimask_output=False)
            out.append((masks[0], low_res[0]))
        return out

    return run


def attention_scores_bytes(step: str, config: SamConfig, batch_size: int) -> int:
    """Peak bytes of the N x N tensors a global-attention block materializes in `step`: scores,
    biased scores and probabilities with explicit softmax (fp32, bf16); the float mask and its
    copy with SDPA; nothing with the fused kernel (genfast's steps encode the whole batch at
    once; the original package one image at a time)."""
    n = config.image_embedding_size**2
    per_matrix = batch_size * config.encoder_num_heads * n * n
    return {
        "baseline": 3 * 4 * per_matrix,
        "bf16": 3 * 2 * per_matrix,
        "sdpa": 2 * 2 * per_matrix,
        ORIGINAL: 3 * 4 * per_matrix // batch_size,
    }.get(step, 0)


def mask_iou(a: np.ndarray, b: np.ndarray) -> float | None:
    """Intersection over union of two boolean masks; None when both are empty."""
    union = np.logical_or(a, b).sum()
    return float(np.logical_and(a, b).sum() / union) if union else None


def agreement(outputs: list[tuple[np.ndarray, np.ndarray]], baseline: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """Mean mask IoU (two empty masks count as equal) and worst relative error of the low-res
    logits against the baseline's."""
    ious, errors = [], []
    for (mask, logits), (base_mask, base_logits) in zip(outputs, baseline):
        iou = mask_iou(mask, base_mask)
        ious.append(1.0 if iou is None else iou)
        logits, base_logits = np.asarray(logits, np.float64), np.asarray(base_logits, np.float64)
        errors.append(float(np.linalg.norm(logits - base_logits) / max(np.linalg.norm(base_logits), 1e-12)))
    return {"mask_iou": float(np.mean(ious)), "mask_iou_min": float(np.min(ious)), "logit_rel_err": max(errors)}


def _run_genfast(model: torch.nn.Module, settings: Any, images: list[np.ndarray], prompts: list[dict]):
    from genfast.sam.predictor import SamPredictor
    from genfast.sam.recipe import apply_recipe

    apply_recipe(model, settings)
    predictor = SamPredictor(model, encoder_batch_size=len(images) if settings.compile else None)

    def run() -> list[tuple[np.ndarray, np.ndarray]]:
        predictor.set_images(images)
        if settings.batched_prompts:
            results = predictor.predict_batch(prompts, multimask_output=False, return_logits=True)
        else:
            results = [
                predictor.predict(**p, multimask_output=False, return_logits=True, image_index=i)
                for i, p in enumerate(prompts)
            ]
        return [(logits[0] > model.mask_threshold, low_res[0]) for logits, _, low_res in results]

    return run


class SamLadder(Ladder):
    workload = "sam"
    recipe = RECIPE
    speed_key = "img_s"
    reference_steps = (ORIGINAL, RECIPE.baseline)
    # fmt: off
    columns = (
        STEP, ("batch_size", "batch", "d"), ("img_s", "img/s", ".3f"), SPEEDUP, PEAK_MEMORY,
        ("mask_iou", "mask IoU", ".4f"), ("logit_rel_err", "logit rel err", ".2e"), COMPILE_TIME, NOTE,
    )
    # fmt: on

    def options(self, args: argparse.Namespace) -> Options:
        return {**self.common_options(args), "config": asdict(_config(args))}

    def common_options(self, args: argparse.Namespace) -> Options:
        """The options of every SAM ladder but the model's config."""
        try:
            batch_sizes = [int(b) for b in args.batch_size.split(",")]
        except ValueError:
            raise UserError(f"--batch-size takes comma-separated whole numbers, got {args.batch_size!r}") from None
        if any(b < 1 for b in batch_sizes):
            raise UserError(f"batch sizes must be >= 1, got {args.batch_size!r}")
        return {**Ladder.options(self, args), "batch_sizes": batch_sizes}

    # The row of the reference package, and what to say when it is not installed.
    reference_row = ORIGINAL
    missing_reference = "segment-anything is not installed (pip install segment-anything)"

    @staticmethod
    def reference_installed() -> bool:
        from genfast.sam import original

        return original.is_installed()

    def steps(self, text: str | None) -> list[str]:
        reference = self.reference_row
        names = text.split(",") if text else [reference]
        wanted = [reference] if reference in names else []
        steps = self.recipe.ordered(n for n in names if n != reference) if text else list(self.recipe.names)
        if wanted and not self.reference_installed():
            wanted = []
            print(
                f"genfast bench sam: {self.missing_reference}: genfast's baseline step is the reference",
                file=sys.stderr,
            )
        return wanted + steps

    def rows(self, steps: list[str], options: Options) -> list[Row]:
        return [Row(step, {"batch_size": b}) for b in options["batch_sizes"] for step in steps]

    def header(self, options: Options, machine: str) -> str:
        config = SamConfig(**options["config"])
        dtype = self._dtype(options)
        return (
            f"genfast bench sam: {config.name} with RANDOM weights (speed only) on {machine}; one point prompt "
            f"per image, median of {options['repeats']}; steps from bf16 on in {dtype}"
        )

    @staticmethod
    def _dtype(options: Options) -> str:
        from genfast import steps
        from genfast.platform.hardware import resolve_device

        return steps.low_precision_name(Target(resolve_device(options["device"]), options["dtype"])) or "float32"

    def model(self, options: Options) -> str:
        return f"{SamConfig(**options['config']).name} (random weights)"

    def footnote(self, options: Options, rows: list[dict[str, Any]]) -> str:
        images = next((r["images"] for r in rows if r.get("images")), "-")
        return (
            f"img/s: set_images + one point prompt per image, median of {options['repeats']}; vs baseline and the "
            f"agreement columns: against the first row of the same batch size. Images: {images}."
        )

    def skip_reason(self, row: Row, options: Options, target: Target) -> str | None:
        reason = super().skip_reason(row, options, target)
        if reason:
            return reason
        need = attention_scores_bytes(row.step, SamConfig(**options["config"]), row.group["batch_size"])
        available = available_memory_bytes(target.device) if target.device.type == "cpu" else None
        if available is not None and need > 0.95 * available:
            return (
                f"its attention scores need ~{need / 1e9:.0f} GB, {available / 1e9:.0f} GB available "
                "(use a smaller --batch-size)"
            )
        return None

    def build(self, row: Row, plan: Plan | None, options: Options, target: Target, workdir: Path) -> Case:
        config = SamConfig(**options["config"])
        images, source = bench_images(row.group["batch_size"])
        prompts = [_centre_prompt(image) for image in images]
        model = _random_sam(config, target.device)
        run = (
            _run_original(config, model, images, prompts)
            if plan is None
            else _run_genfast(model, plan.settings, images, prompts)
        )

        def measure(outputs: list, seconds: list[float]) -> dict[str, Any]:
            masks = [np.asarray(m) for m, _ in outputs[-1]]
            return {
                "img_s": row.group["batch_size"] / np.median(seconds),
                "s_per_batch": float(np.median(seconds)),
                "images": source,
                "mask_coverage": float(np.mean([m.mean() for m in masks])),
            }

        return Case(lambda: _inference(run), measure, compiled=plan is not None and plan.settings.compile,
                    notes=lambda: compile_notes(model))  # fmt: skip

    def compare(self, row: Row, output: Any, workdir: Path) -> dict[str, Any]:
        """The group's first row saves its masks and logits; the others report their agreement."""
        outputs = [(np.asarray(m), np.asarray(logits, np.float32)) for m, logits in output]
        reference = workdir / f"reference-{row.group['batch_size']}.pt"
        if not reference.exists():
            torch.save(outputs, reference)
            return {}
        return agreement(outputs, torch.load(reference, weights_only=False))


def _inference(run: Any) -> Any:
    with torch.inference_mode():
        return run()


class SamAutomaticLadder(SamLadder):
    """`genfast bench sam --automatic`: the automatic mask generator (a grid of point prompts per
    image, filtering and NMS) per recipe step, against the original package's generator."""

    # fmt: off
    columns = (
        STEP, ("batch_size", "images", "d"), ("img_s", "img/s", ".3f"), SPEEDUP, PEAK_MEMORY,
        ("masks", "masks/img", ".1f"), ("mask_iou", "mask IoU", ".4f"), COMPILE_TIME, NOTE,
    )
    # fmt: on

    def options(self, args: argparse.Namespace) -> Options:
        return {**super().options(args), **self.grid_options(args)}

    @staticmethod
    def grid_options(args: argparse.Namespace) -> Options:
        grid = {"points_per_side": args.points_per_side, "points_per_batch": args.points_per_batch}
        return {**grid, "all_masks": args.all_masks}

    def steps(self, text: str | None) -> list[str]:
        # The generator decodes its points in batches whatever the recipe says: no row of its own.
        return [step for step in super().steps(text) if text or step != "batched-prompts"]

    def header(self, options: Options, machine: str) -> str:
        config, side = SamConfig(**options["config"]), options["points_per_side"]
        filters = "filters off: every candidate mask kept until NMS" if options["all_masks"] else "default filters"
        return (
            f"genfast bench sam --automatic: {config.name} with RANDOM weights (speed only) on {machine}; "
            f"{side}x{side} points per image in batches of {options['points_per_batch']}, {filters}, median of "
            f"{options['repeats']}; steps from bf16 on in {self._dtype(options)}"
        )

    def footnote(self, options: Options, rows: list[dict[str, Any]]) -> str:
        images = next((r["images"] for r in rows if r.get("images")), "-")
        few = "" if options["all_masks"] else (
            " Random weights pass few masks through the default quality filters, so the per-mask work (NMS, "
            "encoding) is lighter than with trained weights: --all-masks turns the filters off."
        )  # fmt: skip
        return (
            f"img/s: generate() for each image in turn, median of {options['repeats']}; masks/img: the masks "
            "kept after filtering and NMS; mask IoU: each of the first row's masks matched to this row's "
            f"best-overlapping one, averaged (0 for a mask with no match). Images: {images}.{few}"
        )

    def build(self, row: Row, plan: Plan | None, options: Options, target: Target, workdir: Path) -> Case:
        config = SamConfig(**options["config"])
        images, source = bench_images(row.group["batch_size"])
        model = _random_sam(config, target.device)
        grid = {"points_per_side": options["points_per_side"], "points_per_batch": options["points_per_batch"]}
        if options["all_masks"]:
            grid |= {"pred_iou_thresh": 0.0, "stability_score_thresh": 0.0}
        if plan is None:
            generator, nms = _original_generator(config, model, grid)
        else:
            from genfast.sam.automatic import SamAutomaticMaskGenerator
            from genfast.sam.recipe import apply_recipe

            generator, nms = SamAutomaticMaskGenerator(apply_recipe(model, plan.settings), **grid), None
        compiled = plan is not None and plan.settings.compile
        nms_note = [f"{nms} NMS"] if nms else []
        return generator_case(generator, images, source, compiled, lambda: compile_notes(model) + nms_note)

    def compare(self, row: Row, output: Any, workdir: Path) -> dict[str, Any]:
        masks = [np.packbits(np.stack(image_masks), axis=-1) if image_masks else None for image_masks in output]
        reference = workdir / f"automatic-reference-{row.group['batch_size']}.pt"
        if not reference.exists():
            torch.save(masks, reference)
            return {}
        iou = matched_mask_iou(torch.load(reference, weights_only=False), masks)
        return {} if iou is None else {"mask_iou": iou}


def generator_case(
    generator: Any, images: list[np.ndarray], source: str, compiled: bool, notes: Callable[[], list[str]]
) -> Case:
    """The timed row of an automatic mask generator: generate() on each image in turn."""

    def run() -> list[list[np.ndarray]]:
        return [[record["segmentation"] for record in generator.generate(image)] for image in images]

    def measure(outputs: list, seconds: list[float]) -> dict[str, Any]:
        return {
            "img_s": len(images) / np.median(seconds),
            "images": source,
            "masks": float(np.mean([len(masks) for masks in outputs[-1]])),
        }

    return Case(lambda: _inference(run), measure, compiled=compiled, notes=notes)


def _original_model(config: SamConfig, model: torch.nn.Module) -> torch.nn.Module:
    """The original package's Sam with `model`'s weights, on `model`'s device (the rows it is
    compared with run there)."""
    from genfast.sam.original import build_original_sam

    original = build_original_sam(config).to(next(model.parameters()).device)
    original.load_state_dict(model.state_dict())
    return original


def _random_sam(config: SamConfig, device: torch.device) -> torch.nn.Module:
    from genfast.sam.build import build_random_sam

    model = build_random_sam(config).to(device)
    model.reset_pixel_stats()
    return model


def _original_generator(config: SamConfig, model: torch.nn.Module, grid: dict[str, int]) -> tuple[Any, str]:
    """The original package's automatic mask generator over `model`'s weights, and whose NMS it
    calls (torchvision's, or genfast's where torchvision does not import)."""
    from genfast.sam.original import import_segment_anything, nms_functions, use_genfast_resize

    functions, nms = nms_functions()
    segment_anything = import_segment_anything(functions)
    generator = segment_anything.SamAutomaticMaskGenerator(_original_model(config, model), **grid)
    use_genfast_resize(generator.predictor)
    return generator, nms


def matched_mask_iou(reference: list[np.ndarray | None], masks: list[np.ndarray | None]) -> float | None:
    """Per image, each reference mask's IoU with its best-overlapping mask of `masks` (0 without
    one), averaged over all reference masks (None: the reference has none); masks as bit-packed
    [N, H, W / 8] arrays (None: no mask)."""
    ious: list[np.ndarray] = []
    for ref, ours in zip(reference, masks):
        if ref is None:
            continue
        if ours is None:
            ious.append(np.zeros(len(ref)))
            continue
        a = torch.from_numpy(np.unpackbits(ref, axis=-1).reshape(len(ref), -1)).float()
        b = torch.from_numpy(np.unpackbits(ours, axis=-1).reshape(len(ours), -1)).float()
        inter = a @ b.T
        union = a.sum(1, keepdim=True) + b.sum(1) - inter
        ious.append((inter / union.clamp(min=1)).max(1).values.numpy())
    return float(np.concatenate(ious).mean()) if ious else None


def config_json(config: SamConfig) -> str:
    """A config as the JSON `--config` reads."""
    return json.dumps(asdict(config))
