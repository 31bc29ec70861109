"""genfast's SamAutomaticMaskGenerator and mask utilities against the original segment-anything
(same random weights, fp32) and plain reference implementations.

The original needs torchvision's NMS (a plain reference in tests/sam/oracle.py stands in) and
resizes with PIL (its predictor is given genfast's resize, so both encode identical pixels), and
cv2 for min_mask_region_area (a scipy-labelled reference of the same logic stands in).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from genfast.errors import UserError
from genfast.sam import masks as M
from genfast.sam.automatic import SamAutomaticMaskGenerator
from genfast.sam.build import build_sam
from genfast.sam.original import use_genfast_resize
from tests.sam.oracle import (
    build_original_sam,
    import_segment_anything,
    randomize_,
    reference_batched_nms,
    reference_box_area,
)
from tests.sam.test_modeling import TINY

IMAGE_SIZE = (48, 64)


def _image(size: tuple[int, int] = IMAGE_SIZE, seed: int = 0, objects: int = 6) -> np.ndarray:
    """Flat coloured rectangles on grey: regions a random model's masks can follow."""
    rng = np.random.default_rng(seed)
    h, w = size
    image = np.full((h, w, 3), 128, np.uint8)
    for _ in range(objects):
        y, x = rng.integers(0, h - 8), rng.integers(0, w - 8)
        dy, dx = rng.integers(4, 14, 2)
        image[y : y + dy, x : x + dx] = rng.integers(0, 256, 3)
    return image


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The tiny model's ops take microseconds: a second OpenMP thread only adds synchronization
    (ten times the run time on a busy two-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    original = build_original_sam(TINY)
    randomize_(original)
    # Random transposed-conv kernels stamp one sub-pixel pattern on every cell of the upscaled
    # masks, so every mask's box is the whole image and NMS keeps one. Kernels constant over their
    # positions give blocky masks following the image's regions: varied boxes, real NMS work.
    with torch.no_grad():
        for layer in original.mask_decoder.output_upscaling:
            if isinstance(layer, torch.nn.ConvTranspose2d):
                layer.weight.copy_(layer.weight.mean((2, 3), keepdim=True).expand_as(layer.weight))
    ours = build_sam(TINY)
    ours.load_state_dict(original.state_dict(), strict=True)
    return original, ours


def _reference_remove_small_regions(mask: np.ndarray, area_thresh: float, mode: str) -> tuple[np.ndarray, bool]:
    """The original's cv2-based clean-up, with scipy labelling the 8-connected regions (both number
    them in raster order)."""
    ndimage = pytest.importorskip("scipy.ndimage")
    holes = mode == "holes"
    regions, n = ndimage.label(holes ^ mask, structure=np.ones((3, 3)))
    sizes = np.bincount(regions.ravel(), minlength=n + 1)[1:]
    small = [i + 1 for i, s in enumerate(sizes) if s < area_thresh]
    if not small:
        return mask, False
    fill = [0] + small
    if not holes:
        fill = [i for i in range(n + 1) if i not in fill] or [int(np.argmax(sizes)) + 1]
    return np.isin(regions, fill), True


@pytest.fixture(scope="module", autouse=True)
def _original_without_torchvision():
    """Give the original generator its torchvision and cv2 functions, whoever imported it first
    (it looks them up as module globals when called)."""
    import_segment_anything()
    from segment_anything import automatic_mask_generator

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(automatic_mask_generator, "batched_nms", reference_batched_nms)
        patch.setattr(automatic_mask_generator, "box_area", reference_box_area)
        patch.setattr(automatic_mask_generator, "remove_small_regions", _reference_remove_small_regions)
        yield


def _generate_both(
    models, image: np.ndarray, points_per_decode: int | None = None, **kwargs
) -> tuple[list[dict], list[dict]]:
    """Records of both generators; `points_per_decode` sets genfast's pieces (a tiny model's
    decoder is small enough for whole batches)."""
    original, ours = models
    sa = import_segment_anything()
    min_area = kwargs.pop("min_mask_region_area", 0)
    reference = sa.SamAutomaticMaskGenerator(original, **kwargs)
    reference.min_mask_region_area = min_area  # set afterwards: its constructor imports cv2 for this
    use_genfast_resize(reference.predictor)
    generator = SamAutomaticMaskGenerator(ours, **kwargs, min_mask_region_area=min_area)
    generator.points_per_decode = points_per_decode or generator.points_per_decode
    return generator.generate(image), reference.generate(image)


def _segmentation_iou(a, b) -> float:
    if isinstance(a, dict):
        a, b = M.rle_to_mask(a).numpy(), M.rle_to_mask(b).numpy()
    union = (a | b).sum()
    return float((a & b).sum() / union) if union else 1.0


def _same_number(a: float, b: float, tol: float = 1e-5) -> bool:
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol


def _assert_same_records(ours: list[dict], expected: list[dict], at_least: int) -> None:
    """Same masks (matched by crop, prompt and predicted IoU); segmentations equal or, where a
    logit within rounding of the threshold flipped, IoU >= 0.99; scores within 1e-5."""
    assert len(ours) == len(expected) >= at_least
    key = lambda r: (r["crop_box"], r["point_coords"], r["predicted_iou"])  # noqa: E731
    for a, b in zip(sorted(ours, key=key), sorted(expected, key=key)):
        assert (
            set(a)
            == set(b)
            == {"segmentation", "area", "bbox", "predicted_iou", "point_coords", "stability_score", "crop_box"}
        )
        assert a["crop_box"] == b["crop_box"]
        np.testing.assert_allclose(a["point_coords"], b["point_coords"], rtol=0, atol=1e-9)
        assert _same_number(a["predicted_iou"], b["predicted_iou"])
        if isinstance(a["segmentation"], np.ndarray):
            assert a["segmentation"].dtype == np.bool_ and a["segmentation"].shape == b["segmentation"].shape
            exact = np.array_equal(a["segmentation"], b["segmentation"])
        else:
            exact = a["segmentation"] == b["segmentation"]
        if exact:
            assert a["area"] == b["area"] and a["bbox"] == b["bbox"]
            assert _same_number(a["stability_score"], b["stability_score"])
        else:
            assert _segmentation_iou(a["segmentation"], b["segmentation"]) >= 0.99
            assert abs(a["area"] - b["area"]) <= 0.01 * max(a["area"], 1)
    # Same order too: both sort by the same NMS passes.
    assert [r["point_coords"] for r in ours] == [r["point_coords"] for r in expected]


# A random tiny model's IoU predictions lie around -0.3..0.5 and its logits within about +-0.5,
# so the thresholds and the stability offset are scaled down from the ViT-H defaults (a threshold
# of 0 would switch its filter off).
SMALL_MODEL = dict(pred_iou_thresh=0.01, stability_score_thresh=0.3, stability_score_offset=0.02)


def test_matches_original(models):
    ours, expected = _generate_both(models, _image(), points_per_side=16, box_nms_thresh=0.9, **SMALL_MODEL)
    _assert_same_records(ours, expected, at_least=4)
    image_h, image_w = IMAGE_SIZE
    for record in ours:
        mask = record["segmentation"]
        assert mask.shape == IMAGE_SIZE and mask.flags.c_contiguous
        assert record["area"] == int(mask.sum())
        assert record["crop_box"] == [0, 0, image_w, image_h]
        ys, xs = np.nonzero(mask)
        assert record["bbox"] == [xs.min(), ys.min(), xs.max() - xs.min(), ys.max() - ys.min()]
    ious = [r["predicted_iou"] for r in ours]
    assert ious == sorted(ious, reverse=True) and min(ious) > 0.01
    assert min(r["stability_score"] for r in ours) >= 0.3


def test_uncompressed_rle_and_partial_batches(models):
    kwargs = dict(
        points_per_side=12, points_per_batch=10, box_nms_thresh=0.8, **{**SMALL_MODEL, "stability_score_thresh": 0.2}
    )
    image = _image(seed=1, objects=15)
    ours, expected = _generate_both(models, image, output_mode="uncompressed_rle", **kwargs)
    _assert_same_records(ours, expected, at_least=4)
    in_pieces, _ = _generate_both(models, image, points_per_decode=3, output_mode="uncompressed_rle", **kwargs)
    _assert_same_records(in_pieces, expected, at_least=4)
    binary = SamAutomaticMaskGenerator(models[1], **kwargs).generate(image)
    for rle, record in zip(ours, binary):
        assert rle["segmentation"]["size"] == list(IMAGE_SIZE)
        assert np.array_equal(M.rle_to_mask(rle["segmentation"]).numpy(), record["segmentation"])


def test_crops_match_original(models):
    ours, expected = _generate_both(
        models,
        _image(),
        points_per_side=12,
        crop_n_layers=1,
        crop_overlap_ratio=0.5,
        box_nms_thresh=0.9,
        crop_nms_thresh=0.6,
        **SMALL_MODEL,
    )
    _assert_same_records(ours, expected, at_least=4)
    image_h, image_w = IMAGE_SIZE
    assert any(r["crop_box"] != [0, 0, image_w, image_h] for r in ours), "no mask came from a crop"


def test_small_regions_match_original(models):
    kwargs = dict(points_per_side=16, box_nms_thresh=0.9, **SMALL_MODEL)
    ours, expected = _generate_both(models, _image(), min_mask_region_area=100, **kwargs)
    _assert_same_records(ours, expected, at_least=4)
    plain = SamAutomaticMaskGenerator(models[1], **kwargs).generate(_image())
    assert {r["area"] for r in ours} != {r["area"] for r in plain}, "the clean-up changed nothing"


def test_unfiltered_masks_match_original(models):
    """No IoU or stability filter: empty masks pass, with NaN stability and zero-area boxes that
    never suppress each other."""
    ours, expected = _generate_both(
        models, _image(seed=2), points_per_side=6, pred_iou_thresh=0.0, stability_score_thresh=0.0
    )
    _assert_same_records(ours, expected, at_least=5)
    assert any(r["area"] == 0 for r in ours)


def test_point_grids_match_original(models):
    grid = np.random.default_rng(3).random((60, 2))
    ours, expected = _generate_both(
        models,
        _image(),
        points_per_side=None,
        point_grids=[grid],
        points_per_batch=7,
        box_nms_thresh=0.9,
        **SMALL_MODEL,
    )
    _assert_same_records(ours, expected, at_least=2)


def test_no_masks(models):
    generator = SamAutomaticMaskGenerator(
        models[1], points_per_side=4, pred_iou_thresh=0.99, crop_n_layers=1, min_mask_region_area=10
    )
    assert generator.generate(_image()) == []


# ---- utilities ---------------------------------------------------------------------------------


def _random_boxes(n: int, seed: int, integer: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    corners = torch.rand(n, 2, generator=gen) * 100
    sizes = torch.rand(n, 2, generator=gen) * 40
    boxes = torch.cat([corners, corners + sizes], dim=1)
    if integer:
        boxes = boxes.round()
        boxes[::7, 2:] = boxes[::7, :2]  # zero-area boxes: IoU 0 / 0
    boxes[1::9] = boxes[::9][: len(boxes[1::9])]  # exact duplicates
    return boxes


@pytest.mark.parametrize("integer", [True, False], ids=["integer", "float"])
@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.7])
def test_nms_matches_reference(integer, threshold):
    boxes = _random_boxes(300, seed=int(threshold * 10), integer=integer)
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(300, generator=gen)
    scores[::5] = scores[0]  # ties keep their input order
    categories = torch.randint(0, 3, (300,), generator=gen)
    keep = M.nms(boxes, scores, threshold)
    assert torch.equal(keep, reference_batched_nms(boxes, scores, torch.zeros(300), threshold))
    assert 0 < len(keep) < 300
    batched = M.batched_nms(boxes, scores, categories, threshold, block=64)  # several row blocks
    assert torch.equal(batched, reference_batched_nms(boxes, scores, categories, threshold))
    assert M.nms(torch.zeros(0, 4), torch.zeros(0), 0.5).shape == (0,)


def test_nms_threshold_compared_as_double():
    # IoU 7/10 in float32 is 0.699999988 < 0.7: kept, as torchvision does (torch's float32
    # comparison with 0.7 agrees here); IoU 2/3 against 0.6666666 must not round the threshold up.
    boxes = torch.tensor([[0.0, 0.0, 10.0, 1.0], [0.0, 0.0, 7.0, 1.0], [0.0, 0.0, 3.0, 1.0], [0.0, 0.0, 2.0, 1.0]])
    scores = torch.tensor([1.0, 0.9, 0.8, 0.7])
    for threshold in (0.7, 2 / 3, 0.6666666, float(np.float32(2 / 3))):
        assert torch.equal(
            M.nms(boxes, scores, threshold), reference_batched_nms(boxes, scores, torch.zeros(4), threshold)
        ), threshold


def _masks(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    masks = torch.rand(8, 13, 17, generator=gen) > torch.rand(8, 1, 1, generator=gen)
    masks[0] = False
    masks[1] = True
    masks[2] = False
    masks[2, -1, -1] = True  # only the last pixel: the RLE ends on foreground
    masks[3] = False
    masks[3, 0, 0] = True  # only the first pixel: the RLE starts with an empty run
    return masks


def test_rle_round_trip_matches_original():
    import_segment_anything()
    from segment_anything.utils import amg

    masks = _masks(0)
    rles = M.mask_to_rle(masks)
    assert rles == amg.mask_to_rle_pytorch(masks)
    assert rles[0]["counts"] == [13 * 17] and rles[1]["counts"] == [0, 13 * 17]
    for mask, rle in zip(masks, rles):
        assert torch.equal(M.rle_to_mask(rle), mask)
        assert np.array_equal(amg.rle_to_mask(rle), mask.numpy())
        assert M.area_from_rle(rle) == int(mask.sum())
        assert all(c > 0 for c in rle["counts"][1:])


def test_runs_in_image_frame_match_uncropped_masks():
    masks = _masks(1)
    crop_box, (h, w) = [5, 3, 22, 16], (20, 30)
    index, cols, starts, ends = M.column_runs(masks)
    flat = (cols + crop_box[0]) * h + crop_box[1]
    rles = M.runs_to_rles(index, flat + starts, flat + ends, [4, 0, 1, 7], (h, w))
    assert rles == M.mask_to_rle(M.uncrop_masks(masks, crop_box, h, w)[[4, 0, 1, 7]])
    full = M.runs_to_rles(index, cols * 13 + starts, cols * 13 + ends, range(8), (13, 17))
    assert full == M.mask_to_rle(masks)  # a crop spanning whole columns: runs join across columns


def test_boxes_and_crop_helpers_match_original():
    import_segment_anything()
    from segment_anything.utils import amg

    masks = _masks(2)
    assert torch.equal(M.masks_to_boxes(masks), amg.batched_mask_to_box(masks))
    assert torch.equal(M.masks_to_boxes(masks.view(2, 4, 13, 17)), amg.batched_mask_to_box(masks.view(2, 4, 13, 17)))
    assert M.masks_to_boxes(masks[:0]).shape == (0, 4)
    boxes = _random_boxes(50, 0, integer=True).long()
    for crop in ([0, 0, 100, 120], [20, 10, 90, 70]):
        assert torch.equal(
            M.is_box_near_crop_edge(boxes, crop, [0, 0, 100, 120]),
            amg.is_box_near_crop_edge(boxes, crop, [0, 0, 100, 120]),
        )
        assert torch.equal(M.uncrop_boxes_xyxy(boxes, crop), amg.uncrop_boxes_xyxy(boxes, crop))
    assert torch.equal(M.box_xyxy_to_xywh(boxes), torch.stack([amg.box_xyxy_to_xywh(b) for b in boxes]))
    for size, layers, ratio in [((48, 64), 1, 512 / 1500), ((1500, 2250), 2, 512 / 1500), ((77, 31), 3, 0.5)]:
        assert M.generate_crop_boxes(size, layers, ratio) == amg.generate_crop_boxes(size, layers, ratio)
    for grid, expected in zip(M.build_all_layer_point_grids(32, 2, 2), amg.build_all_layer_point_grids(32, 2, 2)):
        assert np.array_equal(grid.numpy(), expected)
    assert M.build_point_grid(3)[:4].tolist() == [[1 / 6, 1 / 6], [0.5, 1 / 6], [5 / 6, 1 / 6], [1 / 6, 0.5]]


def test_stability_score_is_iou_of_offset_masks():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 20, 30, generator=gen)
    logits[0] = -5.0  # empty at both cut-offs: 0 / 0
    score = M.stability_score(logits, 0.5, 0.3)
    high, low = logits > 0.8, logits > 0.2
    direct = (high & low).sum((1, 2)).double() / (high | low).sum((1, 2)).double()
    assert torch.isnan(score[0]) and torch.isnan(direct[0])
    torch.testing.assert_close(score[1:].double(), direct[1:])
    import_segment_anything()
    from segment_anything.utils import amg

    torch.testing.assert_close(score, amg.calculate_stability_score(logits, 0.5, 0.3), equal_nan=True)


def _spiral(size: int) -> np.ndarray:
    """One 8-connected path winding inwards: the worst case for propagating labels."""
    mask = np.zeros((size, size), bool)
    top, left, bottom, right = 0, 0, size - 1, size - 1
    while top <= bottom and left <= right:
        mask[top, left : right + 1] = mask[top : bottom + 1, right] = mask[bottom, left : right + 1] = True
        mask[top + 2 : bottom + 1, left] = True
        top, left, bottom, right = top + 2, left + 2, bottom - 2, right - 2
        if top <= bottom:
            mask[top, left - 2 : left] = True
    return mask


@pytest.mark.parametrize("connectivity", [4, 8])
def test_connected_components_match_scipy(connectivity):
    ndimage = pytest.importorskip("scipy.ndimage")
    structure = np.ones((3, 3)) if connectivity == 8 else None
    gen = torch.Generator().manual_seed(connectivity)
    cases = [torch.rand(40, 57, generator=gen) > p for p in (0.3, 0.5, 0.7)]
    cases += [torch.from_numpy(_spiral(61)), torch.zeros(5, 6, dtype=torch.bool), torch.ones(5, 6, dtype=torch.bool)]
    for mask in cases:
        labels, sizes = M.connected_components(mask, connectivity)
        expected, n = ndimage.label(mask.numpy(), structure=structure)
        assert np.array_equal(labels.numpy(), expected) and len(sizes) == n
        assert sizes.tolist() == np.bincount(expected.ravel(), minlength=n + 1)[1:].tolist()


@pytest.mark.parametrize("mode", ["holes", "islands"])
def test_remove_small_regions_matches_reference(mode):
    gen = torch.Generator().manual_seed(0)
    masks = [torch.rand(30, 40, generator=gen) > p for p in (0.4, 0.6, 0.8)]
    blob = torch.zeros(30, 40, dtype=torch.bool)
    blob[5:20, 5:30] = True
    blob[8:10, 8:10] = False  # a small hole
    blob[25:27, 35:37] = True  # a small island
    specks = torch.zeros(30, 40, dtype=torch.bool)
    specks[3, 3] = specks[10, 10:12] = specks[20, 30:32] = True  # all islands small: keep the first largest
    for mask in [*masks, blob, specks, torch.zeros(30, 40, dtype=torch.bool)]:
        for area in (1, 3, 10, 50):
            out, changed = M.remove_small_regions(mask, area, mode)
            ref_out, ref_changed = _reference_remove_small_regions(mask.numpy(), area, mode)
            assert changed == ref_changed and np.array_equal(out.numpy(), ref_out), (area, mode)


def test_errors(models):
    model = models[1]
    cases = [
        (dict(points_per_side=None), "exactly one of points_per_side"),
        (dict(point_grids=[np.zeros((4, 2))]), "exactly one of points_per_side"),
        (dict(points_per_side=0), "points_per_side must be an integer >= 1"),
        (
            dict(points_per_side=4, crop_n_layers=2, crop_n_points_downscale_factor=4),
            "leaves crop layer 2 with no points",
        ),
        (dict(points_per_side=None, point_grids=[np.zeros((4, 2))], crop_n_layers=1), "list of crop_n_layers"),
        (dict(points_per_side=None, point_grids=[np.zeros((4, 3))]), r"point_grids\[0\] must be \[N, 2\]"),
        (dict(points_per_side=None, point_grids=[np.full((4, 2), 2.0)]), "normalized to"),
        (dict(output_mode="mask"), "output_mode must be one of"),
        (dict(points_per_batch=0), "points_per_batch must be an integer"),
        (dict(box_nms_thresh=1.5), r"box_nms_thresh must be a number in \[0, 1\]"),
        (dict(crop_overlap_ratio=1.0), r"crop_overlap_ratio must be a number in \[0, 1\)"),
        (dict(min_mask_region_area=-1), "min_mask_region_area must be an integer >= 0"),
        (dict(stability_score_offset=-1.0), "stability_score_offset must be a number >= 0"),
        (dict(pred_iou_thresh="high"), "pred_iou_thresh must be a number, got 'high'"),
    ]
    for kwargs, match in cases:
        with pytest.raises(UserError, match=match):
            SamAutomaticMaskGenerator(model, **kwargs)
    with pytest.raises(UserError, match="genfast SAM model"):
        SamAutomaticMaskGenerator(object())
    try:
        import pycocotools  # noqa: F401
    except ImportError:
        with pytest.raises(UserError, match="needs pycocotools"):
            SamAutomaticMaskGenerator(model, output_mode="coco_rle")
    generator = SamAutomaticMaskGenerator(model, points_per_side=2)
    for image, match in [
        (np.zeros((10, 12), np.uint8), "must be HxWx3"),
        (np.zeros((10, 12, 4), np.uint8), "must be HxWx3"),
        (np.zeros((0, 12, 3), np.uint8), "must be HxWx3"),
        (np.zeros((10, 12, 3), np.float32), "must be uint8"),
        (torch.zeros(10, 12, 3, dtype=torch.uint8), "must be a numpy array"),
    ]:
        with pytest.raises(UserError, match=match):
            generator.generate(image)
    with pytest.raises(UserError, match="sum to h"):
        M.rle_to_mask({"size": [2, 3], "counts": [1, 2]})
    with pytest.raises(UserError, match="mode must be"):
        M.remove_small_regions(torch.zeros(3, 3, dtype=torch.bool), 2, "both")
