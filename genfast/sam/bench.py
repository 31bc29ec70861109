"""`genfast bench sam`: the recipe's ladder (genfast/sam/recipe.py) on the user's machine.

Every step at every batch size runs in a fresh interpreter (honest peak memory, no compile state
shared), on the same images with one point prompt each (the image centre, one mask per prompt),
timing `set_images` + decoding: images per second is batch size / median seconds per batch.
The baseline is the original segment-anything package's predictor, fp32 eager, one image at a
time (when it is installed; otherwise genfast's fp32 step stands in, and the table says so).
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
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genfast.bench.isolated import run_row
from genfast.bench.machine import describe_machine, machine_info
from genfast.bench.table import check_writable, median, report, write_json_atomic
from genfast.errors import UserError
from genfast.hardware import peak_memory_bytes
from genfast.sam.config import SamConfig, sam_preset

BASELINE = "original-fp32"
STEPS = (BASELINE, "fp32", "bf16", "sdpa", "fused-attention", "compile", "batched-prompts", "dynamic-int8",
         "sparse-2:4")
COLUMNS = [
    ("step", "step", ""), ("batch_size", "batch", "d"), ("img_s", "img/s", ".3f"), ("speedup", "vs baseline", ".2f"),
    ("peak_mem_gb", "peak mem GB", ".2f"), ("mask_iou", "mask IoU", ".4f"), ("logit_rel_err", "logit rel err", ".2e"),
    ("compile_s", "compile s", ".0f"), ("note", "note", ""),
]
_SKIMAGE_SAMPLES = ("astronaut", "coffee", "chelsea", "rocket", "camera", "immunohistochemistry", "hubble_deep_field",
                    "coins")


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
    from genfast.sam.original import build_original_sam, import_segment_anything
    from genfast.sam.transforms import ResizeLongestSide

    original = build_original_sam(config)
    original.load_state_dict(model.state_dict())
    predictor = import_segment_anything().SamPredictor(original)
    resize = ResizeLongestSide(config.image_size)

    def run() -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for image, prompt in zip(images, prompts):
            # Its own set_image resizes through PIL (torchvision, unavailable): same pixels, given as a tensor.
            predictor.set_torch_image(torch.from_numpy(resize.apply_image(image)).permute(2, 0, 1)[None],
                                      image.shape[:2])
            masks, _, low_res = predictor.predict(**prompt, multimask_output=False)
            out.append((masks[0], low_res[0]))
        return out

    return run


def _run_genfast(config: SamConfig, model, step: str, low_precision: torch.dtype | None, images: list[np.ndarray],
                 prompts: list[dict]):
    from genfast.sam.predictor import SamPredictor
    from genfast.sam.recipe import apply_recipe, recipe_for_step

    recipe = recipe_for_step(step, low_precision)
    apply_recipe(model, recipe)
    predictor = SamPredictor(model, encoder_batch_size=len(images) if recipe.compile else None)

    def run() -> list[tuple[np.ndarray, np.ndarray]]:
        predictor.set_images(images)
        if recipe.batched_prompts:
            results = predictor.predict_batch(prompts, multimask_output=False, return_logits=True)
        else:
            results = [predictor.predict(**p, multimask_output=False, return_logits=True, image_index=i)
                       for i, p in enumerate(prompts)]
        return [(logits[0] > model.mask_threshold, low_res[0]) for logits, _, low_res in results]

    return run


def _step_note(step: str, device: torch.device, low_precision: torch.dtype | None) -> str | None:
    """Why a step is skipped (prefixed 'skipped:') or runs a fallback here; None if it runs as named."""
    from genfast.hardware import low_precision_note
    from genfast.quant import packing as quant_kernels
    from genfast.sam import fused_attention as sam_kernels
    from genfast.sam.recipe import sparse_2_4_unavailable

    if step == "bf16" and low_precision is None:
        return f"skipped: {low_precision_note(device)}"
    if step == "sparse-2:4" and (reason := sparse_2_4_unavailable(device)):
        return f"skipped: {reason}"
    if step == "fused-attention" and device.type == "cpu" and (reason := sam_kernels.unavailable_reason()):
        return f"fused kernel unavailable ({reason}): SDPA"
    dtype = low_precision or torch.float32
    if step == "fused-attention" and device.type == "cpu" and not sam_kernels.takes(dtype):
        return f"the {sam_kernels.loaded_isa()} kernel takes no {str(dtype).removeprefix('torch.')}: SDPA"
    if step == "fused-attention" and device.type != "cpu":
        return "no fused kernel for this device yet: SDPA"
    if step == "dynamic-int8" and device.type == "cpu" and (reason := quant_kernels.unavailable_reason()):
        return f"native int8 kernel unavailable ({reason}): dequantize fallback"
    return None


def attention_scores_bytes(step: str, config: SamConfig, batch_size: int) -> int:
    """Peak bytes of the N x N tensors a global-attention block materializes in `step`: scores,
    biased scores and probabilities with explicit softmax (fp32, bf16); the float mask and its
    copy with SDPA; nothing with the fused kernel (genfast's steps encode the whole batch at
    once; the original package one image at a time)."""
    n = config.image_embedding_size ** 2
    per_matrix = batch_size * config.encoder_num_heads * n * n
    return {"fp32": 3 * 4 * per_matrix, "bf16": 3 * 2 * per_matrix, "sdpa": 2 * 2 * per_matrix,
            BASELINE: 3 * 4 * per_matrix // batch_size}.get(step, 0)


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def agreement(outputs: list[tuple[np.ndarray, np.ndarray]], baseline: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """Mean mask IoU and worst relative error of the low-res logits against the baseline's."""
    ious, errors = [], []
    for (mask, logits), (base_mask, base_logits) in zip(outputs, baseline):
        union = np.logical_or(mask, base_mask).sum()
        ious.append(1.0 if union == 0 else float(np.logical_and(mask, base_mask).sum() / union))
        logits, base_logits = np.asarray(logits, np.float64), np.asarray(base_logits, np.float64)
        errors.append(float(np.linalg.norm(logits - base_logits) / max(np.linalg.norm(base_logits), 1e-12)))
    return {"mask_iou": float(np.mean(ious)), "mask_iou_min": float(np.min(ious)), "logit_rel_err": max(errors)}


def run_step(step: str, config: SamConfig, batch_size: int, repeats: int, device: torch.device,
             baseline_file: Path, low_precision: torch.dtype | None = torch.bfloat16) -> dict[str, Any]:
    """One row of the ladder, in this process. The baseline step saves its outputs to
    baseline_file; the others compare against them."""
    from genfast.sam.build import build_random_sam

    row: dict[str, Any] = {"step": step, "batch_size": batch_size, "note": _step_note(step, device, low_precision)}
    need, available = attention_scores_bytes(step, config, batch_size), available_memory_bytes()
    if device.type == "cpu" and available is not None and need > 0.95 * available:
        row["note"] = (f"skipped: its attention scores need ~{need / 1e9:.0f} GB, "
                       f"{available / 1e9:.0f} GB available (use a smaller --batch-size)")
    if row["note"] and row["note"].startswith("skipped"):
        return row
    images, source = bench_images(batch_size)
    prompts = [_centre_prompt(image) for image in images]
    model = build_random_sam(config).to(device)
    model.reset_pixel_stats()
    with torch.inference_mode():
        run = (_run_original(config, model, images, prompts) if step == BASELINE
               else _run_genfast(config, model, step, low_precision, images, prompts))
        start = time.perf_counter()
        outputs = run()  # warm-up (and compilation)
        first_s = time.perf_counter() - start
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            outputs = run()
            times.append(time.perf_counter() - start)
    outputs = [(np.asarray(m), np.asarray(logits, np.float32)) for m, logits in outputs]
    seconds = median(times)
    row.update({"img_s": batch_size / seconds, "s_per_batch": seconds, "peak_mem_gb": peak_memory_bytes(device) / 1e9,
                "images": source, "mask_coverage": float(np.mean([m.mean() for m, _ in outputs]))})
    if "compile" in step or step in ("batched-prompts", "dynamic-int8", "sparse-2:4"):
        row["compile_s"] = max(first_s - seconds, 0.0)
    if step == BASELINE or not baseline_file.exists():
        torch.save(outputs, baseline_file)
    if step != BASELINE:
        row.update(agreement(outputs, torch.load(baseline_file, weights_only=False)))
    return row


def bench_command(args: argparse.Namespace) -> int:
    from genfast.hardware import low_precision_dtype, resolve_device

    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = _config(args)
    low_precision = low_precision_dtype(args.dtype, device)
    if args.one_step:
        row = run_step(args.one_step, config, int(args.batch_size), args.repeats, device, Path(args.baseline_file),
                       low_precision)
        write_json_atomic(args.json_path, row)
        return 0
    if args.json_path:
        check_writable(args.json_path, args.force)
    try:
        batch_sizes = [int(b) for b in args.batch_size.split(",")]
    except ValueError:
        raise UserError(f"--batch-size takes comma-separated whole numbers, got {args.batch_size!r}") from None
    if any(b < 1 for b in batch_sizes):
        raise UserError(f"batch sizes must be >= 1, got {args.batch_size!r}")
    steps = args.steps.split(",") if args.steps else list(STEPS)
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        raise UserError(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(STEPS)}")
    from genfast.sam import original

    if BASELINE in steps and not original.is_installed():
        steps.remove(BASELINE)
        print("genfast bench sam: segment-anything is not installed (pip install segment-anything): "
              "genfast's fp32 step is the baseline", file=sys.stderr)
    steps.sort(key=STEPS.index)
    info = machine_info(device)
    print(f"genfast bench sam: {config.name} with RANDOM weights (speed only) on {describe_machine(info)}; "
          f"one point prompt per image, median of {args.repeats}; steps from bf16 on in "
          f"{str(low_precision or torch.float32).removeprefix('torch.')}", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory(prefix="genfast-bench-sam-") as tmp:
        for batch_size in batch_sizes:
            baseline_file = Path(tmp) / f"baseline-{batch_size}.pt"
            for step in steps:
                print(f"  {step}, batch {batch_size} ...", file=sys.stderr, flush=True)
                rows.append(_run_isolated(step, batch_size, args, baseline_file))
    for row in rows:
        base = next((r for r in rows if r["batch_size"] == row["batch_size"] and r.get("img_s")), None)
        if base is not None and row.get("img_s"):
            row["speedup"] = row["img_s"] / base["img_s"]
    report(rows, COLUMNS, info, f"{config.name} (random weights)",
           f"img/s: set_images + one point prompt per image, median of {args.repeats}; vs baseline: the first "
           f"row of the same batch size. Images: {rows[0].get('images', '-')}.", args.json_path)
    return 0


def _run_isolated(step: str, batch_size: int, args: argparse.Namespace, baseline_file: Path) -> dict:
    argv = ["bench", "sam", "--one-step", step, "--batch-size", str(batch_size), "--device", args.device,
            "--dtype", args.dtype, "--repeats", str(args.repeats), "--baseline-file", str(baseline_file)]
    argv += ["--config", args.config] if args.config else ["--model", args.model]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    return run_row(argv, f"step {step} (batch {batch_size})")


def config_json(config: SamConfig) -> str:
    """A config as the JSON `--config` reads."""
    return json.dumps(asdict(config))
