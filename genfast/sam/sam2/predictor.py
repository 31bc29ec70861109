"""SAM2ImagePredictor: the official package's image predictor (same calls, arguments and results),
so code written for `sam2.sam2_image_predictor` runs by changing the import.

An image is resized to the model's square input (no aspect ratio kept, as the official model was
trained), encoded once, then prompts are decoded against it. Prompts are in the original image's
pixels (or in [0, 1] with normalize_coords=False). A box is passed to the decoder as two corner
points (labels 2 and 3) ahead of any clicks, as the official predictor does.

Small holes and specks in the masks can be removed (max_hole_area, max_sprinkle_area, in low-res
pixels): the official package does so only with its CUDA extension and silently skips it
otherwise; here it runs on every device (genfast.sam.masks.connected_components).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from genfast.errors import UserError
from genfast.kernels.upsampled_masks import ops as upsampled_masks
from genfast.sam.masks import FullSizeMasks, UpsampledMasks, connected_components
from genfast.sam.modeling.mask_decoder import bytes_per_prompt
from genfast.sam.predictor import check_image
from genfast.sam.sam2.modeling.decoder import upsample_logits
from genfast.sam.sam2.modeling.model import PIXEL_MEAN, PIXEL_STD, Sam2

LOW_RES_LOGIT_BOUND = 32.0  # the official predictor clamps returned low-res logits so


def preprocess(image: np.ndarray, size: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """An HxWx3 uint8 RGB image -> the model's input [3, size, size]: resized bilinearly with
    antialiasing (as torchvision resizes tensors), scaled to [0, 1] and normalized."""
    if not image.flags.writeable:  # e.g. a PIL image's buffer: torch would warn about sharing it
        image = image.copy()
    x = torch.from_numpy(np.ascontiguousarray(image)).to(device).permute(2, 0, 1).float().div_(255)
    x = F.interpolate(x[None], size=(size, size), mode="bilinear", align_corners=False, antialias=True)[0]
    mean = torch.tensor(PIXEL_MEAN, device=device)[:, None, None]
    std = torch.tensor(PIXEL_STD, device=device)[:, None, None]
    return ((x - mean) / std).to(dtype)


def as_rgb_array(image: np.ndarray | Image.Image, what: str = "image") -> np.ndarray:
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("RGB"))
    check_image(image, what)
    return image


class SAM2ImagePredictor:
    def __init__(
        self, sam_model: Sam2, mask_threshold: float = 0.0, max_hole_area: float = 0.0, max_sprinkle_area: float = 0.0
    ) -> None:
        self.model = sam_model
        self.mask_threshold = mask_threshold
        self.max_hole_area = max_hole_area
        self.max_sprinkle_area = max_sprinkle_area
        self.reset_predictor()

    @classmethod
    def from_pretrained(cls, model_id: str, **kwargs: float) -> SAM2ImagePredictor:
        """A predictor for a named model ('sam2.1-hiera-tiny', or the hub's
        'facebook/sam2.1-hiera-tiny'), from genfast's cache (`genfast pull NAME` fills it)."""
        from genfast.sam.sam2.build import load_sam2

        return cls(load_sam2(model_id), **kwargs)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def decoder_bytes_per_prompt(self) -> int:
        """The mask decoder's largest intermediate for one prompt, in bytes (for decoding many
        prompts in pieces: genfast/sam/automatic.py)."""
        return bytes_per_prompt(self.model.sam_prompt_encoder, self.model.dtype)

    def reset_predictor(self) -> None:
        self._is_image_set = False
        self._is_batch = False
        self._features: dict[str, Tensor | tuple[Tensor, Tensor]] | None = None
        self._orig_hw: list[tuple[int, int]] = []

    # ---- images ------------------------------------------------------------------------------

    @torch.no_grad()
    def set_image(self, image: np.ndarray | Image.Image) -> None:
        """Encode one image (HxWx3 uint8 RGB array, or a PIL image) for the following predict calls."""
        self._encode([as_rgb_array(image)])

    @torch.no_grad()
    def set_image_batch(self, image_list: Sequence[np.ndarray]) -> None:
        """Encode several images (any sizes) in one encoder call, for predict_batch."""
        if not isinstance(image_list, (list, tuple)) or not image_list:
            raise UserError("set_image_batch takes a non-empty list of HxWx3 uint8 RGB images")
        self._encode([as_rgb_array(image, f"image {i}") for i, image in enumerate(image_list)])
        self._is_batch = True

    def _encode(self, images: list[np.ndarray]) -> None:
        self.reset_predictor()
        size, device, dtype = self.model.image_size, self.device, self.model.dtype
        batch = torch.stack([preprocess(image, size, device, dtype) for image in images])
        embedding, high_res = self.model.image_embeddings(batch)
        self._features = {"image_embed": embedding, "high_res_feats": high_res}
        self._orig_hw = [tuple(image.shape[:2]) for image in images]
        self._is_image_set = True

    def get_image_embedding(self) -> Tensor:
        """The set image(s)' embedding [num_images, C, 64, 64] (no-memory embedding included)."""
        self._require_image()
        return self._features["image_embed"]

    def _require_image(self) -> None:
        if not self._is_image_set:
            raise UserError("no image is set: call set_image(...) (or set_image_batch) before predicting")

    # ---- prompts -----------------------------------------------------------------------------

    def predict(
        self,
        point_coords: np.ndarray | None = None,
        point_labels: np.ndarray | None = None,
        box: np.ndarray | None = None,
        mask_input: np.ndarray | None = None,
        multimask_output: bool = True,
        return_logits: bool = False,
        normalize_coords: bool = True,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Masks for a prompt on the set image.

        point_coords [N, 2] (x, y) with point_labels [N] (1 foreground, 0 background), or a batch
        [B, N, 2] / [B, N]; box [4] or boxes [B, 4] (x0, y0, x1, y1); mask_input [1, 256, 256] (or
        [B, 1, 256, 256]) low-res logits of an earlier call. Returns masks [C, H, W] (bool, or
        logits with return_logits), IoU predictions [C] and low-res logits [C, 256, 256], with a
        leading B for batched prompts; C is 3 with multimask_output, else 1.
        """
        self._require_image()
        if self._is_batch and len(self._orig_hw) > 1:
            raise UserError(f"{len(self._orig_hw)} images are set: use predict_batch")
        prompt = self._prep_prompts(point_coords, point_labels, box, mask_input, normalize_coords, 0)
        masks, iou, low_res = self.predict_torch(*prompt, multimask_output, return_logits, img_idx=0)
        return tuple(_to_numpy(t.squeeze(0)) for t in (masks, iou, low_res))

    def predict_batch(
        self,
        point_coords_batch: Sequence[np.ndarray | None] | None = None,
        point_labels_batch: Sequence[np.ndarray | None] | None = None,
        box_batch: Sequence[np.ndarray | None] | None = None,
        mask_input_batch: Sequence[np.ndarray | None] | None = None,
        multimask_output: bool = True,
        return_logits: bool = False,
        normalize_coords: bool = True,
    ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
        """`predict` for each image of set_image_batch: element i of each list is image i's prompt."""
        self._require_image()
        if not self._is_batch:
            raise UserError("predict_batch needs images set with set_image_batch(...)")
        n = len(self._orig_hw)
        columns = [point_coords_batch, point_labels_batch, box_batch, mask_input_batch]
        for name, column in zip(("point_coords", "point_labels", "box", "mask_input"), columns):
            if column is not None and len(column) != n:
                raise UserError(f"{name}_batch has {len(column)} entries for {n} images")
        results: tuple[list, list, list] = ([], [], [])
        for i in range(n):
            prompt = self._prep_prompts(*(c[i] if c is not None else None for c in columns), normalize_coords, i)
            out = self.predict_torch(*prompt, multimask_output, return_logits, img_idx=i)
            for store, tensor in zip(results, out):
                store.append(_to_numpy(tensor.squeeze(0)))
        return results

    def _prep_prompts(
        self,
        point_coords: np.ndarray | None,
        point_labels: np.ndarray | None,
        box: np.ndarray | None,
        mask_input: np.ndarray | None,
        normalize_coords: bool,
        img_idx: int,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
        """numpy prompts -> tensors in the model's input frame, with a leading batch dimension."""
        coords = labels = boxes = masks = None
        if (point_coords is None) != (point_labels is None):
            raise UserError("point_coords and point_labels must be given together (one label per point)")
        if point_coords is not None:
            coords = torch.as_tensor(np.asarray(point_coords), dtype=torch.float32, device=self.device)
            labels = torch.as_tensor(np.asarray(point_labels), dtype=torch.int32, device=self.device)
            if coords.dim() == 2:
                coords, labels = coords[None], labels[None]
            if coords.dim() != 3 or coords.shape[-1] != 2 or tuple(labels.shape) != tuple(coords.shape[:2]):
                raise UserError(
                    "point_coords must be [N, 2] (x, y) with point_labels [N] (or [B, N, 2] with [B, N]); "
                    f"got shapes {list(coords.shape)} and {list(labels.shape)}"
                )
            coords = self._to_input_frame(coords, normalize_coords, img_idx)
        if box is not None:
            boxes = torch.as_tensor(np.asarray(box), dtype=torch.float32, device=self.device)
            if boxes.shape[-1] != 4 or boxes.dim() > 2:
                raise UserError(f"box must be [4] or [B, 4] (x0, y0, x1, y1), got shape {list(boxes.shape)}")
            boxes = self._to_input_frame(boxes.reshape(-1, 2, 2), normalize_coords, img_idx)
        if mask_input is not None:
            masks = torch.as_tensor(np.asarray(mask_input), dtype=torch.float32, device=self.device)
            if masks.dim() == 3:
                masks = masks[None]
            expected = tuple(self.model.sam_prompt_encoder.mask_input_size)
            if masks.dim() != 4 or masks.shape[1] != 1 or tuple(masks.shape[2:]) != expected:
                raise UserError(
                    f"mask_input must be [1, {expected[0]}, {expected[1]}] low-res logits (a previous call's "
                    f"low_res_masks[i:i+1]), got shape {list(masks.shape)}"
                )
        return coords, labels, boxes, masks

    def _to_input_frame(self, coords: Tensor, normalize: bool, img_idx: int) -> Tensor:
        if normalize:
            h, w = self._orig_hw[img_idx]
            coords = coords / torch.tensor([w, h], dtype=coords.dtype, device=coords.device)
        return coords * self.model.image_size

    @torch.no_grad()
    def predict_torch(
        self,
        point_coords: Tensor | None,
        point_labels: Tensor | None,
        boxes: Tensor | None = None,
        mask_input: Tensor | None = None,
        multimask_output: bool = True,
        return_logits: bool = False,
        img_idx: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Masks for B prompts already in the input frame (coords [B, N, 2] with labels [B, N],
        boxes [B, 2, 2] as corners, mask_input [B, 1, 256, 256]): masks [B, C, H, W], IoUs [B, C],
        low-res logits [B, C, 256, 256]. Reads no device values (no host sync on a GPU)."""
        low_res, iou = self.predict_low_res_torch(
            point_coords, point_labels, boxes, mask_input, multimask_output, img_idx
        )
        masks = self.upscale_masks(low_res, img_idx, return_logits)
        return masks, iou, low_res.clamp(-LOW_RES_LOGIT_BOUND, LOW_RES_LOGIT_BOUND)

    @torch.no_grad()
    def predict_low_res_torch(
        self,
        point_coords: Tensor | None,
        point_labels: Tensor | None,
        boxes: Tensor | None = None,
        mask_input: Tensor | None = None,
        multimask_output: bool = True,
        img_idx: int = 0,
    ) -> tuple[Tensor, Tensor]:
        """predict_torch without the upscaling: fp32 low-res logits (unclamped) and IoUs."""
        self._require_image()
        points = (point_coords, point_labels) if point_coords is not None else None
        if boxes is not None:
            corners = torch.tensor([[2, 3]], dtype=torch.int32, device=boxes.device).expand(boxes.shape[0], -1)
            if points is None:
                points = (boxes, corners)
            else:
                points = (torch.cat([boxes, points[0]], dim=1), torch.cat([corners, points[1]], dim=1))
        model = self.model
        if mask_input is not None:
            mask_input = mask_input.to(model.dtype)
        sparse, dense = model.sam_prompt_encoder(points, None, mask_input)
        embedding = self._features["image_embed"][img_idx : img_idx + 1]
        high_res = tuple(level[img_idx : img_idx + 1] for level in self._features["high_res_feats"])
        low_res, iou, _, _ = model.sam_mask_decoder(
            embedding, model.sam_prompt_encoder.get_dense_pe(), sparse, dense, multimask_output, high_res
        )
        return low_res.float(), iou.float()

    def upscale_masks(self, low_res: Tensor, img_idx: int = 0, return_logits: bool = False) -> Tensor:
        """Low-res logits [B, C, h, w] -> masks at image img_idx's size (bool, or logits)."""
        masks = self.postprocess_masks(low_res, self._orig_hw[img_idx])
        return masks if return_logits else masks > self.mask_threshold

    def summarize_masks(
        self, low_res: Tensor, threshold: float, offset: float, img_idx: int = 0
    ) -> FullSizeMasks | UpsampledMasks:
        """Low-res logits [M, h, w] as the automatic generator measures them at image img_idx's
        size (stability at threshold +- offset, boxes, column runs): postprocess_masks' masks,
        which the native kernel measures without making them where it takes the logits."""
        low_res, size = self._fill_small_regions(low_res), self._orig_hw[img_idx]
        if upsampled_masks.takes(low_res):
            return UpsampledMasks(low_res, size, threshold, offset)
        return FullSizeMasks(upsample_logits(low_res[:, None], size)[:, 0], threshold, offset)

    def input_frame(self, points: Tensor, image_size: tuple[int, int]) -> Tensor:
        """(x, y) pixel points [N, 2] of an image of image_size (H, W) -> float32 points in the
        model's input frame, on the model's device (for the automatic mask generator)."""
        h, w = image_size
        points = points.to(self.device, torch.float32)
        return points / torch.tensor([w, h], dtype=torch.float32, device=self.device) * self.model.image_size

    def reset_image(self) -> None:
        """reset_predictor under the name genfast's SAM predictor uses."""
        self.reset_predictor()

    def postprocess_masks(self, low_res: Tensor, orig_hw: tuple[int, int]) -> Tensor:
        """Low-res logits [B, C, h, w] -> logits at the original size, after removing holes and
        specks smaller than max_hole_area / max_sprinkle_area low-res pixels."""
        return upsample_logits(self._fill_small_regions(low_res), orig_hw)

    def _fill_small_regions(self, logits: Tensor) -> Tensor:
        """logits [..., h, w] with holes and specks up to max_hole_area / max_sprinkle_area pixels
        filled (unchanged where both are 0)."""
        if self.max_hole_area <= 0 and self.max_sprinkle_area <= 0:
            return logits
        flat = logits.reshape(-1, *logits.shape[-2:])
        out = []
        for mask in flat:
            foreground = mask > self.mask_threshold
            if self.max_hole_area > 0:  # small background regions become foreground
                mask = torch.where(_small_regions(~foreground, self.max_hole_area), self.mask_threshold + 10.0, mask)
            if self.max_sprinkle_area > 0:  # small foreground regions become background
                foreground = mask > self.mask_threshold
                mask = torch.where(_small_regions(foreground, self.max_sprinkle_area), self.mask_threshold - 10.0, mask)
            out.append(mask)
        return torch.stack(out).reshape(logits.shape)


def _small_regions(region: Tensor, max_area: float) -> Tensor:
    """Pixels of `region` (8-connected) whose component has at most max_area pixels."""
    labels, sizes = connected_components(region.cpu(), connectivity=8)
    small = torch.cat([torch.zeros(1, dtype=torch.bool), sizes <= max_area])
    return small[labels].to(region.device)


def _to_numpy(t: Tensor) -> np.ndarray:
    return (t.float() if t.is_floating_point() else t).cpu().numpy()
