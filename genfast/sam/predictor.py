"""SamPredictor: encode an image once, then answer many prompts against it (the original
segment-anything interface and semantics), plus several images in one encoder call.

`predict` takes numpy prompts in the original image's pixel frame; `predict_torch` takes batched
tensors already mapped into the resized frame (`predictor.transform.apply_coords_torch`). The
torch path only checks shapes (host metadata): it never reads tensor values, so on a GPU it
queues work without waiting for the device.

Several images: `set_images([a, b])` runs the encoder once on a [2, 3, S, S] batch; then
`predict_batch([prompts_a, prompts_b])`, or `predict(..., image_index=i)` for one of them.
predict_batch decodes the prompts of all images that have the same shape (point count, box, mask
input) in one mask-decoder call, each prompt reading its own image's embedding: prompts of
different shapes cannot share a call exactly (padding points changes the decoder's answer), so
they form separate calls, as a NestedTensor would split them.

`encoder_batch_size` (for a compiled encoder): images are encoded in chunks of exactly that many,
the last one padded with blank images, so a static-shape compiled encoder never recompiles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from genfast.errors import UserError
from genfast.sam.masks import FullSizeMasks
from genfast.sam.modeling import Sam
from genfast.sam.modeling.mask_decoder import bytes_per_prompt
from genfast.sam.transforms import ResizeLongestSide

_PROMPT_KEYS = ("point_coords", "point_labels", "box", "mask_input")
NumpyResult = tuple[np.ndarray, np.ndarray, np.ndarray]
TorchPrompt = tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]


class SamPredictor:
    def __init__(self, model: Sam, encoder_batch_size: int | None = None) -> None:
        if encoder_batch_size is not None and encoder_batch_size < 1:
            raise ValueError(f"encoder_batch_size must be >= 1, got {encoder_batch_size}")
        self.model = model
        self.encoder_batch_size = encoder_batch_size
        self.transform = ResizeLongestSide(model.image_encoder.img_size)
        self.reset_image()

    # ---- state -------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.model.device

    def decoder_bytes_per_prompt(self) -> int:
        """The mask decoder's largest intermediate for one prompt, in bytes (for decoding many
        prompts in pieces: genfast/sam/automatic.py)."""
        return bytes_per_prompt(self.model.prompt_encoder, self.model.mask_decoder.iou_token.weight.dtype)

    @property
    def num_images(self) -> int:
        return len(self.original_sizes)

    @property
    def original_size(self) -> tuple[int, int] | None:
        """(H, W) of the set image; None unless exactly one image is set."""
        return self.original_sizes[0] if self.num_images == 1 else None

    @property
    def input_size(self) -> tuple[int, int] | None:
        """(h, w) of the set image after resizing, before padding; None unless exactly one is set."""
        return self.input_sizes[0] if self.num_images == 1 else None

    def reset_image(self) -> None:
        self.is_image_set = False
        self.features: Tensor | None = None
        self.original_sizes: list[tuple[int, int]] = []
        self.input_sizes: list[tuple[int, int]] = []

    def get_image_embedding(self) -> Tensor:
        """The encoder's output for the set image(s): [num_images, C, h, w]."""
        self._require_image()
        return self.features

    # ---- images ------------------------------------------------------------------------------

    def set_image(self, image: np.ndarray, image_format: str = "RGB") -> None:
        """Encode one HxWx3 uint8 image (pixel values 0-255) for the following predictions."""
        self.set_images([image], image_format)

    def set_images(self, images: Sequence[np.ndarray], image_format: str = "RGB") -> None:
        """Encode several HxWx3 uint8 images (any sizes) in one encoder call."""
        if len(images) == 0:
            raise UserError("set_images needs at least one image")
        resized = [self._resize(image, image_format, i if len(images) > 1 else None) for i, image in enumerate(images)]
        self._encode(resized, [tuple(image.shape[:2]) for image in images])

    def set_torch_image(self, transformed_image: Tensor, original_image_size: Sequence[int]) -> None:
        """Encode an image already resized with `self.transform`: [1, 3, h, w] on the 0-255 scale,
        long side equal to the model's input size; original_image_size is (H, W) before resizing."""
        shape = tuple(transformed_image.shape)
        size = self.model.image_encoder.img_size
        if len(shape) != 4 or shape[0] != 1 or shape[1] != 3 or max(shape[2:]) != size:
            raise UserError(
                f"set_torch_image expects a [1, 3, h, w] image whose long side is {size} "
                f"(resize it with predictor.transform.apply_image_torch); got shape {list(shape)}"
            )
        if len(original_image_size) != 2 or min(original_image_size) <= 0:
            raise UserError(f"original_image_size must be (H, W) with positive sides, got {original_image_size!r}")
        self._encode([transformed_image], [tuple(int(s) for s in original_image_size)])

    def _resize(self, image: np.ndarray, image_format: str, index: int | None) -> Tensor:
        check_image(image, "image" if index is None else f"image {index}", "RGB/BGR")
        if image_format not in ("RGB", "BGR"):
            raise UserError(f"image_format must be 'RGB' or 'BGR', got {image_format!r}")
        if image_format != self.model.image_format:
            image = image[..., ::-1]
        x = torch.from_numpy(np.ascontiguousarray(image)).to(self.device).permute(2, 0, 1)[None].float()
        # Rounded like the original's uint8 resize, but done on the model's device.
        return self.transform.apply_image_torch(x).round_().clamp_(0, 255)

    @torch.no_grad()
    def _encode(self, resized: list[Tensor], original_sizes: list[tuple[int, int]]) -> None:
        self.reset_image()
        dtype = self.model.image_encoder.pos_embed.dtype
        # preprocess pads each image to S x S, so images of different sizes stack into one batch.
        batch = torch.cat([self.model.preprocess(x.to(self.device, torch.float32)) for x in resized]).to(dtype)
        chunk = self.encoder_batch_size
        if chunk is None:
            self.features = self.model.image_encoder(batch)
        else:
            n = batch.shape[0]
            batch = torch.cat([batch, batch.new_zeros(-n % chunk, *batch.shape[1:])])
            self.features = torch.cat([self.model.image_encoder(part) for part in batch.split(chunk)])[:n]
        self.input_sizes = [tuple(x.shape[-2:]) for x in resized]
        self.original_sizes = original_sizes
        self.is_image_set = True

    def _require_image(self) -> None:
        if not self.is_image_set:
            raise UserError("no image is set: call set_image(...) (or set_images) before predicting")

    def _image_index(self, image_index: int | None) -> int:
        self._require_image()
        if image_index is None:
            if self.num_images != 1:
                raise UserError(f"{self.num_images} images are set: pass image_index= or use predict_batch")
            return 0
        if not 0 <= image_index < self.num_images:
            raise UserError(f"image_index {image_index} is out of range for {self.num_images} set images")
        return image_index

    # ---- prompts -----------------------------------------------------------------------------

    def predict(
        self,
        point_coords: np.ndarray | None = None,
        point_labels: np.ndarray | None = None,
        box: np.ndarray | None = None,
        mask_input: np.ndarray | None = None,
        multimask_output: bool = True,
        return_logits: bool = False,
        image_index: int | None = None,
    ) -> NumpyResult:
        """Masks for one prompt on the set image.

        point_coords [N, 2] (x, y) pixels of the original image with point_labels [N] (1
        foreground, 0 background); box [4] (x0, y0, x1, y1); mask_input [1, 256, 256] low-res
        logits from an earlier call. Returns masks [C, H, W] (bool, or float logits with
        return_logits), IoU predictions [C] and low-res logits [C, 256, 256]; C is 3 with
        multimask_output, else 1.
        """
        index = self._image_index(image_index)
        prompt = self._torch_prompt(index, point_coords, point_labels, box, mask_input)
        out = self.predict_torch(*prompt, multimask_output, return_logits, image_index=index)
        return tuple(_to_numpy(t[0]) for t in out)

    def _torch_prompt(
        self,
        index: int,
        point_coords: np.ndarray | None = None,
        point_labels: np.ndarray | None = None,
        box: np.ndarray | None = None,
        mask_input: np.ndarray | None = None,
    ) -> TorchPrompt:
        """predict's numpy prompt for image `index` as predict_torch's batch-of-one tensors."""
        original_size = self.original_sizes[index]
        coords = labels = boxes = masks = None
        if (point_coords is None) != (point_labels is None):
            raise UserError("point_coords and point_labels must be given together (one label per point)")
        if point_coords is not None:
            coords_np, labels_np = np.asarray(point_coords), np.asarray(point_labels)
            if coords_np.ndim != 2 or coords_np.shape[1] != 2:
                raise UserError(f"point_coords must be [N, 2] (x, y) pixels, got shape {coords_np.shape}")
            if labels_np.shape != (coords_np.shape[0],):
                raise UserError(
                    f"point_labels must be [N] with N = {coords_np.shape[0]} points, got shape {labels_np.shape}"
                )
            coords_np = self.transform.apply_coords(coords_np, original_size)
            coords = torch.as_tensor(coords_np, dtype=torch.float32, device=self.device)[None]
            labels = torch.as_tensor(labels_np, dtype=torch.int32, device=self.device)[None]
        if box is not None:
            box_np = np.asarray(box)
            if box_np.shape not in ((4,), (1, 4)):
                raise UserError(f"box must be 4 numbers (x0, y0, x1, y1), got shape {box_np.shape}")
            box_np = self.transform.apply_boxes(box_np, original_size)
            boxes = torch.as_tensor(box_np, dtype=torch.float32, device=self.device)
        if mask_input is not None:
            mask_np = np.asarray(mask_input)
            expected = (1, *self.model.prompt_encoder.mask_input_size)
            if mask_np.shape != expected:
                raise UserError(
                    f"mask_input must be {list(expected)} low-res logits (one of a previous "
                    f"call's low_res_masks, e.g. low_res[i:i+1]), got shape {list(mask_np.shape)}"
                )
            masks = torch.as_tensor(mask_np, dtype=torch.float32, device=self.device)[None]
        return coords, labels, boxes, masks

    @torch.no_grad()
    def predict_batch(
        self, prompts: Sequence[Mapping[str, Any]], multimask_output: bool = True, return_logits: bool = False
    ) -> list[NumpyResult]:
        """`predict` for every set image: prompts[i] holds predict's prompt arguments
        (point_coords, point_labels, box, mask_input) for image i."""
        self._require_image()
        if len(prompts) != self.num_images:
            raise UserError(
                f"predict_batch needs one prompt dict per set image: got {len(prompts)} for {self.num_images} images"
            )
        groups: dict[tuple, list[tuple[int, TorchPrompt]]] = {}
        for i, prompt in enumerate(prompts):
            unknown = set(prompt) - set(_PROMPT_KEYS)
            if unknown:
                raise UserError(f"unknown prompt keys {sorted(unknown)} for image {i}; use {', '.join(_PROMPT_KEYS)}")
            torch_prompt = self._torch_prompt(i, **prompt)
            shape = tuple(None if t is None else tuple(t.shape) for t in torch_prompt)
            groups.setdefault(shape, []).append((i, torch_prompt))
        results: list[NumpyResult | None] = [None] * self.num_images
        for members in groups.values():
            indices = [i for i, _ in members]
            parts = [None if t[0] is None else torch.cat(t) for t in zip(*(p for _, p in members))]
            low_res, iou = self._decode(indices, *parts, multimask_output)
            for row, i in enumerate(indices):
                masks = self._postprocess(low_res[row : row + 1], i, return_logits)
                results[i] = (_to_numpy(masks[0]), _to_numpy(iou[row]), _to_numpy(low_res[row]))
        return results

    @torch.no_grad()
    def predict_torch(
        self,
        point_coords: Tensor | None,
        point_labels: Tensor | None,
        boxes: Tensor | None = None,
        mask_input: Tensor | None = None,
        multimask_output: bool = True,
        return_logits: bool = False,
        image_index: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Masks for B prompts on the set image, prompts already in the resized frame.

        point_coords [B, N, 2] with point_labels [B, N]; boxes [B, 4]; mask_input [B, 1, 256, 256].
        Returns masks [B, C, H, W] (bool, or logits), IoU predictions [B, C] and low-res logits
        [B, C, 256, 256].
        """
        low_res, iou = self.predict_low_res_torch(
            point_coords, point_labels, boxes, mask_input, multimask_output, image_index
        )
        return self.upscale_masks(low_res, image_index, return_logits), iou, low_res

    @torch.no_grad()
    def predict_low_res_torch(
        self,
        point_coords: Tensor | None,
        point_labels: Tensor | None,
        boxes: Tensor | None = None,
        mask_input: Tensor | None = None,
        multimask_output: bool = True,
        image_index: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """predict_torch without the upscaling: low-res logits [B, C, 256, 256] and IoU predictions
        [B, C] (e.g. to filter by IoU before paying for full-resolution masks: upscale_masks)."""
        index = self._image_index(image_index)
        self._check_torch_prompts(point_coords, point_labels, boxes, mask_input)
        return self._decode([index], point_coords, point_labels, boxes, mask_input, multimask_output)

    def upscale_masks(self, low_res: Tensor, image_index: int | None = None, return_logits: bool = False) -> Tensor:
        """Low-res logits [B, C, 256, 256] -> masks [B, C, H, W] at the original image size (bool,
        or logits with return_logits). Each mask is upscaled on its own."""
        return self._postprocess(low_res, self._image_index(image_index), return_logits)

    def summarize_masks(self, low_res: Tensor, threshold: float, offset: float) -> FullSizeMasks:
        """Low-res logits [M, 256, 256] of the one set image as the automatic generator measures
        them at its size (stability at threshold +- offset, boxes, column runs). SAM's upscaling
        goes through the padded 1024 square, so it is done in full here."""
        logits = self.upscale_masks(low_res[:, None], return_logits=True)[:, 0]
        return FullSizeMasks(logits, threshold, offset)

    def input_frame(self, points: Tensor, image_size: tuple[int, int]) -> Tensor:
        """(x, y) pixel points [N, 2] of an image of image_size (H, W) -> float32 points in the
        model's input frame, on the model's device."""
        coords = self.transform.apply_coords(points.numpy(), image_size)
        return torch.as_tensor(coords, dtype=torch.float32, device=self.device)

    def _decode(
        self,
        image_indices: list[int],
        point_coords: Tensor | None,
        point_labels: Tensor | None,
        boxes: Tensor | None,
        mask_input: Tensor | None,
        multimask_output: bool,
    ) -> tuple[Tensor, Tensor]:
        """Low-res masks and IoUs for a batch of prompts; prompt p reads image image_indices[p]'s
        embedding (one index: all prompts share it)."""
        encoder = self.model.prompt_encoder
        points = (point_coords, point_labels) if point_coords is not None else None
        if mask_input is not None:
            mask_input = mask_input.to(self.features.dtype)  # the mask downscaler runs in the model's dtype
        sparse, dense = encoder(points, boxes, mask_input)
        if len(image_indices) == 1:
            features = self.features[image_indices[0] : image_indices[0] + 1]
        else:  # one device index tensor, copied without waiting for the GPU: no per-prompt slicing
            index = torch.tensor(image_indices)
            if self.device.type == "cuda":
                index = index.pin_memory()
            features = self.features[index.to(self.device, non_blocking=True)]
        return self.model.mask_decoder(features, encoder.get_dense_pe(), sparse, dense, multimask_output)

    def _postprocess(self, low_res: Tensor, index: int, return_logits: bool) -> Tensor:
        masks = self.model.postprocess_masks(low_res, self.input_sizes[index], self.original_sizes[index])
        return masks if return_logits else masks > self.model.mask_threshold

    def _check_torch_prompts(
        self, coords: Tensor | None, labels: Tensor | None, boxes: Tensor | None, mask_input: Tensor | None
    ) -> None:
        """Shape checks only: reading values would make the host wait for the device."""
        sizes = {}
        if (coords is None) != (labels is None):
            raise UserError("point_coords and point_labels must be given together (one label per point)")
        if coords is not None:
            if coords.dim() != 3 or coords.shape[2] != 2:
                raise UserError(f"point_coords must be [B, N, 2], got shape {list(coords.shape)}")
            if tuple(labels.shape) != tuple(coords.shape[:2]):
                raise UserError(
                    f"point_labels must be [B, N] = {list(coords.shape[:2])} to match "
                    f"point_coords, got shape {list(labels.shape)}"
                )
            sizes["point_coords"] = coords.shape[0]
        if boxes is not None:
            if boxes.dim() != 2 or boxes.shape[1] != 4:
                raise UserError(f"boxes must be [B, 4] (x0, y0, x1, y1), got shape {list(boxes.shape)}")
            sizes["boxes"] = boxes.shape[0]
        if mask_input is not None:
            expected = (1, *self.model.prompt_encoder.mask_input_size)
            if mask_input.dim() != 4 or tuple(mask_input.shape[1:]) != expected:
                raise UserError(
                    f"mask_input must be [B, {', '.join(map(str, expected))}], got shape {list(mask_input.shape)}"
                )
            sizes["mask_input"] = mask_input.shape[0]
        if len(set(sizes.values())) > 1:
            raise UserError(f"prompt batch sizes differ: {sizes}; every prompt tensor needs the same B")


def check_image(image: Any, what: str = "image", channels: str = "RGB") -> None:
    """Raise a UserError unless `image` is an HxWx3 uint8 numpy array (`what` names it in the
    message, `channels` says which colour order is expected)."""
    if not isinstance(image, np.ndarray):
        raise UserError(f"{what} must be a numpy array (HxWx3 uint8 {channels}), got {type(image).__name__}")
    if image.ndim != 3 or image.shape[2] != 3 or 0 in image.shape:
        raise UserError(f"{what} must be HxWx3 (height, width, {channels} channels), got shape {image.shape}")
    if image.dtype != np.uint8:
        raise UserError(
            f"{what} must be uint8 with values 0-255, got {image.dtype}; "
            "convert it, e.g. (image * 255).round().astype(np.uint8) for 0-1 floats"
        )


def _to_numpy(t: Tensor) -> np.ndarray:
    # Reduced-precision logits have no numpy dtype; bool masks pass through.
    return (t.float() if t.is_floating_point() else t).cpu().numpy()
