"""`genfast bench sam --model sam2.1-hiera-*`: SAM 2's rows of the segment ladder (genfast/sam/recipe.py).

Three kinds of row, each a table of its own (`kind` in the JSON rows):
- image: SAM2ImagePredictor, set_image + one point prompt (the image centre, one mask) per image;
- automatic (--automatic): SAM2AutomaticMaskGenerator on each image;
- video (--video): SAM2VideoPredictor, two objects clicked on the first frame, propagated through
  the clip; frames per second, and the peak memory over the clip.
The first row, `official`, is Meta's sam2 package, fp32 eager, on the same weights and inputs: the
reference of the speed-ups and of mask IoU (genfast's fp32 baseline step stands in when it is not
installed, and the header says so). Weights are random at the real architecture (speed does not
depend on their values); every row runs in a fresh process (genfast/bench/ladder.py).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genfast.bench.ladder import COMPILE_TIME, NOTE, PEAK_MEMORY, SPEEDUP, STEP, Case, Options, Row
from genfast.compilation.saved import compile_notes
from genfast.errors import UserError
from genfast.recipe import Plan, Target
from genfast.sam.bench import SamAutomaticLadder, SamLadder, _inference, bench_images, generator_case, mask_iou
from genfast.sam.sam2.config import Sam2Config
from genfast.sam.sam2.modeling.model import Sam2

OFFICIAL = "official"  # Meta's sam2 package: a row of the ladder, not a recipe step


def _official_model(model: Sam2, video: bool = False) -> torch.nn.Module:
    """The official package's model with `model`'s weights, fp32, on its device."""
    from genfast.sam.sam2.build import to_official_keys
    from genfast.sam.sam2.official import build_official_sam2

    official = build_official_sam2(model.config, video=video).to(model.device)
    official.load_state_dict(to_official_keys(model.state_dict()))
    return official


def _random_sam2(config: Sam2Config, device: torch.device) -> Sam2:
    from genfast.sam.sam2.build import build_random_sam2

    return build_random_sam2(config).to(device)


class Sam2Ladder(SamLadder):
    """Image rows: set_image (set_image_batch for batches) + one point prompt per image."""

    kind = "image"
    reference_steps = (OFFICIAL, SamLadder.recipe.baseline)

    def options(self, args: argparse.Namespace) -> Options:
        config = sam2_config(args)
        assert config is not None  # bench_command sends only SAM 2 models here
        return {**self.common_options(args), "config": asdict(config)}

    @staticmethod
    def config(options: Options) -> Sam2Config:
        return Sam2Config(**options["config"])

    reference_row = OFFICIAL
    missing_reference = "the official sam2 package is not installed (scripts/setup.sh bench installs it)"

    @staticmethod
    def reference_installed() -> bool:
        from genfast.sam.sam2 import official

        return official.is_installed()

    def header(self, options: Options, machine: str) -> str:
        return (
            f"genfast bench sam: {self.config(options).name} ({self.kind}) with RANDOM weights (speed only) on "
            f"{machine}; one point prompt per image, median of {options['repeats']}; steps from bf16 on in "
            f"{self._dtype(options)}"
        )

    def model(self, options: Options) -> str:
        return f"{self.config(options).name} (random weights)"

    def tags(self) -> dict[str, Any]:
        return {**super().tags(), "kind": self.kind}

    def skip_reason(self, row: Row, options: Options, target: Target) -> str | None:
        # The recipe's rule only: no SAM-1 attention-score estimate applies.
        return self.recipe.unavailable(row.step, target) if row.step in self.recipe.names else None

    def footnote(self, options: Options, rows: list[dict[str, Any]]) -> str:
        images = next((r["images"] for r in rows if r.get("images")), "-")
        return (
            f"img/s: set_image + one point prompt per image, median of {options['repeats']}; vs baseline and the "
            f"agreement columns: against the first row of the same batch size (official: Meta's sam2 package, "
            f"fp32 eager). Images: {images}."
        )

    def build(self, row: Row, plan: Plan | None, options: Options, target: Target, workdir: Path) -> Case:
        from genfast.sam.bench import _centre_prompt

        images, source = bench_images(row.group["batch_size"])
        prompts = [_centre_prompt(image) for image in images]
        model = _random_sam2(self.config(options), target.device)
        run = (
            _run_official(model, images, prompts)
            if plan is None
            else _run_genfast(model, plan.settings, images, prompts)
        )

        def measure(outputs: list, seconds: list[float]) -> dict[str, Any]:
            return {
                "img_s": row.group["batch_size"] / np.median(seconds),
                "s_per_batch": float(np.median(seconds)),
                "images": source,
            }

        compiled = plan is not None and plan.settings.compile
        return Case(lambda: _inference(run), measure, compiled=compiled, notes=lambda: compile_notes(model))


def _run_official(model: Sam2, images: list[np.ndarray], prompts: list[dict]):
    from genfast.sam.sam2.official import import_sam2

    import_sam2()
    from sam2.sam2_image_predictor import SAM2ImagePredictor as OfficialPredictor

    predictor = OfficialPredictor(_official_model(model))
    grid = model.config.image_embedding_size  # it assumes 1024-pixel models (64x64 embeddings)
    predictor._bb_feat_sizes = [(4 * grid, 4 * grid), (2 * grid, 2 * grid), (grid, grid)]

    def run() -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for image, prompt in zip(images, prompts):
            predictor.set_image(image)
            masks, _, low_res = predictor.predict(**prompt, multimask_output=False, return_logits=True)
            out.append((masks[0] > 0, low_res[0]))
        return out

    return run


def _run_genfast(model: Sam2, settings: Any, images: list[np.ndarray], prompts: list[dict]):
    from genfast.sam.recipe import apply_recipe
    from genfast.sam.sam2.predictor import SAM2ImagePredictor

    predictor = SAM2ImagePredictor(apply_recipe(model, settings))

    def run() -> list[tuple[np.ndarray, np.ndarray]]:
        if settings.batched_prompts or len(images) > 1:
            predictor.set_image_batch(images)
            masks, _, low_res = predictor.predict_batch(
                [p["point_coords"] for p in prompts],
                [p["point_labels"] for p in prompts],
                multimask_output=False,
                return_logits=True,
            )
            return [(m[0] > 0, lr[0]) for m, lr in zip(masks, low_res)]
        predictor.set_image(images[0])
        masks, _, low_res = predictor.predict(**prompts[0], multimask_output=False, return_logits=True)
        return [(masks[0] > 0, low_res[0])]

    return run


class Sam2AutomaticLadder(Sam2Ladder, SamAutomaticLadder):
    """Automatic rows: SAM2AutomaticMaskGenerator per image against the official generator."""

    kind = "automatic"
    columns = SamAutomaticLadder.columns

    def options(self, args: argparse.Namespace) -> Options:
        return {**Sam2Ladder.options(self, args), **self.grid_options(args)}

    def steps(self, text: str | None) -> list[str]:
        return [s for s in Sam2Ladder.steps(self, text) if text or s != "batched-prompts"]

    def header(self, options: Options, machine: str) -> str:
        side = options["points_per_side"]
        filters = "filters off: every candidate mask kept until NMS" if options["all_masks"] else "default filters"
        return (
            f"genfast bench sam --automatic: {self.config(options).name} with RANDOM weights (speed only) on "
            f"{machine}; {side}x{side} points per image in batches of {options['points_per_batch']}, {filters}, "
            f"median of {options['repeats']}; steps from bf16 on in {self._dtype(options)}"
        )

    footnote = SamAutomaticLadder.footnote
    compare = SamAutomaticLadder.compare

    def build(self, row: Row, plan: Plan | None, options: Options, target: Target, workdir: Path) -> Case:
        images, source = bench_images(row.group["batch_size"])
        model = _random_sam2(self.config(options), target.device)
        grid = {"points_per_side": options["points_per_side"], "points_per_batch": options["points_per_batch"]}
        if options["all_masks"]:
            grid |= {"pred_iou_thresh": 0.0, "stability_score_thresh": 0.0}
        if plan is None:
            from genfast.sam.sam2.official import import_sam2

            import_sam2()
            from sam2.automatic_mask_generator import SAM2AutomaticMaskGenerator as Official

            generator = Official(_official_model(model), **grid)
            side = model.config.image_embedding_size  # its predictor assumes 1024-pixel models
            generator.predictor._bb_feat_sizes = [(4 * side, 4 * side), (2 * side, 2 * side), (side, side)]
        else:
            from genfast.sam.recipe import apply_recipe
            from genfast.sam.sam2.automatic import SAM2AutomaticMaskGenerator

            generator = SAM2AutomaticMaskGenerator(apply_recipe(model, plan.settings), **grid)
        compiled = plan is not None and plan.settings.compile
        return generator_case(generator, images, source, compiled, lambda: compile_notes(model))


def sam2_config(args: argparse.Namespace) -> Sam2Config | None:
    """The SAM 2 architecture --model names (a preset) or --config holds (Sam2Config fields as
    JSON); None for a SAM (1) model."""
    from genfast.sam.sam2.config import SAM2_PRESETS

    if args.config:
        try:
            fields = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read config {args.config}: {e}") from e
        if not isinstance(fields, dict) or "stages" not in fields:
            return None
        try:
            return Sam2Config(**fields)
        except TypeError as e:
            raise UserError(f"{args.config} is not a SAM 2 config: {e}") from e
    return SAM2_PRESETS.get(args.model)


def sam2_ladder(args: argparse.Namespace) -> SamLadder:
    if args.video:
        if args.automatic:
            raise UserError("--video and --automatic are different ladders: give one")
        return Sam2VideoLadder()
    return Sam2AutomaticLadder() if args.automatic else Sam2Ladder()


# ---- video ---------------------------------------------------------------------------------------

VIDEO_SIZE = (480, 640)  # (H, W) of the synthetic clip
# The two objects clicked on the first frame: (x, y) as fractions of the frame.
VIDEO_CLICKS = ((0.3, 0.35), (0.7, 0.65))


def bench_video(folder: Path, frames: int) -> Path:
    """A synthetic clip of `frames` JPEG frames (two coloured shapes moving over a textured
    background), written once per run: official and genfast rows read the same files."""
    from PIL import Image

    if folder.is_dir() and len(list(folder.glob("*.jpg"))) == frames:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    h, w = VIDEO_SIZE
    y, x = np.mgrid[0:h, 0:w]
    for i in range(frames):
        frame = np.stack([(x // 8 + i) % 256, (y // 6) % 256, ((x + y) // 10) % 256], axis=2).astype(np.uint8) // 2
        cx, cy = int(w * 0.3) + 6 * i, int(h * 0.35)
        frame[max(cy - 60, 0) : cy + 60, max(cx - 80, 0) : cx + 80] = (220, 60, 60)
        cx, cy = int(w * 0.7) - 5 * i, int(h * 0.65)
        frame[max(cy - 50, 0) : cy + 50, max(cx - 50, 0) : cx + 50] = (60, 200, 90)
        Image.fromarray(frame).save(folder / f"{i:05d}.jpg", quality=92)
    return folder


def objects_always_present(model: Sam2) -> None:
    """Set the object-score head to answer "present" on every frame. With random weights it may
    score the clicked objects absent throughout (Hiera-small's did): every mask is then the
    no-object fill in every row, which compares nothing. Both packages get these weights; the
    work per frame is the same either way."""
    last = model.sam_mask_decoder.pred_obj_score_head.layers[-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.fill_(10.0)


def _resident_bytes() -> int:
    """The process's resident set now (Linux), else 0."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096
    except (OSError, ValueError, IndexError):
        return 0


# One propagated frame: every object's mask (bits packed along the width) and its logits at every 4th pixel.
VideoFrame = tuple[np.ndarray, np.ndarray]


def masks_found(frames: list[VideoFrame]) -> float:
    """The share of frames x objects whose mask is not empty."""
    found = [bool(packed[k].any()) for packed, _ in frames for k in range(len(packed))]
    return float(np.mean(found)) if found else 0.0


def video_agreement(frames: list[VideoFrame], reference: list[VideoFrame]) -> dict[str, Any]:
    """Mask IoU per frame and object, averaged over the pairs where either found a mask (two empty
    masks agree on nothing: left out, and no IoU at all when every pair is empty), and the relative
    error of the logits over the whole clip."""
    ious, diff, norm = [], 0.0, 0.0
    for (packed, logits), (ref_packed, ref_logits) in zip(frames, reference):
        a, b = np.unpackbits(packed, axis=-1).astype(bool), np.unpackbits(ref_packed, axis=-1).astype(bool)
        ious += [iou for k in range(len(a)) if (iou := mask_iou(a[k], b[k])) is not None]
        logits, ref_logits = np.asarray(logits, np.float64), np.asarray(ref_logits, np.float64)
        diff += float(np.square(logits - ref_logits).sum())
        norm += float(np.square(ref_logits).sum())
    result: dict[str, Any] = {"logit_rel_err": (diff / max(norm, 1e-24)) ** 0.5} if reference else {}
    return {**result, "mask_iou": float(np.mean(ious))} if ious else result


class Sam2VideoLadder(Sam2Ladder):
    """Video rows: two objects clicked on the first frame of a synthetic clip, propagated to its end."""

    kind = "video"
    speed_key = "frames_s"
    # fmt: off
    columns = (
        STEP, ("frames", "frames", "d"), ("frames_s", "frames/s", ".3f"), SPEEDUP, PEAK_MEMORY,
        ("mem_growth_mb_per_frame", "MB/frame", ".1f"), ("masks_found", "masks found", ".0%"),
        ("mask_iou", "mask IoU", ".4f"), ("logit_rel_err", "logit rel err", ".1e"), COMPILE_TIME, NOTE,
    )
    # fmt: on

    def options(self, args: argparse.Namespace) -> Options:
        if args.frames < 2:
            raise UserError(f"--frames must be >= 2, got {args.frames}")
        return {**Sam2Ladder.options(self, args), "frames": args.frames}

    def rows(self, steps: list[str], options: Options) -> list[Row]:
        return [Row(step, {"frames": options["frames"]}) for step in steps]

    def steps(self, text: str | None) -> list[str]:
        return [s for s in Sam2Ladder.steps(self, text) if text or s != "batched-prompts"]

    def header(self, options: Options, machine: str) -> str:
        h, w = VIDEO_SIZE
        return (
            f"genfast bench sam --video: {self.config(options).name} with RANDOM weights (speed only) on {machine}; "
            f"two objects clicked on frame 0 of a {options['frames']}-frame {w}x{h} clip, propagated to its end, "
            f"median of {options['repeats']}; steps from bf16 on in {self._dtype(options)}"
        )

    def footnote(self, options: Options, rows: list[dict[str, Any]]) -> str:
        return (
            "frames/s: init_state + the clicks + propagation, frames / median seconds; MB/frame: how much the "
            "resident memory grew per frame over the second half of the clip (the official package decodes "
            "every frame up front and keeps every frame's memory; genfast streams frames and keeps what the "
            "tracker can still read); masks found: the share of frames x objects with a non-empty mask (the "
            "random weights' object scores are set to 'present'); mask IoU: per frame and object against the "
            "first row, averaged over the pairs where either row found a mask ('-' where neither did); logit rel "
            "err: of the mask logits over the clip, against the first row's."
        )

    def build(self, row: Row, plan: Plan | None, options: Options, target: Target, workdir: Path) -> Case:
        frames = options["frames"]
        folder = bench_video(workdir / f"clip-{frames}", frames)
        model = _random_sam2(self.config(options), target.device)
        objects_always_present(model)
        h, w = VIDEO_SIZE
        clicks = [np.array([[fx * w, fy * h]], dtype=np.float32) for fx, fy in VIDEO_CLICKS]
        if plan is None:
            from genfast.sam.sam2.official import import_sam2

            import_sam2()
            predictor = _official_model(model, video=True)
        else:
            from genfast.sam.recipe import apply_recipe
            from genfast.sam.sam2.video import SAM2VideoPredictor

            # No hole filling, as the official package's CPU build (it needs its CUDA extension):
            # the rows compute the same thing.
            predictor = SAM2VideoPredictor(apply_recipe(model, plan.settings), fill_hole_area=0)
        growth: list[float] = []

        def run() -> list[VideoFrame]:
            state = predictor.init_state(str(folder))
            for obj, click in enumerate(clicks, start=1):
                predictor.add_new_points_or_box(state, 0, obj, points=click, labels=np.array([1], np.int32))
            out, resident = [], []
            for _, _, logits in predictor.propagate_in_video(state):
                logits = logits[:, 0].float()
                # Every 4th pixel's logit each way is enough for a relative error, and keeps a long clip small.
                out.append((np.packbits((logits > 0).cpu().numpy(), axis=-1), logits[:, ::4, ::4].half().cpu().numpy()))
                resident.append(_resident_bytes())
            half = len(resident) // 2
            growth.append((resident[-1] - resident[half]) / max(len(resident) - 1 - half, 1) / 1e6)
            return out

        def measure(outputs: list, seconds: list[float]) -> dict[str, Any]:
            return {
                "frames_s": frames / np.median(seconds),
                "s_per_frame": float(np.median(seconds)) / frames,
                "mem_growth_mb_per_frame": float(np.median(growth)),
                "masks_found": masks_found(outputs[-1]),
            }

        compiled = plan is not None and plan.settings.compile
        return Case(lambda: _inference(run), measure, compiled=compiled, notes=lambda: compile_notes(model))

    def compare(self, row: Row, output: Any, workdir: Path) -> dict[str, Any]:
        reference = workdir / f"video-reference-{row.group['frames']}.pt"
        if not reference.exists():
            torch.save(output, reference)
            return {}
        return video_agreement(output, torch.load(reference, weights_only=False))
