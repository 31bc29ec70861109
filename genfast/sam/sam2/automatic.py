"""SAM2AutomaticMaskGenerator: masks for everything in an image (the official package's class:
same parameters, defaults and records), on genfast's grid generator (genfast/sam/automatic.py).

Beyond SAM's generator, SAM 2's has `multimask_output` (three masks a point, or one) and
`use_m2m`: each candidate mask is decoded again with itself as the mask prompt (and its point),
one mask out, which refines its edges at the cost of a second decoder pass.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from genfast.errors import UserError
from genfast.sam.automatic import GridMaskGenerator
from genfast.sam.sam2.modeling.model import Sam2
from genfast.sam.sam2.predictor import LOW_RES_LOGIT_BOUND, SAM2ImagePredictor


class SAM2AutomaticMaskGenerator(GridMaskGenerator):
    point_dtype = torch.float32  # the official generator's prompt points

    def __init__(
        self,
        model: Sam2,
        points_per_side: int | None = 32,
        points_per_batch: int = 64,
        pred_iou_thresh: float = 0.8,
        stability_score_thresh: float = 0.95,
        stability_score_offset: float = 1.0,
        mask_threshold: float = 0.0,
        box_nms_thresh: float = 0.7,
        crop_n_layers: int = 0,
        crop_nms_thresh: float = 0.7,
        crop_overlap_ratio: float = 512 / 1500,
        crop_n_points_downscale_factor: int = 1,
        point_grids: list[np.ndarray] | None = None,
        min_mask_region_area: int = 0,
        output_mode: str = "binary_mask",
        use_m2m: bool = False,
        multimask_output: bool = True,
    ) -> None:
        """Parameters as genfast.sam.automatic.SamAutomaticMaskGenerator's, plus mask_threshold
        (logits above it are inside a mask), use_m2m and multimask_output (see the module).
        min_mask_region_area also removes holes and specks that small from the decoder's masks,
        as the official generator does (where its CUDA extension is built)."""
        if not isinstance(model, Sam2):
            raise UserError(
                f"model must be a genfast SAM 2 model (genfast.sam.sam2.build.load_sam2), got {type(model).__name__}"
            )
        area = max(int(min_mask_region_area), 0) if isinstance(min_mask_region_area, int) else 0
        # The official generator leaves its predictor's threshold (used for the hole filling) at 0.
        predictor = SAM2ImagePredictor(model, max_hole_area=area, max_sprinkle_area=area)
        super().__init__(
            predictor,
            mask_threshold,
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
        self.use_m2m = bool(use_m2m)
        self.multimask_output = bool(multimask_output)

    @classmethod
    def from_pretrained(cls, model_id: str, **kwargs: object) -> SAM2AutomaticMaskGenerator:
        """A generator for a named model ('sam2.1-hiera-tiny'; `genfast pull NAME` fetches it)."""
        from genfast.sam.sam2.build import load_sam2

        return cls(load_sam2(model_id), **kwargs)

    def _decode(self, prompts: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        low_res, iou = self.predictor.predict_low_res_torch(prompts, labels, multimask_output=self.multimask_output)
        if not self.use_m2m:
            return low_res, iou
        b, m = iou.shape
        # Every candidate again, prompted by its point and itself (as the predictor returns it:
        # clamped), one mask out.
        mask_input = low_res.clamp(-LOW_RES_LOGIT_BOUND, LOW_RES_LOGIT_BOUND).flatten(0, 1)[:, None]
        refined, refined_iou = self.predictor.predict_low_res_torch(
            prompts.repeat_interleave(m, dim=0),
            labels.repeat_interleave(m, dim=0),
            mask_input=mask_input,
            multimask_output=False,
        )
        return refined.reshape(b, m, *refined.shape[-2:]), refined_iou.reshape(b, m)
