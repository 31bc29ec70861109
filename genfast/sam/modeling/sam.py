"""The SAM module: its three parts, plus the pixel statistics and the pre/post-processing that
frame them (normalize and pad the resized image; upscale, crop and resize the masks back)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.sam.config import SamConfig
from genfast.sam.modeling.image_encoder import ImageEncoderViT
from genfast.sam.modeling.mask_decoder import MaskDecoder
from genfast.sam.modeling.prompt_encoder import PromptEncoder

# ImageNet statistics on the 0-255 scale, RGB; not in the checkpoints.
PIXEL_MEAN = (123.675, 116.28, 103.53)
PIXEL_STD = (58.395, 57.12, 57.375)


class Sam(nn.Module):
    mask_threshold: float = 0.0  # mask logits above this are inside the mask
    image_format: str = "RGB"

    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        self.config = config
        self.image_encoder = ImageEncoderViT(config)
        self.prompt_encoder = PromptEncoder(config)
        self.mask_decoder = MaskDecoder(config)
        self.register_buffer("pixel_mean", torch.empty(3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.empty(3, 1, 1), persistent=False)
        self.reset_pixel_stats()

    def reset_pixel_stats(self) -> None:
        """(Re)fill the non-persistent pixel statistics, e.g. after loading onto a meta-built model."""
        device = self.image_encoder.pos_embed.device
        self.pixel_mean = torch.tensor(PIXEL_MEAN, device=device).view(3, 1, 1)
        self.pixel_std = torch.tensor(PIXEL_STD, device=device).view(3, 1, 1)

    @property
    def device(self) -> torch.device:
        return self.image_encoder.pos_embed.device

    def preprocess(self, x: Tensor) -> Tensor:
        """Resized images [..., 3, h, w] on the 0-255 scale -> normalized, zero-padded at the bottom
        and right to [..., 3, S, S]."""
        x = (x - self.pixel_mean) / self.pixel_std
        h, w = x.shape[-2:]
        size = self.image_encoder.img_size
        return F.pad(x, (0, size - w, 0, size - h))

    def postprocess_masks(self, masks: Tensor, input_size: tuple[int, int], original_size: tuple[int, int]) -> Tensor:
        """Low-res mask logits [B, M, 4h, 4w] -> logits at the original image size [B, M, H, W].

        input_size is the resized image's (h, w) before padding; masks are first upscaled to the
        padded square, so the crop removes exactly the padding.
        """
        size = self.image_encoder.img_size
        masks = F.interpolate(masks, (size, size), mode="bilinear", align_corners=False)
        masks = masks[..., : input_size[0], : input_size[1]]
        return F.interpolate(masks, tuple(original_size), mode="bilinear", align_corners=False)
