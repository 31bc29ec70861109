"""genfast's SAM2ImagePredictor against the official one, same random weights (tiny config)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genfast.errors import UserError
from genfast.sam.sam2.config import tiny_sam2_config
from genfast.sam.sam2.official import import_sam2
from genfast.sam.sam2.predictor import SAM2ImagePredictor
from tests.sam.sam2.oracle import twin_models

ATOL = 2e-4  # fp32, same operations in a different order (logits are O(1-10))


@pytest.fixture(scope="module")
def predictors() -> tuple[SAM2ImagePredictor, object]:
    import_sam2()
    from sam2.sam2_image_predictor import SAM2ImagePredictor as OfficialPredictor

    config = tiny_sam2_config()
    ours, official = twin_models(config)
    reference = OfficialPredictor(official)
    grid = config.image_embedding_size  # the official predictor assumes 1024-pixel models
    reference._bb_feat_sizes = [(4 * grid, 4 * grid), (2 * grid, 2 * grid), (grid, grid)]
    return SAM2ImagePredictor(ours), reference


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _close(a: np.ndarray, b: np.ndarray, atol: float = ATOL) -> None:
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), atol=atol, rtol=1e-4)


PROMPTS = {
    "point": dict(point_coords=np.array([[40.0, 30.0]]), point_labels=np.array([1])),
    "two points": dict(point_coords=np.array([[40.0, 30.0], [90.0, 70.0]]), point_labels=np.array([1, 0])),
    "box": dict(box=np.array([10.0, 20.0, 120.0, 80.0])),
    "box and point": dict(
        point_coords=np.array([[60.0, 50.0]]), point_labels=np.array([1]), box=np.array([10.0, 20.0, 120.0, 80.0])
    ),
    "batched points": dict(
        point_coords=np.array([[[40.0, 30.0]], [[100.0, 60.0]], [[5.0, 5.0]]]), point_labels=np.array([[1], [1], [0]])
    ),
    "batched boxes": dict(box=np.array([[10.0, 20.0, 120.0, 80.0], [0.0, 0.0, 50.0, 40.0]])),
}


@pytest.mark.parametrize("multimask", [True, False])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_predict_matches_official(predictors, prompt: str, multimask: bool) -> None:
    ours, official = predictors
    image = _image(90, 140, seed=1)
    ours.set_image(image)
    official.set_image(image)
    args = dict(PROMPTS[prompt], multimask_output=multimask, return_logits=True)
    for a, b in zip(ours.predict(**args), official.predict(**args)):
        assert a.shape == b.shape
        _close(a, b)
    # Boolean masks agree too (apart from pixels whose logit is within float noise of 0).
    masks, _, _ = ours.predict(**dict(PROMPTS[prompt], multimask_output=multimask))
    reference, _, _ = official.predict(**dict(PROMPTS[prompt], multimask_output=multimask))
    assert masks.dtype == bool
    assert (masks != reference).mean() < 1e-3


def test_mask_input_and_unnormalized_coords(predictors) -> None:
    ours, official = predictors
    image = _image(64, 64, seed=2)
    ours.set_image(image)
    official.set_image(image)
    _, scores, low_res = official.predict(np.array([[20.0, 30.0]]), np.array([1]))
    best = low_res[np.argmax(scores)][None]
    args = dict(
        point_coords=np.array([[0.3, 0.4]]),
        point_labels=np.array([1]),
        mask_input=best,
        multimask_output=False,
        return_logits=True,
        normalize_coords=False,
    )
    for a, b in zip(ours.predict(**args), official.predict(**args)):
        _close(a, b)
    # A mask alone, no points.
    for a, b in zip(
        ours.predict(mask_input=best, multimask_output=False, return_logits=True),
        official.predict(mask_input=best, multimask_output=False, return_logits=True),
    ):
        _close(a, b)


def test_image_batch_matches_official(predictors) -> None:
    ours, official = predictors
    images = [_image(80, 120, seed=3), _image(150, 60, seed=4)]
    ours.set_image_batch(images)
    official.set_image_batch(images)
    _close(ours.get_image_embedding().numpy(), official.get_image_embedding().numpy())
    args = dict(
        point_coords_batch=[np.array([[30.0, 40.0]]), np.array([[20.0, 100.0], [40.0, 10.0]])],
        point_labels_batch=[np.array([1]), np.array([1, 0])],
        box_batch=[None, np.array([5.0, 5.0, 50.0, 140.0])],
        return_logits=True,
    )
    for ours_list, official_list in zip(ours.predict_batch(**args), official.predict_batch(**args)):
        for a, b in zip(ours_list, official_list):
            _close(a, b)


def test_pil_image_is_accepted(predictors) -> None:
    from PIL import Image

    ours, _ = predictors
    image = _image(40, 50, seed=5)
    ours.set_image(Image.fromarray(image))
    from_pil = ours.get_image_embedding().clone()
    ours.set_image(image)
    torch.testing.assert_close(from_pil, ours.get_image_embedding())


def test_small_regions_are_removed(predictors) -> None:
    ours, _ = predictors
    ours.set_image(_image(64, 64, seed=6))
    filled = SAM2ImagePredictor(ours.model, max_hole_area=1e9, max_sprinkle_area=0)
    filled.set_image(_image(64, 64, seed=6))
    point = dict(point_coords=np.array([[30.0, 30.0]]), point_labels=np.array([1]), multimask_output=False)
    plain_masks, _, _ = ours.predict(**point)
    filled_masks, _, _ = filled.predict(**point)
    # Every hole filled: the mask only grows, and where the low-res mask had background regions
    # (all "small" at this bound) the result is all foreground.
    assert (filled_masks | ~plain_masks).all()
    assert filled_masks.all()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p.predict(np.array([[1.0, 2.0]]), None), "given together"),
        (lambda p: p.predict(np.array([1.0, 2.0, 3.0]), np.array([1])), "point_coords must be"),
        (lambda p: p.predict(box=np.array([1.0, 2.0, 3.0])), "box must be"),
        (lambda p: p.predict(mask_input=np.zeros((1, 64, 64))), "mask_input must be"),
        (lambda p: p.predict_batch(), "set_image_batch"),
    ],
)
def test_bad_prompts_are_user_errors(predictors, call, message: str) -> None:
    ours, _ = predictors
    ours.set_image(_image(32, 32, seed=7))
    with pytest.raises(UserError, match=message):
        call(ours)


def test_predict_needs_an_image(predictors) -> None:
    ours, _ = predictors
    ours.reset_predictor()
    with pytest.raises(UserError, match="no image is set"):
        ours.predict(np.array([[1.0, 2.0]]), np.array([1]))
    with pytest.raises(UserError, match="HxWx3"):
        ours.set_image(np.zeros((10, 10), dtype=np.uint8))
