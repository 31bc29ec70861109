"""The automatic mask generator's fast decoding (tiny config, random weights): one image shared
by a batch of prompts gives what an image per prompt gives, and the recipe's compile step, whose
generator decodes through one compiled module (bf16, padded batches), stays within bf16's budget
(mask-logit error <= 5% of the logit range, mask IoU >= 0.95) of the fp32 baseline."""

from __future__ import annotations

import numpy as np
import torch

from genfast.recipe import Target
from genfast.sam.recipe import RECIPE, apply_recipe
from genfast.sam.sam2.automatic import SAM2AutomaticMaskGenerator
from genfast.sam.sam2.build import build_random_sam2
from genfast.sam.sam2.config import tiny_sam2_config
from tests.sam.test_automatic import _image


def _candidates(generator: SAM2AutomaticMaskGenerator, image: np.ndarray, count: int) -> tuple[torch.Tensor, ...]:
    """Low-res logits and IoUs of the first `count` grid points, decoded as one batch."""
    predictor = generator.predictor
    predictor.set_image(image)
    size = image.shape[:2]
    points = generator.point_grids[0][:count] * torch.tensor(size[::-1], dtype=torch.float64)
    prompts = predictor.input_frame(points, size)[:, None]
    return generator._decode(prompts, torch.ones(count, 1, dtype=torch.int32))


def test_one_image_for_all_prompts_matches_an_image_per_prompt() -> None:
    model = build_random_sam2(tiny_sam2_config(), seed=1).eval()
    decoder, prompt_encoder = model.sam_mask_decoder, model.sam_prompt_encoder
    rng = torch.Generator().manual_seed(0)  # the global one is left alone: other tests' models draw from it
    image = torch.randn(1, 32, 8, 8, generator=rng)  # d_model 32, an 8x8 embedding
    feat_s0, feat_s1 = torch.randn(1, 4, 32, 32, generator=rng), torch.randn(1, 8, 16, 16, generator=rng)
    coords = torch.rand(5, 1, 2, generator=rng) * model.image_size
    sparse, dense = prompt_encoder((coords, torch.ones(5, 1, dtype=torch.int32)), None, None)
    assert dense.stride(0) == 0  # the "no mask" embedding, expanded: the shared path
    with torch.no_grad():
        shared = decoder(image, prompt_encoder.get_dense_pe(), sparse, dense, True, (feat_s0, feat_s1))
        each = decoder(
            image.expand(5, -1, -1, -1).contiguous(),
            prompt_encoder.get_dense_pe(),
            sparse,
            dense.contiguous(),
            True,
            (feat_s0, feat_s1),
        )
    for a, b in zip(shared, each):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compiled_generator_within_bf16_budget() -> None:
    image = _image()
    target = Target(torch.device("cpu"), "bfloat16")
    baseline = SAM2AutomaticMaskGenerator(
        apply_recipe(build_random_sam2(tiny_sam2_config(), seed=3), RECIPE.settings("baseline", target)),
        points_per_side=10,
        points_per_batch=16,
    )
    compiled_model = apply_recipe(build_random_sam2(tiny_sam2_config(), seed=3), RECIPE.settings("compile", target))
    compiled = SAM2AutomaticMaskGenerator(compiled_model, points_per_side=10, points_per_batch=16)
    assert compiled._grid_decoder is not None
    with torch.inference_mode():
        for count in (16, 11):  # a full batch and a short one (padded to the compiled shape)
            expected_logits, expected_iou = _candidates(baseline, image, count)
            logits, iou = _candidates(compiled, image, count)
            assert logits.shape == expected_logits.shape and logits.dtype == torch.float32
            span = expected_logits.max() - expected_logits.min()
            assert (logits - expected_logits).abs().max() <= 0.05 * span
            assert (iou - expected_iou).abs().max() <= 0.05
            inter = ((logits > 0) & (expected_logits > 0)).flatten(2).sum(-1)
            union = ((logits > 0) | (expected_logits > 0)).flatten(2).sum(-1)
            assert (inter / union.clamp(min=1)).mean() >= 0.95
        records = compiled.generate(image)  # the whole generator runs through the compiled decoder
    assert all(r["segmentation"].shape == image.shape[:2] for r in records)
