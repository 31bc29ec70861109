"""Mask and box utilities for the automatic mask generator, in torch (no torchvision, cv2 or
pycocotools): greedy NMS, boxes around masks, stability scores, point grids and crop boxes,
uncompressed RLE, and connected-component clean-up of small regions.

Semantics follow the original segment-anything (`utils/amg.py` and torchvision's NMS), so that
the same logits give the same masks, in the same order:
- boxes are XYXY with inclusive pixel coordinates (a one-pixel mask has a box of zero area) and
  IoU is computed in float32 as torchvision does, compared with the threshold as a double;
- NMS keeps boxes in order of decreasing score, ties in input order;
- RLE runs are in column-major (Fortran) order, starting with a run of zeros (possibly empty),
  as pycocotools expects: {"size": [h, w], "counts": [...]}.

Masks are handled as their *column runs* (the foreground intervals of each column): an RLE is a
relabelling of them, and they make connected components a small graph problem (runs in adjacent
columns that overlap are connected) instead of a per-pixel flood fill.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from genfast.errors import UserError
from genfast.kernels.upsampled_masks import ops as upsampled_masks

RLE = dict[str, Any]

# ---- boxes -------------------------------------------------------------------------------------


def box_area(boxes: Tensor) -> Tensor:
    """Areas of XYXY boxes [..., 4]."""
    return (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """Pairwise IoU [N, M] of XYXY boxes [N, 4] and [M, 4]; NaN where both boxes are empty
    (0 / 0), which never exceeds a threshold, as in torchvision's NMS."""
    top_left = torch.maximum(boxes1[:, None, :2], boxes2[None, :, :2])
    bottom_right = torch.minimum(boxes1[:, None, 2:], boxes2[None, :, 2:])
    wh = (bottom_right - top_left).clamp_(min=0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (box_area(boxes1)[:, None] + box_area(boxes2)[None, :] - inter)


def _largest_float32_at_most(value: float) -> float:
    """torchvision compares a float32 IoU with a double threshold; torch would round the threshold
    to float32 first, which can round up. `iou32 > t` equals `iou32 > this(t)`."""
    t32 = np.float32(value)
    if float(t32) > value:
        t32 = np.nextafter(t32, np.float32(-np.inf))
    return float(t32)


def batched_nms(
    boxes: Tensor, scores: Tensor, categories: Tensor | None, iou_threshold: float, block: int = 1024
) -> Tensor:
    """Greedy non-maximum suppression: indices of the kept boxes, by decreasing score.

    A box is dropped when its IoU with a kept, higher-scoring box of the same category exceeds
    iou_threshold (categories None: all one category). Equal scores keep their input order.
    IoUs are computed on the boxes' device a block of rows at a time (memory O(block * N)); the
    greedy pass, inherently sequential, runs on the host over the thresholded rows.
    """
    n = boxes.shape[0]
    order = torch.sort(scores, descending=True, stable=True).indices
    if n == 0:
        return order
    dtype = torch.float64 if boxes.dtype == torch.float64 else torch.float32
    boxes = boxes[order].to(dtype)
    threshold = _largest_float32_at_most(iou_threshold) if dtype == torch.float32 else iou_threshold
    if categories is not None:
        categories = categories[order]
    removed = np.zeros(n, dtype=bool)
    keep: list[int] = []
    for start in range(0, n, block):
        rows = slice(start, min(start + block, n))
        over = box_iou(boxes[rows], boxes) > threshold
        if categories is not None:
            over &= categories[rows, None] == categories[None, :]
        over = over.cpu().numpy()
        for i in range(rows.start, rows.stop):
            if not removed[i]:
                keep.append(i)
                removed |= over[i - start]  # earlier boxes it marks are settled already
    return order[torch.tensor(keep, dtype=torch.int64, device=order.device)]


def nms(boxes: Tensor, scores: Tensor, iou_threshold: float) -> Tensor:
    """batched_nms with every box in one category."""
    return batched_nms(boxes, scores, None, iou_threshold)


def masks_to_boxes(masks: Tensor) -> Tensor:
    """XYXY boxes (int64, inclusive pixel coordinates) around boolean masks [..., H, W] -> [..., 4];
    [0, 0, 0, 0] for an empty mask."""
    h, w = masks.shape[-2:]
    if masks.numel() == 0:
        return torch.zeros(*masks.shape[:-2], 4, dtype=torch.int64, device=masks.device)
    rows, cols = masks.any(-1), masks.any(-2)
    ys = torch.arange(h, device=masks.device)
    xs = torch.arange(w, device=masks.device)
    box = torch.stack(
        [
            torch.where(cols, xs, w).amin(-1),
            torch.where(rows, ys, h).amin(-1),
            torch.where(cols, xs, -1).amax(-1),
            torch.where(rows, ys, -1).amax(-1),
        ],
        dim=-1,
    )
    return torch.where(rows.any(-1, keepdim=True), box, 0)


def box_xyxy_to_xywh(boxes: Tensor) -> Tensor:
    return torch.cat([boxes[..., :2], boxes[..., 2:] - boxes[..., :2]], dim=-1)


def stability_score(logits: Tensor, mask_threshold: float, offset: float) -> Tensor:
    """IoU of the masks thresholded at mask_threshold + offset and - offset, per mask [..., H, W]:
    a mask that barely changes when its cut-off moves is a confident one. The high mask lies inside
    the low one, so the IoU is a ratio of pixel counts (NaN when both are empty)."""
    # Row counts fit int16 for widths below 2**15; summing bools to int64 would need 8 bytes a pixel.
    row_dtype = torch.int16 if logits.shape[-1] < 2**15 else torch.int32

    def count(threshold: float) -> Tensor:
        return (logits > threshold).sum(-1, dtype=row_dtype).sum(-1, dtype=torch.int32)

    return count(mask_threshold + offset) / count(mask_threshold - offset)


class FullSizeMasks:
    """The automatic generator's view of a batch of candidate masks given as logits [M, H, W] at
    the image's size: stability scores [M], XYXY boxes [M, 4] and, on request, column runs."""

    def __init__(self, logits: Tensor, threshold: float, offset: float) -> None:
        self.stability = stability_score(logits, threshold, offset)
        self._masks = logits > threshold
        self.boxes = masks_to_boxes(self._masks)

    def column_runs(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """column_runs of the masks `rows` ([K] indices), numbered 0..K-1."""
        return column_runs(self._masks[rows])


class UpsampledMasks:
    """FullSizeMasks of low-res logits [M, h, w] upsampled bilinearly to `size` (H, W), without
    the full-size logits: the native kernel upsamples on the fly (genfast/kernels/upsampled_masks).
    fp32 CPU logits only (`upsampled_masks.takes`)."""

    def __init__(self, low_res: Tensor, size: tuple[int, int], threshold: float, offset: float) -> None:
        counts, self.boxes = upsampled_masks.stats(low_res, size, threshold, offset)
        self.stability = counts[:, 0] / counts[:, 1]  # NaN for 0 / 0, as stability_score
        self._low_res, self._size, self._threshold = low_res, size, threshold

    def column_runs(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return upsampled_masks.runs(self._low_res[rows], self._size, self._threshold)


# ---- point grids and crops ---------------------------------------------------------------------


def build_point_grid(n_per_side: int) -> Tensor:
    """n*n points [n*n, 2] (x, y) at the centres of an n x n grid over [0, 1]^2, x varying fastest
    (float64; numpy's linspace so the points are bit-identical to the original's)."""
    offset = 1 / (2 * n_per_side)
    side = torch.from_numpy(np.linspace(offset, 1 - offset, n_per_side))
    y, x = torch.meshgrid(side, side, indexing="ij")
    return torch.stack([x, y], dim=-1).reshape(-1, 2)


def build_all_layer_point_grids(n_per_side: int, n_layers: int, scale_per_layer: int) -> list[Tensor]:
    """The point grid of each crop layer: layer i has n_per_side / scale_per_layer**i points a side."""
    return [build_point_grid(int(n_per_side / scale_per_layer**i)) for i in range(n_layers + 1)]


def generate_crop_boxes(
    image_size: tuple[int, int], n_layers: int, overlap_ratio: float
) -> tuple[list[list[int]], list[int]]:
    """XYXY crop boxes and their layer: the whole image (layer 0), then for layer i >= 1 a
    2**i x 2**i grid of overlapping crops (overlap_ratio of the short side in layer 1, shrinking
    with the crops), in column-major order of their corners."""
    im_h, im_w = image_size
    boxes, layers = [[0, 0, im_w, im_h]], [0]
    for layer in range(1, n_layers + 1):
        n = 2**layer
        overlap = int(overlap_ratio * min(im_h, im_w) * (2 / n))
        crop_w = math.ceil((overlap * (n - 1) + im_w) / n)
        crop_h = math.ceil((overlap * (n - 1) + im_h) / n)
        x0s = [int((crop_w - overlap) * i) for i in range(n)]
        y0s = [int((crop_h - overlap) * i) for i in range(n)]
        for x0, y0 in itertools.product(x0s, y0s):
            boxes.append([x0, y0, min(x0 + crop_w, im_w), min(y0 + crop_h, im_h)])
            layers.append(layer)
    return boxes, layers


def uncrop_boxes_xyxy(boxes: Tensor, crop_box: Sequence[int]) -> Tensor:
    """Boxes in a crop's frame -> the image's."""
    x0, y0 = crop_box[:2]
    return boxes + torch.tensor([x0, y0, x0, y0], dtype=boxes.dtype, device=boxes.device)


def uncrop_points(points: Tensor, crop_box: Sequence[int]) -> Tensor:
    """(x, y) points in a crop's frame -> the image's."""
    return points + torch.tensor(crop_box[:2], dtype=points.dtype, device=points.device)


def uncrop_masks(masks: Tensor, crop_box: Sequence[int], image_h: int, image_w: int) -> Tensor:
    """Masks [..., h, w] of a crop -> [..., H, W] of the image, zero outside the crop."""
    x0, y0, x1, y1 = crop_box
    return F.pad(masks, (x0, image_w - x1, y0, image_h - y1))


def is_box_near_crop_edge(
    boxes: Tensor, crop_box: Sequence[int] | Tensor, image_box: Sequence[int] | Tensor, atol: float = 20.0
) -> Tensor:
    """[N] True for boxes (in the crop's frame) within atol pixels of an edge of the crop that is
    not an edge of the image: such masks are likely cut off by the crop.

    Pass the XYXY boxes as float32 tensors on the boxes' device to keep a loop free of host-to-
    device copies (a blocking copy waits for the device).
    """
    crop = torch.as_tensor(crop_box, dtype=torch.float32, device=boxes.device)
    image = torch.as_tensor(image_box, dtype=torch.float32, device=boxes.device)
    boxes = boxes.float() + crop[:2].repeat(2)  # into the image's frame
    near_crop = (boxes - crop).abs() <= atol
    near_image = (boxes - image).abs() <= atol
    return (near_crop & ~near_image).any(dim=1)


# ---- runs and RLE ------------------------------------------------------------------------------


def column_runs(masks: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The foreground runs of each column of boolean masks [N, H, W]: (mask index, column,
    start row, end row (exclusive)), int64 [K] each, sorted by mask, column and start.

    One `nonzero` (a host sync on GPUs, inherent: K is data-dependent) over the column-wise
    transitions of the masks, padded with background above and below each column.
    """
    padded = F.pad(masks.transpose(1, 2), (1, 1))  # [N, W, H + 2]
    edges = (padded[..., 1:] != padded[..., :-1]).nonzero()  # alternately run starts and ends
    starts, ends = edges[0::2], edges[1::2]
    return starts[:, 0], starts[:, 1], starts[:, 2], ends[:, 2]


def runs_to_rles(
    mask_index: Tensor, starts: Tensor, ends: Tensor, wanted: Sequence[int], size: tuple[int, int]
) -> list[RLE]:
    """Uncompressed RLEs of the masks `wanted`, from their foreground runs given as column-major
    flat positions [start, end) in an image of `size` (H, W), sorted by mask and position. Only
    the wanted masks' runs are read (the automatic generator keeps a few of thousands).

    Runs that continue from the bottom of one column into the top of the next are joined, so
    every count after the first (which may be 0: the mask starts with foreground) is positive.
    """
    h, w = size
    total = h * w
    index, starts, ends = (t.cpu().numpy().astype(np.int64, copy=False) for t in (mask_index, starts, ends))
    wanted_np = np.asarray(wanted, dtype=np.int64).reshape(-1)
    first = np.searchsorted(index, wanted_np, side="left")
    last = np.searchsorted(index, wanted_np, side="right")
    rles = []
    for a, b in zip(first.tolist(), last.tolist()):
        edges = np.empty(0, dtype=np.int64)
        if b > a:
            mask_starts, mask_ends = starts[a:b], ends[a:b]
            join = mask_ends[:-1] == mask_starts[1:]
            edges = np.stack([mask_starts[np.r_[True, ~join]], mask_ends[np.r_[~join, True]]], axis=1).reshape(-1)
        counts = np.diff(edges, prepend=0, append=total)
        if len(counts) > 1 and counts[-1] == 0:  # foreground up to the last pixel
            counts = counts[:-1]
        rles.append({"size": [h, w], "counts": counts.tolist()})
    return rles


def mask_to_rle(masks: Tensor) -> list[RLE]:
    """Uncompressed RLEs (column-major, pycocotools' layout) of boolean masks [N, H, W]."""
    n, h, w = masks.shape
    index, col, start, end = column_runs(masks)
    return runs_to_rles(index, col * h + start, col * h + end, range(n), (h, w))


def rle_to_mask(rle: RLE) -> Tensor:
    """Decode an uncompressed RLE to a boolean mask [H, W] (on the CPU)."""
    h, w = rle["size"]
    counts = torch.as_tensor(rle["counts"], dtype=torch.int64)
    if int(counts.sum()) != h * w or bool((counts < 0).any()):
        raise UserError(
            f"RLE counts must be non-negative and sum to h * w = {h * w} for size {[h, w]}; "
            f"got a sum of {int(counts.sum())}"
        )
    values = torch.arange(len(counts)) % 2 == 1  # runs alternate, background first
    return values.repeat_interleave(counts).reshape(w, h).t()


def area_from_rle(rle: RLE) -> int:
    """Foreground pixels of an uncompressed RLE (its odd runs)."""
    return int(sum(rle["counts"][1::2]))


def coco_encode_rle(rle: RLE) -> RLE:
    """An uncompressed RLE -> COCO's compressed RLE (counts as a string); needs pycocotools."""
    try:
        from pycocotools import mask as mask_utils
    except ImportError:
        raise UserError(
            "output_mode 'coco_rle' needs pycocotools: pip install pycocotools, or use 'uncompressed_rle'"
        ) from None
    h, w = rle["size"]
    coco = mask_utils.frPyObjects(rle, h, w)
    coco["counts"] = coco["counts"].decode("utf-8")  # a str, so the record serializes to JSON
    return coco


# ---- connected components ----------------------------------------------------------------------


def _run_roots(cols: Tensor, starts: Tensor, ends: Tensor, height: int, connectivity: int) -> Tensor:
    """For runs of one mask sorted by (column, start): the smallest run index of each run's
    connected component.

    Runs in columns c and c + 1 touch when their row intervals overlap (8-connectivity: also
    diagonally). The runs of column c + 1 touching a run form a contiguous range, found with two
    binary searches; components then come from min-label hooking with pointer jumping, a few
    vectorized rounds instead of a per-pixel flood fill.
    """
    k = starts.numel()
    device = starts.device
    stride = height + 1
    key_start, key_end = cols * stride + starts, cols * stride + ends
    next_col = (cols + 1) * stride
    diagonal = connectivity == 8
    lo = torch.searchsorted(key_end, next_col + starts, side="left" if diagonal else "right")
    hi = torch.searchsorted(key_start, next_col + ends, side="right" if diagonal else "left")
    counts = (hi - lo).clamp_(min=0)
    src = torch.repeat_interleave(torch.arange(k, device=device), counts)
    offsets = torch.cumsum(counts, 0) - counts
    dst = lo[src] + torch.arange(src.numel(), device=device) - offsets[src]
    parent = torch.arange(k, device=device)
    while True:
        before = parent
        a, b = parent[src], parent[dst]
        low = torch.minimum(a, b)
        parent = parent.scatter_reduce(0, a, low, "amin").scatter_reduce_(0, b, low, "amin")
        while not torch.equal(grand := parent[parent], parent):  # point every run at its root
            parent = grand
        if torch.equal(parent, before):
            return parent


def _components(mask: Tensor, connectivity: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(columns, starts, ends, label of each run (1..n), sizes [n]) of mask's components, labelled
    in raster (row-major) order of their first pixel, as cv2 and scipy number them."""
    if connectivity not in (4, 8):
        raise UserError(f"connectivity must be 4 or 8, got {connectivity!r}")
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise UserError(f"expected a boolean [H, W] mask, got {mask.dtype} of shape {list(mask.shape)}")
    h, w = mask.shape
    _, cols, starts, ends = column_runs(mask[None])
    roots = _run_roots(cols, starts, ends, h, connectivity)
    unique, component = torch.unique(roots, return_inverse=True)
    n = unique.numel()
    first_pixel = torch.full((n,), h * w, dtype=torch.int64, device=mask.device)
    first_pixel.scatter_reduce_(0, component, starts * w + cols, "amin")
    rank = torch.empty_like(first_pixel)
    rank[torch.argsort(first_pixel)] = torch.arange(n, device=mask.device)
    labels = rank[component] + 1
    sizes = torch.zeros(n, dtype=torch.int64, device=mask.device).scatter_add_(0, labels - 1, ends - starts)
    return cols, starts, ends, labels, sizes


def _paint(cols: Tensor, starts: Tensor, ends: Tensor, values: Tensor, shape: tuple[int, int]) -> Tensor:
    """An [H, W] image holding values[i] on run i and 0 elsewhere (runs must not overlap)."""
    h, w = shape
    steps = torch.zeros(w * (h + 1), dtype=values.dtype, device=values.device)
    steps.index_add_(0, cols * (h + 1) + starts, values)
    steps.index_add_(0, cols * (h + 1) + ends, -values)
    return steps.view(w, h + 1).cumsum(1)[:, :h].t()


def connected_components(mask: Tensor, connectivity: int = 8) -> tuple[Tensor, Tensor]:
    """Label the connected regions of a boolean mask [H, W]: (labels [H, W] int64, 0 for
    background and 1..n in raster order of each region's first pixel; sizes [n] in pixels)."""
    cols, starts, ends, labels, sizes = _components(mask, connectivity)
    return _paint(cols, starts, ends, labels, tuple(mask.shape)), sizes


def remove_small_regions(mask: Tensor, area_thresh: float, mode: str, connectivity: int = 8) -> tuple[Tensor, bool]:
    """Fill holes ("holes") or drop islands ("islands") of fewer than area_thresh pixels in a
    boolean mask [H, W]; returns the mask and whether anything was small. When every island is
    small the largest (first in raster order among equals) is kept, so a mask never vanishes."""
    if mode not in ("holes", "islands"):
        raise UserError(f"mode must be 'holes' or 'islands', got {mode!r}")
    holes = mode == "holes"
    cols, starts, ends, labels, sizes = _components(~mask if holes else mask, connectivity)
    small = sizes < area_thresh
    if not bool(small.any()):
        return mask, False
    if holes:
        chosen = small
    else:
        chosen = ~small
        if not bool(chosen.any()):
            chosen = torch.zeros_like(small)
            chosen[torch.argmax(sizes)] = True
    run = chosen[labels - 1]
    painted = _paint(cols[run], starts[run], ends[run], torch.ones_like(starts[run]), tuple(mask.shape)) > 0
    return (mask | painted if holes else painted), True
