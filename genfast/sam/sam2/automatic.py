"""SAM2AutomaticMaskGenerator: masks for everything in an image (the official package's class:
same parameters, defaults and records), on genfast's grid generator (genfast/sam/automatic.py).

Beyond SAM's generator, SAM 2's has `multimask_output` (three masks a point, or one) and
`use_m2m`: each candidate mask is decoded again with itself as the mask prompt (and its point),
one mask out, which refines its edges at the cost of a second decoder pass.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from genfast.errors import UserError
from genfast.sam.automatic import GridMaskGenerator, foreground_labels
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
        # The recipe's compile step: batches of points decoded by one compiled module (m2m's
        # second pass, prompted by masks, stays eager).
        compiler = model.grid_decoder_compiler
        self._grid_decoder = compiler(GridDecoder(model)) if compiler is not None and not self.use_m2m else None

    @classmethod
    def from_pretrained(cls, model_id: str, **kwargs: object) -> SAM2AutomaticMaskGenerator:
        """A generator for a named model ('sam2.1-hiera-tiny'; `genfast pull NAME` fetches it)."""
        from genfast.sam.sam2.build import load_sam2

        return cls(load_sam2(model_id), **kwargs)

    def _decode(self, prompts: Tensor) -> tuple[Tensor, Tensor]:
        if self._grid_decoder is not None:
            return self._decode_compiled(prompts)
        labels = foreground_labels(prompts)
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

    def _decode_compiled(self, prompts: Tensor) -> tuple[Tensor, Tensor]:
        """_decode through the compiled GridDecoder. A short last piece is padded with copies of
        its last point to points_per_decode, so that every call has the one compiled shape (the
        prompts are decoded independently: the padding changes no other row)."""
        n = prompts.shape[0]
        padded = torch.cat([prompts, prompts[-1:].expand(self.points_per_decode - n, -1, -1)])
        features = self.predictor._features
        s0, s1 = features["high_res_feats"]
        low_res, iou = self._grid_decoder(padded, features["image_embed"], s0, s1, self.multimask_output)
        return low_res[:n], iou[:n]


class GridDecoder(nn.Module):
    """The generator's decoding of a batch of single foreground points against one image, as one
    module: what the recipe's compile step compiles (static shapes: one batch size of points)."""

    def __init__(self, model: Sam2) -> None:
        super().__init__()
        self.prompt_encoder = model.sam_prompt_encoder
        self.mask_decoder = model.sam_mask_decoder

    def forward(
        self, coords: Tensor, image_embed: Tensor, feat_s0: Tensor, feat_s1: Tensor, multimask_output: bool
    ) -> tuple[Tensor, Tensor]:
        """coords [B, 1, 2] in the input frame; image features of one image -> fp32 low-res logits
        [B, M, h, w] and IoUs [B, M]."""
        sparse, dense = self.prompt_encoder((coords, foreground_labels(coords)), None, None)
        low_res, iou, _, _ = self.mask_decoder(
            image_embed, self.prompt_encoder.get_dense_pe(), sparse, dense, multimask_output, (feat_s0, feat_s1)
        )
        return low_res.float(), iou.float()
