"""SamAutomaticMaskGenerator: masks for everything in an image, from a grid of point prompts
(the original segment-anything class: same parameters, defaults, records and filtering).

For each crop (the whole image, plus overlapping crops with crop_n_layers > 0), the crop is
encoded once and a grid of single foreground points is decoded in batches, three masks a point.
Masks are filtered by predicted IoU, stability score and (in crops) closeness to a crop edge that
is not an image edge; duplicates are removed by box NMS within the crop, then across crops
(preferring smaller crops). Optionally small holes and islands are cleaned up afterwards.

Data stays on the model's device as tensors. Each batch waits for the device only to size its
selections (the masks passing the IoU filter, those passing the rest, and their column runs), so
discarded full-resolution masks are neither processed further nor kept; kept masks are held as
column runs, which become RLEs only for the masks that survive NMS.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from genfast.errors import UserError
from genfast.platform.heap import in_pieces, items_per_piece
from genfast.sam.masks import (
    RLE,
    area_from_rle,
    box_area,
    box_xyxy_to_xywh,
    build_all_layer_point_grids,
    coco_encode_rle,
    generate_crop_boxes,
    is_box_near_crop_edge,
    mask_to_rle,
    masks_to_boxes,
    nms,
    remove_small_regions,
    rle_to_mask,
    runs_to_rles,
    uncrop_boxes_xyxy,
    uncrop_points,
)
from genfast.sam.modeling import Sam
from genfast.sam.predictor import SamPredictor, check_image

OUTPUT_MODES = ("binary_mask", "uncompressed_rle", "coco_rle")


@dataclass
class MaskData:
    """The masks kept so far, one row each: RLEs and prompt points on the host, the rest on the
    model's device until the records are written."""

    rles: list[RLE]
    boxes: Tensor  # [N, 4] XYXY, int64, inclusive pixels in the image frame
    iou_preds: Tensor  # [N] the model's predicted IoU
    stability_scores: Tensor  # [N]
    points: Tensor  # [N, 2] (x, y) of the prompt in the image frame, in point_dtype (host)
    crop_boxes: Tensor  # [N, 4] XYXY int64

    def select(self, index: Tensor) -> MaskData:
        host = index.cpu()
        return MaskData(
            [self.rles[i] for i in host.tolist()],
            self.boxes[index],
            self.iou_preds[index],
            self.stability_scores[index],
            self.points[host],
            self.crop_boxes[index],
        )

    @staticmethod
    def cat(parts: list[MaskData]) -> MaskData:
        return MaskData(
            [rle for part in parts for rle in part.rles],
            *(
                torch.cat([getattr(part, name) for part in parts])
                for name in ("boxes", "iou_preds", "stability_scores", "points", "crop_boxes")
            ),
        )

    def cpu(self) -> MaskData:
        return MaskData(
            self.rles,
            self.boxes.cpu(),
            self.iou_preds.cpu(),
            self.stability_scores.cpu(),
            self.points,
            self.crop_boxes.cpu(),
        )


class _Batch(NamedTuple):
    """The masks of one batch that passed every filter, as column runs plus their scores."""

    point_index: Tensor  # [M] the prompt of each mask (index into the crop's points)
    iou_preds: Tensor  # [M]
    stability_scores: Tensor  # [M]
    boxes: Tensor  # [M, 4] in the crop's frame
    runs: tuple[Tensor, Tensor, Tensor, Tensor]  # column_runs of the M masks


def _integer(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise UserError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _number(name: str, value: Any, minimum: float = -math.inf) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value >= minimum:
        raise UserError(f"{name} must be a number{f' >= {minimum:g}' if minimum > -math.inf else ''}, got {value!r}")
    return float(value)


def _fraction(name: str, value: Any, upper_open: bool = False) -> float:
    ok = isinstance(value, numbers.Real) and value >= 0 and (value < 1 if upper_open else value <= 1)
    if not ok:
        raise UserError(f"{name} must be a number in [0, 1{')' if upper_open else ']'}, got {value!r}")
    return float(value)


class GridMaskGenerator:
    """The automatic mask generator's algorithm for any promptable model: what a model brings is
    its predictor (SamAutomaticMaskGenerator, genfast.sam.sam2.automatic's SAM2AutomaticMaskGenerator).

    A predictor here has set_image(image), reset_image(), device, input_frame(points [N, 2] crop
    pixels as float64, crop size) -> float32 points in the model's input frame, and
    predict_low_res_torch(coords [B, 1, 2], labels [B, 1], multimask_output=...) -> (unclamped
    low-res logits [B, M, h, w], IoUs [B, M]), summarize_masks(low_res [M, h, w], threshold,
    offset) -> the masks at the crop's size as genfast.sam.masks.FullSizeMasks (stability, boxes,
    column_runs(rows)), and decoder_bytes_per_prompt() (what the decoding's pieces are sized by).
    """

    point_dtype = torch.float64  # of the prompt points in the records (the official packages differ)

    def __init__(
        self,
        predictor: Any,
        mask_threshold: float,
        points_per_side: int | None,
        points_per_batch: int,
        pred_iou_thresh: float,
        stability_score_thresh: float,
        stability_score_offset: float,
        box_nms_thresh: float,
        crop_n_layers: int,
        crop_nms_thresh: float,
        crop_overlap_ratio: float,
        crop_n_points_downscale_factor: int,
        point_grids: list[np.ndarray] | None,
        min_mask_region_area: int,
        output_mode: str,
    ) -> None:
        if (points_per_side is None) == (point_grids is None):
            raise UserError(
                "pass exactly one of points_per_side (a regular grid of prompts) or point_grids "
                "(explicit normalized points per crop layer), "
                f"got {'both' if point_grids is not None else 'neither'}"
            )
        self.crop_n_layers = _integer("crop_n_layers", crop_n_layers, 0)
        self.crop_n_points_downscale_factor = _integer(
            "crop_n_points_downscale_factor", crop_n_points_downscale_factor, 1
        )
        if points_per_side is not None:
            points_per_side = _integer("points_per_side", points_per_side, 1)
            last = int(points_per_side / self.crop_n_points_downscale_factor**self.crop_n_layers)
            if last < 1:
                raise UserError(
                    f"points_per_side {points_per_side} leaves crop layer {self.crop_n_layers} with no "
                    f"points after downscaling by {self.crop_n_points_downscale_factor} a layer; "
                    "use more points, fewer crop layers or a smaller downscale factor"
                )
            self.point_grids = build_all_layer_point_grids(
                points_per_side, self.crop_n_layers, self.crop_n_points_downscale_factor
            )
        else:
            self.point_grids = self._check_point_grids(point_grids)
        if output_mode not in OUTPUT_MODES:
            raise UserError(f"output_mode must be one of {', '.join(map(repr, OUTPUT_MODES))}, got {output_mode!r}")
        if output_mode == "coco_rle":
            coco_encode_rle({"size": [1, 1], "counts": [1]})  # fails now, not after the work, without pycocotools
        self.predictor = predictor
        self.mask_threshold = _number("mask_threshold", mask_threshold)
        self.points_per_batch = _integer("points_per_batch", points_per_batch, 1)
        # On the CPU a batch's points are decoded in pieces whose largest intermediates stay below
        # malloc's mapping threshold (genfast/platform/heap.py): at 64 points they are hundreds of
        # MB, faulted in afresh at every call otherwise. The masks are the same. A GPU's caching
        # allocator reuses its memory, and wants the whole batch at once.
        self.points_per_decode = self.points_per_batch
        if predictor.device.type == "cpu":
            pieces = items_per_piece(predictor.decoder_bytes_per_prompt())
            self.points_per_decode = min(self.points_per_batch, pieces)
        self.pred_iou_thresh = _number("pred_iou_thresh", pred_iou_thresh)
        self.stability_score_thresh = _number("stability_score_thresh", stability_score_thresh)
        self.stability_score_offset = _number("stability_score_offset", stability_score_offset, 0)
        self.box_nms_thresh = _fraction("box_nms_thresh", box_nms_thresh)
        self.crop_nms_thresh = _fraction("crop_nms_thresh", crop_nms_thresh)
        self.crop_overlap_ratio = _fraction("crop_overlap_ratio", crop_overlap_ratio, upper_open=True)
        self.min_mask_region_area = _integer("min_mask_region_area", min_mask_region_area, 0)
        self.output_mode = output_mode

    def _decode_batch(self, prompts: Tensor) -> tuple[Tensor, Tensor]:
        """`_decode` of a batch of points [B, 1, 2], in pieces of points_per_decode."""
        return in_pieces(self._decode, prompts, self.points_per_decode)

    def _decode(self, prompts: Tensor) -> tuple[Tensor, Tensor]:
        """Low-res logits [B, M, h, w] and IoUs [B, M] for single foreground points [B, 1, 2]."""
        return self.predictor.predict_low_res_torch(prompts, foreground_labels(prompts), multimask_output=True)

    def _check_point_grids(self, point_grids: Any) -> list[Tensor]:
        if not isinstance(point_grids, (list, tuple)) or len(point_grids) < self.crop_n_layers + 1:
            raise UserError(
                f"point_grids must be a list of crop_n_layers + 1 = {self.crop_n_layers + 1} "
                "arrays of normalized (x, y) points, one per crop layer"
            )
        grids = []
        for i, grid in enumerate(point_grids):
            grid = torch.as_tensor(np.asarray(grid, dtype=np.float64))
            if grid.dim() != 2 or grid.shape[1] != 2 or grid.shape[0] == 0:
                raise UserError(
                    f"point_grids[{i}] must be [N, 2] (x, y) points with N >= 1, got shape {list(grid.shape)}"
                )
            if not bool(((grid >= 0) & (grid <= 1)).all()):
                raise UserError(
                    f"point_grids[{i}] must hold points normalized to [0, 1] (fractions of the crop's width and height)"
                )
            grids.append(grid)
        return grids

    @torch.no_grad()
    def generate(self, image: np.ndarray) -> list[dict[str, Any]]:
        """Masks for an HxWx3 uint8 RGB image: one record per mask, with keys

        segmentation (per output_mode), area (pixels), bbox ([x, y, w, h], inclusive pixel
        coordinates: a one-pixel mask has w = h = 0), predicted_iou, point_coords ([[x, y]], the
        prompt), stability_score and crop_box ([x, y, w, h] of the crop it came from). Sorted by
        the NMS passes: within a crop by decreasing predicted IoU.
        """
        check_image(image)
        data = self._generate_masks(image).cpu()
        if self.min_mask_region_area > 0:
            data = self.postprocess_small_regions(
                data, self.min_mask_region_area, max(self.box_nms_thresh, self.crop_nms_thresh)
            )
        if self.output_mode == "coco_rle":
            segmentations = [coco_encode_rle(rle) for rle in data.rles]
        elif self.output_mode == "binary_mask":
            segmentations = [rle_to_mask(rle).contiguous().numpy() for rle in data.rles]
        else:
            segmentations = data.rles
        boxes = box_xyxy_to_xywh(data.boxes).tolist()
        crop_boxes = box_xyxy_to_xywh(data.crop_boxes).tolist()
        ious = data.iou_preds.float().tolist()
        stabilities = data.stability_scores.float().tolist()
        points = data.points.tolist()
        return [
            {
                "segmentation": segmentations[i],
                "area": area_from_rle(data.rles[i]),
                "bbox": boxes[i],
                "predicted_iou": ious[i],
                "point_coords": [points[i]],
                "stability_score": stabilities[i],
                "crop_box": crop_boxes[i],
            }
            for i in range(len(data.rles))
        ]

    def _generate_masks(self, image: np.ndarray) -> MaskData:
        image_size = (image.shape[0], image.shape[1])
        crop_boxes, layers = generate_crop_boxes(image_size, self.crop_n_layers, self.crop_overlap_ratio)
        data = MaskData.cat(
            [self._process_crop(image, box, layer, image_size) for box, layer in zip(crop_boxes, layers)]
        )
        if len(crop_boxes) > 1:  # duplicates between crops: prefer the mask from the smaller crop
            scores = 1 / box_area(data.crop_boxes).float()
            data = data.select(nms(data.boxes, scores, self.crop_nms_thresh))
        return data

    def _process_crop(
        self, image: np.ndarray, crop_box: list[int], layer: int, image_size: tuple[int, int]
    ) -> MaskData:
        x0, y0, x1, y1 = crop_box
        crop = image[y0:y1, x0:x1]
        crop_size = (crop.shape[0], crop.shape[1])
        self.predictor.set_image(crop)
        device = self.predictor.device
        # Prompts in the crop's pixels (float64, kept for the records) and in the model's frame.
        points = (self.point_grids[layer] * torch.tensor(crop_size[::-1], dtype=torch.float64)).to(self.point_dtype)
        prompts = self.predictor.input_frame(points, crop_size)
        # Made once per crop: a tensor built from host values in the loop would wait for the device.
        crop_edges = torch.tensor([crop_box, [0, 0, image_size[1], image_size[0]]], dtype=torch.float32, device=device)
        step = self.points_per_batch
        batches = [self._process_batch(prompts[i : i + step], i, crop_edges) for i in range(0, len(prompts), step)]
        self.predictor.reset_image()

        point_index, iou_preds, stability, boxes = (torch.cat(parts) for parts in zip(*(b[:4] for b in batches)))
        kept = nms(boxes, iou_preds, self.box_nms_thresh)  # duplicates within the crop

        # Runs -> RLEs of the kept rows, in the image's frame (column-major flat positions).
        first_row = np.cumsum([0] + [len(b.iou_preds) for b in batches]).tolist()
        row, cols, starts, ends = (
            torch.cat(parts)
            for parts in zip(*((b.runs[0] + first, *b.runs[1:]) for b, first in zip(batches, first_row)))
        )
        flat = (cols + x0) * image_size[0] + y0
        rles = runs_to_rles(row, flat + starts, flat + ends, kept.tolist(), image_size)
        return MaskData(
            rles=rles,
            boxes=uncrop_boxes_xyxy(boxes[kept], crop_box),
            iou_preds=iou_preds[kept],
            stability_scores=stability[kept],
            points=uncrop_points(points[point_index[kept].cpu()], crop_box),
            crop_boxes=torch.tensor([crop_box], dtype=torch.int64, device=device).expand(len(kept), 4),
        )

    def _process_batch(self, prompts: Tensor, first_point: int, crop_edges: Tensor) -> _Batch:
        """Decode a batch of point prompts [B, 2] (the crop's points from first_point on) and keep
        the masks that pass the filters. crop_edges: [[crop box], [image box]] (XYXY, float32, on
        the device).

        Three host syncs, each the size of a data-dependent selection: the masks passing the IoU
        filter are compacted first (upscaling and the full-resolution passes that follow then skip
        the masks it drops), then those passing the stability and crop-edge filters, whose column runs are the
        third. Compacting keeps work and memory to the masks that survive; nothing else waits for
        the device.
        """
        low_res, iou_preds = self._decode_batch(prompts[:, None, :])
        per_point = iou_preds.shape[1]
        low_res, iou_preds = low_res.flatten(0, 1), iou_preds.flatten(0, 1)
        rows = torch.arange(len(iou_preds), device=iou_preds.device)
        if self.pred_iou_thresh > 0:
            rows = (iou_preds > self.pred_iou_thresh).nonzero().squeeze(1)
            low_res, iou_preds = low_res[rows], iou_preds[rows]
        # At the image's size after the IoU filter: each mask on its own, so dropped masks cost nothing.
        masks = self.predictor.summarize_masks(low_res, self.mask_threshold, self.stability_score_offset)
        keep = ~is_box_near_crop_edge(masks.boxes, crop_edges[0], crop_edges[1])
        if self.stability_score_thresh > 0:
            keep &= masks.stability >= self.stability_score_thresh
        kept = keep.nonzero().squeeze(1)
        return _Batch(
            first_point + rows[kept] // per_point,
            iou_preds[kept],
            masks.stability[kept],
            masks.boxes[kept],
            masks.column_runs(kept),
        )

    @staticmethod
    def postprocess_small_regions(data: MaskData, min_area: int, nms_thresh: float) -> MaskData:
        """Fill holes and drop islands smaller than min_area pixels in every mask, then remove the
        duplicates this creates by box NMS, preferring masks that needed no change. On the host."""
        if not data.rles:
            return data
        boxes, unchanged, changed = [], [], {}
        for i, rle in enumerate(data.rles):
            mask, filled = remove_small_regions(rle_to_mask(rle), min_area, "holes")
            mask, dropped = remove_small_regions(mask, min_area, "islands")
            if filled or dropped:
                changed[i] = mask
            unchanged.append(float(not (filled or dropped)))
            boxes.append(masks_to_boxes(mask))
        new_boxes = torch.stack(boxes)
        keep = nms(new_boxes, torch.tensor(unchanged), nms_thresh)
        rles, data_boxes = list(data.rles), data.boxes.cpu().clone()
        for i in keep.tolist():
            if i in changed:
                rles[i] = mask_to_rle(changed[i][None])[0]
                data_boxes[i] = new_boxes[i]
        return MaskData(rles, data_boxes, data.iou_preds, data.stability_scores, data.points, data.crop_boxes).select(
            keep
        )


def foreground_labels(prompts: Tensor) -> Tensor:
    """The labels of point prompts [B, N, 2] that are all foreground: ones [B, N] (int32)."""
    return torch.ones(prompts.shape[:2], dtype=torch.int32, device=prompts.device)


class SamAutomaticMaskGenerator(GridMaskGenerator):
    def __init__(
        self,
        model: Sam,
        points_per_side: int | None = 32,
        points_per_batch: int = 64,
        pred_iou_thresh: float = 0.88,
        stability_score_thresh: float = 0.95,
        stability_score_offset: float = 1.0,
        box_nms_thresh: float = 0.7,
        crop_n_layers: int = 0,
        crop_nms_thresh: float = 0.7,
        crop_overlap_ratio: float = 512 / 1500,
        crop_n_points_downscale_factor: int = 1,
        point_grids: list[np.ndarray] | None = None,
        min_mask_region_area: int = 0,
        output_mode: str = "binary_mask",
    ) -> None:
        """Masks for a whole image from a grid of point prompts (defaults tuned for ViT-H).

        points_per_side: a points_per_side**2 grid over each crop (layer i of crops:
        points_per_side / crop_n_points_downscale_factor**i a side); or point_grids: one array of
        (x, y) points normalized to [0, 1] per crop layer. Exactly one of the two.
        points_per_batch: prompts decoded and filtered together (memory vs speed); the decoder
        takes them in pieces small enough for malloc to reuse their memory (a few points each).
        pred_iou_thresh, stability_score_thresh: keep masks scoring above/at these (0 disables);
        the stability score is the IoU of the mask thresholded at +-stability_score_offset.
        box_nms_thresh: box IoU above which a lower-scoring mask of the same crop is a duplicate.
        crop_n_layers: also run on crops, layer i a 2**i x 2**i grid of crops overlapping by
        crop_overlap_ratio of the short side (layer 1); crop_nms_thresh removes duplicates between
        crops. min_mask_region_area: fill holes and drop islands smaller than this many pixels.
        output_mode: records hold masks as HxW bool arrays ("binary_mask"), uncompressed RLEs
        ("uncompressed_rle", column-major counts) or COCO RLEs ("coco_rle", needs pycocotools).
        """
        if not isinstance(model, Sam):
            raise UserError(
                f"model must be a genfast SAM model (genfast.sam.build_sam or load_sam_checkpoint), "
                f"got {type(model).__name__}"
            )
        super().__init__(
            SamPredictor(model),
            model.mask_threshold,
            points_per_side,
            points_per_batch,
            pred_iou_thresh,
            stability_score_thresh,
            stability_score_offset,
            box_nms_thresh,
            crop_n_layers,
            crop_nms_thresh,
            crop_overlap_ratio,
            crop_n_points_downscale_factor,
            point_grids,
            min_mask_region_area,
            output_mode,
        )
