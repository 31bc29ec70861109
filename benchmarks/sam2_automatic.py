"""SAM 2's automatic mask generator under steps of the SAM recipe (genfast/sam/recipe.py): seconds
per image (median of --repeats, the variants interleaved in one process), speed-up against Meta's
generator (fp32 eager) and genfast's fp32 baseline, masks kept, and the mean IoU of one batch's
candidate masks against the fp32 baseline's (random weights keep few masks, so the candidates
are compared, before the filters).

    python benchmarks/sam2_automatic.py [--model sam2.1-hiera-tiny] [--variants official,baseline,bf16,compile]
                                        [--repeats 3] [--points-per-side 32] [--points-per-batch 64]
                                        [--breakdown]

--breakdown first times the parts of one batch of points (prompt encoding, the two-way
transformer, output upscaling, hypernetworks and mask product, upscaling masks to the image,
stability/boxes/runs, and the same from the low-res logits by the upsampled-mask kernel) for the
eager fp32 and bf16 decoders, and counts the decoder's FLOPs per point. Weights are random
(`build_random_sam2`): speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from genfast.bench.machine import describe_machine, machine_info
from genfast.kernels.upsampled_masks import ops as upsampled_masks
from genfast.recipe import Target
from genfast.sam.bench import bench_images
from genfast.sam.masks import column_runs, masks_to_boxes, stability_score
from genfast.sam.recipe import RECIPE, apply_recipe
from genfast.sam.sam2.build import build_random_sam2, to_official_keys

VARIANTS = ("official", "baseline", "bf16", "compile")


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_generator(variant: str, model_name: str, grid: dict[str, int]) -> object:
    """A generator over seeded random weights (the same in every variant)."""
    model = build_random_sam2(model_name)
    if variant == "official":
        from genfast.sam.sam2.official import build_official_sam2, import_sam2

        import_sam2()
        from sam2.automatic_mask_generator import SAM2AutomaticMaskGenerator as Official

        official = build_official_sam2(model.config)
        official.load_state_dict(to_official_keys(model.state_dict()))
        generator = Official(official, **grid)
        side = model.config.image_embedding_size  # its predictor assumes 1024-pixel models
        generator.predictor._bb_feat_sizes = [(4 * side, 4 * side), (2 * side, 2 * side), (side, side)]
        return generator
    from genfast.sam.sam2.automatic import SAM2AutomaticMaskGenerator

    settings = RECIPE.plan(variant, Target(torch.device("cpu"), "auto")).settings
    return SAM2AutomaticMaskGenerator(apply_recipe(model, settings), **grid)


def candidate_masks(generator: object, image: np.ndarray) -> torch.Tensor:
    """The first batch's candidate masks at the image's size (before any filter), bool."""
    predictor = generator.predictor
    predictor.set_image(image)
    size = image.shape[:2]
    points = generator.point_grids[0][: generator.points_per_batch] * torch.tensor(size[::-1], dtype=torch.float64)
    prompts = predictor.input_frame(points, size)[:, None]
    low_res, _ = generator._decode(prompts)
    return predictor.upscale_masks(low_res.flatten(0, 1)[:, None], return_logits=True)[:, 0] > 0


def mean_iou(a: torch.Tensor, b: torch.Tensor) -> float:
    inter = (a & b).flatten(1).sum(1).float()
    union = (a | b).flatten(1).sum(1).float()
    return float(torch.where(union > 0, inter / union, 1.0).mean())


def breakdown(model_name: str, dtype: torch.dtype, image: np.ndarray, batch: int, repeats: int) -> None:
    """Seconds of each part of one batch of points through the eager decoder, in `dtype`."""
    from genfast.sam.sam2.automatic import SAM2AutomaticMaskGenerator

    model = build_random_sam2(model_name).to(dtype)
    generator = SAM2AutomaticMaskGenerator(model, points_per_batch=batch)
    predictor, encoder, decoder = generator.predictor, model.sam_prompt_encoder, model.sam_mask_decoder
    parts: dict[str, float] = {"image encoder (once an image)": median_seconds(lambda: predictor.set_image(image), 1)}
    size = image.shape[:2]
    points = generator.point_grids[0][:batch] * torch.tensor(size[::-1], dtype=torch.float64)
    prompts = predictor.input_frame(points, size)[:, None]
    labels = torch.ones(batch, 1, dtype=torch.int32)
    embedding, (feat_s0, feat_s1) = predictor._features["image_embed"], predictor._features["high_res_feats"]
    image_pe = encoder.get_dense_pe()

    parts["prompt encoding"] = median_seconds(lambda: encoder((prompts, labels), None, None), repeats)
    sparse, dense = encoder((prompts, labels), None, None)
    output_tokens = torch.cat([decoder.obj_score_token.weight, decoder.iou_token.weight, decoder.mask_tokens.weight])
    tokens = torch.cat([output_tokens.expand(batch, -1, -1), sparse], dim=1)
    src = embedding + dense[:1]

    parts["two-way transformer"] = median_seconds(lambda: decoder.transformer(src, image_pe, tokens), repeats)
    hs, keys = decoder.transformer(src, image_pe, tokens)
    up1, norm, act1, up2, act2 = decoder.output_upscaling
    image_tokens = keys.transpose(1, 2).reshape(batch, *embedding.shape[1:])

    def upscale() -> torch.Tensor:
        return act2(up2(act1(norm(up1(image_tokens) + feat_s1))) + feat_s0)

    parts["output upscaling (2 ConvTranspose2d + LN, GELU)"] = median_seconds(upscale, repeats)
    parts["  of which the two ConvTranspose2d"] = median_seconds(lambda: up2(up1(image_tokens)), repeats)
    upscaled = upscale()

    def hypernetworks() -> torch.Tensor:
        mlps = decoder.output_hypernetworks_mlps
        hyper_in = torch.stack([mlp(hs[:, 2 + i]) for i, mlp in enumerate(mlps)], dim=1)
        return hyper_in @ upscaled.flatten(2)

    parts["hypernetworks + mask product"] = median_seconds(hypernetworks, repeats)
    parts["whole decoder call"] = median_seconds(lambda: generator._decode(prompts), repeats)
    low_res = generator._decode(prompts)[0].flatten(0, 1)[:, None]
    count = len(low_res)
    upscale_all = f"upscaling all {count} masks to the image (the IoU filter's survivors only)"
    parts[upscale_all] = median_seconds(lambda: predictor.upscale_masks(low_res, return_logits=True), repeats)
    logits = predictor.upscale_masks(low_res, return_logits=True)[:, 0]

    def post() -> object:
        masks = logits > 0
        return stability_score(logits, 0.0, 1.0), masks_to_boxes(masks), column_runs(masks)

    parts[f"stability, boxes, runs of all {count} masks"] = median_seconds(post, repeats)
    if upsampled_masks.takes(low_res):
        everything = torch.arange(count)

        def fused() -> object:
            return predictor.summarize_masks(low_res[:, 0], 0.0, 1.0).column_runs(everything)

        parts["  the last two from the low-res logits (upsampled-mask kernel)"] = median_seconds(fused, repeats)
    counter = FlopCounterMode(display=False)
    with counter:
        generator._decode(prompts)
    print(f"\n{dtype}: one batch of {batch} points, eager ({torch.get_num_threads()} threads)")
    print("| part | seconds (median) |\n|---|---|")
    for name, seconds in parts.items():
        print(f"| {name} | {seconds:.3f} |")
    by_op = {str(op): flops / batch / 1e9 for op, flops in counter.get_flop_counts()["Global"].items()}
    ops = ", ".join(f"{op} {gflop:.3f}" for op, gflop in by_op.items())
    print(f"decoder GFLOP per point: {counter.get_total_flops() / batch / 1e9:.3f} ({ops})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sam2.1-hiera-tiny")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="official and/or recipe steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--points-per-side", type=int, default=32)
    parser.add_argument("--points-per-batch", type=int, default=64)
    parser.add_argument("--breakdown", action="store_true", help="first time the parts of one batch (eager)")
    args = parser.parse_args()

    image = bench_images(1)[0][0]
    machine = describe_machine(machine_info("cpu"))
    print(f"{args.model}, random weights, {machine}")  # CPU, threads, ISA, torch version
    side, batch = args.points_per_side, args.points_per_batch
    print(f"image {image.shape[1]}x{image.shape[0]}, {side}x{side} points in batches of {batch}")
    with torch.inference_mode():
        if args.breakdown:
            for dtype in (torch.float32, torch.bfloat16):
                breakdown(args.model, dtype, image, args.points_per_batch, args.repeats)
        grid = {"points_per_side": args.points_per_side, "points_per_batch": args.points_per_batch}
        variants = args.variants.split(",")
        generators = {v: build_generator(v, args.model, grid) for v in variants}
        kept = {v: len(g.generate(image)) for v, g in generators.items()}  # also the warm-up (compiles)
        reference = candidate_masks(generators["baseline"], image) if "baseline" in generators else None
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.repeats):
            for variant, generator in generators.items():
                start = time.perf_counter()
                generator.generate(image)
                times[variant].append(time.perf_counter() - start)
                print(f"  {variant}: {times[variant][-1]:.2f} s", flush=True)
    seconds = {v: statistics.median(t) for v, t in times.items()}
    print("\n| variant | s per image (median) | vs official | vs genfast fp32 | masks kept | candidate IoU vs fp32 |")
    print("|---|---|---|---|---|---|")
    for variant in variants:
        official = f"{seconds['official'] / seconds[variant]:.2f}x" if "official" in seconds else ""
        baseline = f"{seconds['baseline'] / seconds[variant]:.2f}x" if "baseline" in seconds else ""
        iou = ""
        if reference is not None and variant != "official":
            with torch.inference_mode():
                iou = f"{mean_iou(candidate_masks(generators[variant], image), reference):.3f}"
        print(f"| {variant} | {seconds[variant]:.2f} | {official} | {baseline} | {kept[variant]} | {iou} |")


if __name__ == "__main__":
    main()
