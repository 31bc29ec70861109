"""genfast's SamPredictor against the original segment-anything SamPredictor (same weights, fp32).

The original resizes numpy images with PIL (stubbed out here), so both predictors are given the
same transformed tensor through set_torch_image: the comparison isolates the predictor logic.
genfast's own set_image is checked for self-consistency against that path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genfast.errors import UserError
from genfast.sam.build import build_sam
from genfast.sam.config import SamConfig
from genfast.sam.predictor import SamPredictor
from tests.sam.oracle import build_original_sam, import_segment_anything, randomize_
from tests.sam.test_modeling import TINY, TINY_B, _close

ORIGINAL_SIZE = (50, 37)  # portrait and not a divisor of the input size: resizing and padding both matter


def _image(size: tuple[int, int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def _transformed(predictor: SamPredictor, image: np.ndarray) -> torch.Tensor:
    """genfast's resize as a [1, 3, h, w] uint8 tensor, as the original's set_image would build it."""
    return torch.from_numpy(predictor.transform.apply_image(image)).permute(2, 0, 1)[None]


@pytest.fixture(scope="module", params=[TINY, TINY_B], ids=["tiny", "tiny_b"])
def predictors(request) -> tuple[SamConfig, object, SamPredictor, np.ndarray]:
    config = request.param
    torch.manual_seed(0)
    original = build_original_sam(config)
    randomize_(original)
    ours = build_sam(config)
    ours.load_state_dict(original.state_dict(), strict=True)
    sa = import_segment_anything()
    ref, pred = sa.SamPredictor(original), SamPredictor(ours)
    image = _image(ORIGINAL_SIZE, 0)
    transformed = _transformed(pred, image)
    ref.set_torch_image(transformed, ORIGINAL_SIZE)
    pred.set_torch_image(transformed, ORIGINAL_SIZE)
    return config, ref, pred, image


def _assert_same(ours: tuple, ref: tuple, logits: np.ndarray, return_logits: bool) -> None:
    """Low-res logits and IoUs within 1e-5 relative; masks equal, or (thresholded) differing only
    where the logit is within rounding of the threshold."""
    masks, iou, low_res = (torch.from_numpy(np.asarray(a)) for a in ours)
    masks_ref, iou_ref, low_res_ref = (torch.from_numpy(np.asarray(a)) for a in ref)
    _close(low_res, low_res_ref)
    _close(iou, iou_ref)
    if return_logits:
        _close(masks, masks_ref)
    else:
        assert masks.dtype == masks_ref.dtype == torch.bool and masks.shape == masks_ref.shape
        differ = masks != masks_ref
        assert (torch.from_numpy(logits)[differ].abs() < 1e-4).all()


def _prompt(kind: str) -> dict:
    h, w = ORIGINAL_SIZE
    points = {"point": ([[20.0, 30.0]], [1]), "points": ([[5.0, 8.0], [30.0, 44.0], [18.5, 25.0]], [1, 0, 1])}
    prompt = {}
    if "points" in kind or kind == "point":
        coords, labels = points["points" if "points" in kind else "point"]
        prompt.update(point_coords=np.array(coords), point_labels=np.array(labels))
    if "box" in kind:
        prompt["box"] = np.array([3.0, 6.0, w - 4.0, h - 9.0])
    return prompt


def test_embedding_matches(predictors):
    config, ref, pred, _ = predictors
    emb = pred.get_image_embedding()
    grid = config.image_embedding_size
    assert emb.shape == (1, config.prompt_embed_dim, grid, grid)
    _close(emb, ref.get_image_embedding())
    assert pred.original_size == ref.original_size and pred.input_size == ref.input_size
    assert pred.is_image_set and pred.device == torch.device("cpu")


@pytest.mark.parametrize("return_logits", [False, True], ids=["masks", "logits"])
@pytest.mark.parametrize("multimask", [True, False], ids=["multi", "single"])
@pytest.mark.parametrize("kind", ["point", "points", "box", "box+points", "none"])
def test_predict_matches(predictors, kind, multimask, return_logits):
    config, ref, pred, _ = predictors
    prompt = _prompt(kind)
    args = {**prompt, "multimask_output": multimask}
    ours = pred.predict(**args, return_logits=return_logits)
    expected = ref.predict(**args, return_logits=return_logits)
    logits = pred.predict(**args, return_logits=True)[0]
    _assert_same(ours, expected, logits, return_logits)
    n = config.num_multimask_outputs if multimask else 1
    low = 4 * config.image_embedding_size
    assert ours[0].shape == (n, *ORIGINAL_SIZE) and ours[1].shape == (n,) and ours[2].shape == (n, low, low)
    assert ours[0].dtype == (np.float32 if return_logits else np.bool_)


@pytest.mark.parametrize("multimask", [True, False], ids=["multi", "single"])
def test_predict_with_previous_low_res_mask(predictors, multimask):
    _, ref, pred, _ = predictors
    first = pred.predict(**_prompt("point"))
    best = int(np.argmax(first[1]))
    args = {**_prompt("points"), "mask_input": first[2][best : best + 1], "multimask_output": multimask}
    logits = pred.predict(**args, return_logits=True)[0]
    _assert_same(pred.predict(**args), ref.predict(**args), logits, False)


@pytest.mark.parametrize("with_points", [False, True], ids=["boxes", "boxes+points"])
def test_predict_torch_batch_matches(predictors, with_points):
    config, ref, pred, _ = predictors
    gen = torch.Generator().manual_seed(7)
    h, w = ORIGINAL_SIZE
    corners = (torch.rand(4, 2, 2, generator=gen) * torch.tensor([w, h])).sort(dim=1).values.reshape(4, 4)
    boxes = pred.transform.apply_boxes_torch(corners, ORIGINAL_SIZE)
    coords = labels = None
    if with_points:
        coords = pred.transform.apply_coords_torch(
            torch.rand(4, 2, 2, generator=gen) * torch.tensor([w, h]), ORIGINAL_SIZE
        )
        labels = torch.tensor([[1, 0], [1, 1], [0, 1], [1, -1]], dtype=torch.int32)
    masks, iou, low_res = pred.predict_torch(coords, labels, boxes)
    masks_ref, iou_ref, low_res_ref = ref.predict_torch(coords, labels, boxes)
    _close(iou, iou_ref)
    _close(low_res, low_res_ref)
    logits = pred.predict_torch(coords, labels, boxes, return_logits=True)[0]
    assert masks.shape == (4, config.num_multimask_outputs, *ORIGINAL_SIZE)
    assert (logits[masks != masks_ref].abs() < 1e-4).all()


def test_predict_torch_reads_no_values():
    """Every op in predict_torch works on the meta device, which has no values: so there is no
    .item(), boolean-mask indexing or other host-device sync in the prompt path."""
    with torch.device("meta"):
        pred = SamPredictor(build_sam(TINY))
        pred.set_torch_image(torch.empty(1, 3, 48, 64), (480, 640))
        coords, labels = torch.empty(5, 3, 2), torch.empty(5, 3, dtype=torch.int32)
        masks, iou, low_res = pred.predict_torch(coords, labels, torch.empty(5, 4), torch.empty(5, 1, 32, 32))
    assert masks.is_meta and masks.shape == (5, 3, 480, 640) and masks.dtype == torch.bool
    assert iou.shape == (5, 3) and low_res.shape == (5, 3, 32, 32)


def test_set_image_matches_set_torch_image(predictors):
    _, _, pred, image = predictors
    expected = pred.get_image_embedding().clone()
    prompt = _prompt("box+points")
    expected_out = pred.predict(**prompt, return_logits=True)
    pred.set_image(image)
    assert torch.equal(pred.get_image_embedding(), expected)
    assert pred.original_size == ORIGINAL_SIZE
    for a, b in zip(pred.predict(**prompt, return_logits=True), expected_out):
        np.testing.assert_array_equal(a, b)
    pred.set_image(np.ascontiguousarray(image[..., ::-1]), image_format="BGR")
    assert torch.equal(pred.get_image_embedding(), expected)
    pred.set_image(np.ascontiguousarray(image[..., ::-1]))  # the same pixels read as RGB: a different image
    assert not torch.equal(pred.get_image_embedding(), expected)
    pred.set_image(image)


def test_batched_images_match_single_calls(predictors):
    _, _, pred, image = predictors
    images = [image, _image((23, 61), 1), _image((40, 40), 2)]
    prompts = [_prompt("point"), _prompt("box"), {**_prompt("points"), "box": np.array([1.0, 2.0, 20.0, 30.0])}]
    singles, embeddings = [], []
    for img, prompt in zip(images, prompts):
        pred.set_image(img)
        embeddings.append(pred.get_image_embedding())
        singles.append((pred.predict(**prompt), pred.predict(**prompt, return_logits=True)[0]))
    pred.set_images(images)
    assert pred.num_images == 3 and pred.original_size is None
    _close(pred.get_image_embedding(), torch.cat(embeddings))
    for (single, logits), batched in zip(singles, pred.predict_batch(prompts)):
        _assert_same(batched, single, logits, False)
    _close(
        torch.from_numpy(pred.predict(**prompts[1], image_index=1, return_logits=True)[0]),
        torch.from_numpy(singles[1][1]),
    )
    with pytest.raises(UserError, match="3 images are set"):
        pred.predict(**prompts[0])
    with pytest.raises(UserError, match="one prompt dict per set image"):
        pred.predict_batch(prompts[:2])
    with pytest.raises(UserError, match="unknown prompt keys"):
        pred.predict_batch([{"points": 1}, {}, {}])
    pred.set_image(image)


@pytest.mark.parametrize(
    "image, image_format, match",
    [
        (np.zeros((10, 12), np.uint8), "RGB", "must be HxWx3"),
        (np.zeros((10, 12, 4), np.uint8), "RGB", "must be HxWx3"),
        (np.zeros((3, 10, 12), np.uint8), "RGB", "must be HxWx3"),
        (np.zeros((10, 12, 3), np.float32), "RGB", "must be uint8"),
        (torch.zeros(10, 12, 3, dtype=torch.uint8), "RGB", "must be a numpy array"),
        (np.zeros((10, 12, 3), np.uint8), "rgb", "image_format must be 'RGB' or 'BGR'"),
    ],
    ids=["2d", "4_channels", "chw", "float", "tensor", "format"],
)
def test_set_image_errors(image, image_format, match):
    pred = SamPredictor(build_sam(TINY))
    with pytest.raises(UserError, match=match):
        pred.set_image(image, image_format)
    assert not pred.is_image_set
    with pytest.raises(UserError, match="set_torch_image expects"):
        pred.set_torch_image(torch.zeros(1, 3, 30, 40), (30, 40))  # long side is not 64
    with pytest.raises(UserError, match="at least one image"):
        pred.set_images([])


def test_predict_errors():
    pred = SamPredictor(build_sam(TINY))
    with pytest.raises(UserError, match="no image is set"):
        pred.predict(point_coords=np.array([[1.0, 2.0]]), point_labels=np.array([1]))
    with pytest.raises(UserError, match="no image is set"):
        pred.get_image_embedding()
    pred.set_image(_image((30, 20), 3))
    pts = np.array([[1.0, 2.0], [3.0, 4.0]])
    cases = [
        ({"point_coords": pts}, "must be given together"),
        ({"point_labels": np.array([1, 0])}, "must be given together"),
        ({"point_coords": pts, "point_labels": np.array([1])}, r"point_labels must be \[N\] with N = 2"),
        ({"point_coords": np.array([1.0, 2.0]), "point_labels": np.array([1])}, r"point_coords must be \[N, 2\]"),
        ({"box": np.array([1.0, 2.0, 3.0])}, "box must be 4 numbers"),
        ({"mask_input": np.zeros((32, 32))}, r"mask_input must be \[1, 32, 32\]"),
        ({"mask_input": np.zeros((1, 256, 256))}, r"mask_input must be \[1, 32, 32\]"),
    ]
    for kwargs, match in cases:
        with pytest.raises(UserError, match=match):
            pred.predict(**kwargs)
    coords, labels = torch.zeros(2, 3, 2), torch.ones(2, 3)
    torch_cases = [
        ((coords, None, None, None), "must be given together"),
        ((coords, torch.ones(2, 4), None, None), r"point_labels must be \[B, N\]"),
        ((coords, labels, torch.zeros(3, 4), None), "prompt batch sizes differ"),
        ((None, None, torch.zeros(2, 2, 2), None), r"boxes must be \[B, 4\]"),
        ((coords, labels, None, torch.zeros(2, 32, 32)), r"mask_input must be \[B, 1, 32, 32\]"),
    ]
    for args, match in torch_cases:
        with pytest.raises(UserError, match=match):
            pred.predict_torch(*args)
    with pytest.raises(UserError, match="out of range"):
        pred.predict(image_index=1)
    pred.reset_image()
    assert not pred.is_image_set and pred.features is None


def test_bf16_model_predicts_close_to_fp32():
    """bf16 dtype plumbing: a bf16 model takes the same prompts and returns fp32 logits that keep
    the fp32 model's masks (mask IoU >= 0.9 on a tiny random model; measured 0.998)."""
    torch.manual_seed(0)
    fp32 = build_sam(TINY)
    randomize_(fp32)
    bf16 = build_sam(TINY)
    bf16.load_state_dict(fp32.state_dict())
    bf16 = bf16.to(torch.bfloat16)
    image = _image(ORIGINAL_SIZE, 1)
    results = []
    for model in (fp32, bf16):
        predictor = SamPredictor(model)
        predictor.set_image(image)
        results.append(predictor.predict(**_prompt("box+points"), multimask_output=False, return_logits=True))
    (want, _, _), (got, _, _) = results
    assert got.dtype == np.float32 and got.shape == want.shape
    a, b = want > 0, got > 0
    iou = (a & b).sum() / max((a | b).sum(), 1)
    assert iou >= 0.9, iou


def test_prompts_of_the_same_shape_share_one_decoder_call(predictors):
    """Images 0, 1 and 3 have one-point prompts (one decoder call over three image embeddings),
    image 2 a box (its own call); every answer equals the one-image answer."""
    _, _, pred, image = predictors
    images = [image, _image((23, 61), 1), _image((40, 40), 2), _image((30, 20), 3)]
    point = {"point_coords": np.array([[5.0, 7.0]]), "point_labels": np.array([1])}
    prompts = [
        point,
        {"point_coords": np.array([[10.0, 3.0]]), "point_labels": np.array([0])},
        {"box": np.array([1.0, 2.0, 20.0, 30.0])},
        point,
    ]
    singles = []
    for img, prompt in zip(images, prompts):
        pred.set_image(img)
        singles.append(pred.predict(**prompt, return_logits=True))
    calls = []
    hook = pred.model.mask_decoder.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    try:
        pred.set_images(images)
        batched = pred.predict_batch(prompts, return_logits=True)
    finally:
        hook.remove()
    assert sorted(calls) == [1, 3]
    for single, together in zip(singles, batched):
        for a, b in zip(together, single):
            _close(torch.from_numpy(a), torch.from_numpy(b))
    pred.set_image(image)


def test_static_encoder_batches_pad_and_match(predictors):
    _, _, pred, image = predictors
    images = [image, _image((23, 61), 1), _image((40, 40), 2)]
    pred.set_images(images)
    expected = pred.get_image_embedding()
    chunked = SamPredictor(pred.model, encoder_batch_size=2)
    seen = []
    hook = pred.model.image_encoder.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    try:
        chunked.set_images(images)
    finally:
        hook.remove()
    assert seen == [2, 2]  # three images: a full chunk and a padded one
    _close(chunked.get_image_embedding(), expected)
    pred.set_image(image)
