"""Resize images so their longest side is the model's input size, and map prompt coordinates and
boxes into that frame (the original's ResizeLongestSide, in torch, without torchvision).

Images are resized with bilinear interpolation and antialiasing. The original resizes numpy
images with PIL (torchvision's `resize` on a PIL image), whose bilinear filter torch's
`antialias=True` reproduces up to rounding; uint8 results may differ from PIL's by one level.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


class ResizeLongestSide:
    def __init__(self, target_length: int) -> None:
        self.target_length = target_length

    @staticmethod
    def get_preprocess_shape(old_h: int, old_w: int, long_side_length: int) -> tuple[int, int]:
        """(h, w) scaled so the longer side is long_side_length, rounded half up."""
        scale = long_side_length * 1.0 / max(old_h, old_w)
        return int(old_h * scale + 0.5), int(old_w * scale + 0.5)

    def apply_image(self, image: np.ndarray) -> np.ndarray:
        """A uint8 HxWxC image -> the resized uint8 image."""
        x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].float()
        x = self.apply_image_torch(x)
        return x[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8).numpy()

    def apply_image_torch(self, image: Tensor) -> Tensor:
        """Float images [B, C, H, W] -> [B, C, h, w].

        Sized from H and W: the original reads shape[0] and shape[1] (batch and channels) here.
        """
        size = self.get_preprocess_shape(image.shape[-2], image.shape[-1], self.target_length)
        return F.interpolate(image, size, mode="bilinear", align_corners=False, antialias=True)

    def apply_coords_torch(self, coords: Tensor, original_size: tuple[int, int]) -> Tensor:
        """(x, y) pixel coordinates [..., 2] in the original image -> in the resized image (float32)."""
        old_h, old_w = original_size
        new_h, new_w = self.get_preprocess_shape(old_h, old_w, self.target_length)
        scale = torch.tensor([new_w / old_w, new_h / old_h], dtype=torch.float32, device=coords.device)
        return coords.to(torch.float32) * scale

    def apply_boxes_torch(self, boxes: Tensor, original_size: tuple[int, int]) -> Tensor:
        """(x0, y0, x1, y1) boxes [B, 4] in the original image -> in the resized image."""
        return self.apply_coords_torch(boxes.reshape(-1, 2, 2), original_size).reshape(-1, 4)

    def apply_coords(self, coords: np.ndarray, original_size: tuple[int, int]) -> np.ndarray:
        """apply_coords_torch for numpy arrays, in float64 as the original."""
        old_h, old_w = original_size
        new_h, new_w = self.get_preprocess_shape(old_h, old_w, self.target_length)
        return np.asarray(coords, dtype=np.float64) * np.array([new_w / old_w, new_h / old_h])

    def apply_boxes(self, boxes: np.ndarray, original_size: tuple[int, int]) -> np.ndarray:
        return self.apply_coords(np.asarray(boxes).reshape(-1, 2, 2), original_size).reshape(-1, 4)
