"""genfast's SAM2AutomaticMaskGenerator against the official one (same random weights, tiny
config; the official generator's NMS is the plain reference of tests/sam/oracle.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genfast.errors import UserError
from genfast.kernels.upsampled_masks import ops as upsampled_masks
from genfast.sam.masks import FullSizeMasks, UpsampledMasks
from genfast.sam.sam2.automatic import SAM2AutomaticMaskGenerator
from genfast.sam.sam2.config import tiny_sam2_config
from genfast.sam.sam2.official import import_sam2
from genfast.sam.sam2.predictor import SAM2ImagePredictor
from tests.sam.oracle import reference_batched_nms
from tests.sam.sam2.oracle import twin_models
from tests.sam.test_automatic import _assert_same_records, _image


@pytest.fixture(scope="module")
def models():
    import_sam2()
    from sam2 import automatic_mask_generator

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(automatic_mask_generator, "batched_nms", reference_batched_nms)
        # The official modules initialize from torch's global generator: seeded, so the weights do
        # not depend on what ran before.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            pair = twin_models(tiny_sam2_config(), seed=5)
        yield pair


def _generate_both(
    models, image: np.ndarray, points_per_decode: int | None = None, **kwargs
) -> tuple[list[dict], list[dict]]:
    """Records of both generators; `points_per_decode` sets genfast's pieces (a tiny model's
    decoder is small enough for whole batches)."""
    from sam2.automatic_mask_generator import SAM2AutomaticMaskGenerator as Official

    ours, official = models
    reference = Official(official, **kwargs)
    grid = ours.config.image_embedding_size  # the official predictor assumes 1024-pixel models
    reference.predictor._bb_feat_sizes = [(4 * grid, 4 * grid), (2 * grid, 2 * grid), (grid, grid)]
    generator = SAM2AutomaticMaskGenerator(ours, **kwargs)
    generator.points_per_decode = points_per_decode or generator.points_per_decode
    return generator.generate(image), reference.generate(image)


# A random tiny model's IoU predictions (after the sigmoid) lie around 0.3-0.7 and its logits
# within +-1: thresholds scaled so both filters keep some masks and drop others.
SMALL_MODEL = dict(pred_iou_thresh=0.5, stability_score_thresh=0.3, stability_score_offset=0.05)


@pytest.mark.parametrize(
    "options",
    [
        dict(points_per_side=12),
        dict(points_per_side=12, multimask_output=False),
        dict(points_per_side=8, use_m2m=True),
        dict(points_per_side=8, crop_n_layers=1, crop_overlap_ratio=0.5, crop_nms_thresh=0.6),
        dict(points_per_side=10, points_per_batch=7, output_mode="uncompressed_rle"),
        dict(points_per_side=10, points_per_batch=16, points_per_decode=3),
        dict(points_per_side=8, points_per_batch=16, points_per_decode=3, use_m2m=True),
    ],
    ids=["default", "single-mask", "m2m", "crops", "rle-partial-batches", "in-pieces", "m2m-in-pieces"],
)
def test_matches_official(models, options: dict) -> None:
    # Random masks overlap much: a lenient NMS keeps several to compare.
    ours, expected = _generate_both(models, _image(), box_nms_thresh=0.98, **SMALL_MODEL, **options)
    _assert_same_records(ours, expected, at_least=2)
    ious = [r["predicted_iou"] for r in ours]
    assert min(ious) > 0.5


@pytest.mark.parametrize("path", ["native", "portable"])
def test_unfiltered_masks_match_official(models, monkeypatch, path: str) -> None:
    """Every candidate mask reaches NMS: measured at the image's size by the upsampled-mask kernel
    (where it is loaded), or upsampled in full by F.interpolate."""
    if path == "native" and upsampled_masks.unavailable_reason() is not None:
        pytest.skip(upsampled_masks.unavailable_reason())
    if path == "portable":
        monkeypatch.setattr(upsampled_masks, "takes", lambda logits: False)
    predictor = SAM2ImagePredictor(models[0])
    predictor.set_image(_image(seed=2))
    kind = UpsampledMasks if path == "native" else FullSizeMasks
    assert isinstance(predictor.summarize_masks(torch.zeros(3, 16, 16), 0.0, 1.0), kind)
    ours, expected = _generate_both(
        models, _image(seed=2), points_per_side=6, pred_iou_thresh=0.0, stability_score_thresh=0.0, box_nms_thresh=0.98
    )
    _assert_same_records(ours, expected, at_least=5)


def test_rejects_a_sam1_model() -> None:
    from genfast.sam.build import build_sam
    from tests.sam.test_modeling import TINY

    with pytest.raises(UserError, match="SAM 2 model"):
        SAM2AutomaticMaskGenerator(build_sam(TINY))


def test_small_regions_are_filled_before_either_path_measures(models, monkeypatch) -> None:
    """With min_mask_region_area the predictor fills the low-res masks' holes and specks before
    the masks are measured: the kernel's records equal F.interpolate's."""
    if upsampled_masks.unavailable_reason() is not None:
        pytest.skip(upsampled_masks.unavailable_reason())
    options = dict(
        points_per_side=6, pred_iou_thresh=0.0, stability_score_thresh=0.0, box_nms_thresh=0.98, min_mask_region_area=30
    )
    image = _image(seed=2)
    native = SAM2AutomaticMaskGenerator(models[0], **options).generate(image)
    monkeypatch.setattr(upsampled_masks, "takes", lambda logits: False)
    portable = SAM2AutomaticMaskGenerator(models[0], **options).generate(image)
    _assert_same_records(native, portable, at_least=3)
