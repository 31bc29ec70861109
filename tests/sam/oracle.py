"""The original `segment-anything` package as a test oracle (imported through
genfast.sam.original, which stubs its torchvision imports).

The stubbed resize raises (give an original predictor genfast's resize with
`genfast.sam.original.use_genfast_resize`);
NMS and box areas, which the original automatic mask generator needs, are plain reference
implementations of torchvision's semantics written here, independent of genfast's.
"""

from __future__ import annotations

import types

import numpy as np
import torch

from genfast.sam import original
from genfast.sam.config import SamConfig


def reference_box_area(boxes: torch.Tensor) -> torch.Tensor:
    return (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])


def _reference_iou(a: list[float], b: list[float]) -> float:
    """torchvision's NMS overlap: float32 arithmetic, NaN (never above a threshold) for 0 / 0."""
    a, b = [np.float32(v) for v in a], [np.float32(v) for v in b]
    w = max(np.float32(0), min(a[2], b[2]) - max(a[0], b[0]))
    h = max(np.float32(0), min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union != 0 else float("nan")


def reference_batched_nms(
    boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor, iou_threshold: float
) -> torch.Tensor:
    """Greedy NMS, plainly: visit boxes by decreasing score (ties in input order) and keep each one
    whose IoU with every kept box of its category is at most iou_threshold (compared as a double)."""
    box_list, score_list, cats = boxes.tolist(), scores.tolist(), idxs.tolist()
    keep: list[int] = []
    for i in sorted(range(len(box_list)), key=lambda i: -score_list[i]):
        if all(cats[k] != cats[i] or not _reference_iou(box_list[k], box_list[i]) > iou_threshold for k in keep):
            keep.append(i)
    return torch.tensor(keep, dtype=torch.int64)


def import_segment_anything() -> types.ModuleType:
    """The original package, its torchvision NMS and box area given by the references above."""
    return original.import_segment_anything(
        {"ops.boxes.batched_nms": reference_batched_nms, "ops.boxes.box_area": reference_box_area}
    )


def build_original_sam(config: SamConfig) -> torch.nn.Module:
    import_segment_anything()
    return original.build_original_sam(config)


def randomize_(model: torch.nn.Module, scale: float = 0.1, seed: int = 0) -> None:
    """Perturb every parameter and buffer, so zero-initialized ones (relative and absolute
    positions, biases) and unit LayerNorm scales are exercised too."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.add_(torch.randn(tensor.shape, generator=gen) * scale)
