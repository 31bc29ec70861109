"""The SAM 2 model: its modules (named as in the official checkpoints, `sam2.1_hiera_*.pt`) and
what one frame needs: image features, and masks from prompts on them.

The video tracker (genfast/sam/sam2/tracker.py) adds memory across frames on top of these.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.sam.modeling.mask_decoder import MLP
from genfast.sam.modeling.prompt_encoder import PromptEncoder
from genfast.sam.sam2.config import Sam2Config
from genfast.sam.sam2.modeling.decoder import Sam2MaskDecoder
from genfast.sam.sam2.modeling.hiera import ImageEncoder
from genfast.sam.sam2.modeling.memory import MemoryAttention, MemoryEncoder

# Mask logit of an object the decoder says is absent (the official constant).
NO_OBJECT_SCORE = -1024.0
# Pixel statistics the images are normalized with (ImageNet's, in [0, 1] units).
PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)


def _composed_1x1(first: nn.Conv2d, then: nn.Conv2d) -> nn.Conv2d:
    """One 1x1 convolution computing then(first(x)), its weights composed in float64."""
    w1, w2 = first.weight.flatten(1).double(), then.weight.flatten(1).double()
    composed = nn.Conv2d(w1.shape[1], w2.shape[0], kernel_size=1, device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        composed.weight.copy_((w2 @ w1).view_as(composed.weight))
        composed.bias.copy_(w2 @ first.bias.double() + then.bias.double())
    return composed.requires_grad_(first.weight.requires_grad)


class Sam2(nn.Module):
    def __init__(self, config: Sam2Config) -> None:
        super().__init__()
        self.config = config
        d, mem = config.d_model, config.mem_dim
        self.image_encoder = ImageEncoder(config)
        self.sam_prompt_encoder = PromptEncoder(config.decoder_config())
        self.sam_mask_decoder = Sam2MaskDecoder(config)
        self.memory_attention = MemoryAttention(config)
        self.memory_encoder = MemoryEncoder(config)
        # Tracker parameters: temporal positions of remembered frames, stand-ins for "no memory"
        # and "no object", and the projections that make object pointers from mask tokens.
        self.maskmem_tpos_enc = nn.Parameter(torch.zeros(config.num_maskmem, 1, 1, mem))
        self.no_mem_embed = nn.Parameter(torch.zeros(1, 1, d))
        self.no_mem_pos_enc = nn.Parameter(torch.zeros(1, 1, d))
        self.no_obj_ptr = nn.Parameter(torch.zeros(1, d))
        self.no_obj_embed_spatial = nn.Parameter(torch.zeros(1, mem)) if config.no_obj_embed_spatial else None
        self.mask_downsample = nn.Conv2d(1, 1, kernel_size=4, stride=4)
        self.obj_ptr_proj = MLP(d, d, d, 3)
        self.obj_ptr_tpos_proj = nn.Linear(d, mem) if config.proj_tpos_enc_in_obj_ptrs else nn.Identity()
        # Set by the recipe's compile step: compiles the automatic mask generator's batched decoder
        # (genfast/sam/sam2/automatic.py GridDecoder), which is made per generator.
        self.grid_decoder_compiler: Callable[[nn.Module], Callable] | None = None

    @property
    def device(self) -> torch.device:
        return self.no_mem_embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.no_mem_embed.dtype

    @property
    def image_size(self) -> int:
        return self.config.image_size

    def forward_image(self, images: Tensor) -> tuple[list[Tensor], Tensor]:
        """Normalized images [B, 3, S, S] -> features at 1/4, 1/8, 1/16, the two finer levels
        already projected for the mask decoder (conv_s0, conv_s1) as every use of them wants, and
        the 1/16 level's positional encoding (the only one used: the official model's
        `vision_pos_enc[-1]`)."""
        features, position = self.image_encoder(images)
        features = [
            self.sam_mask_decoder.conv_s0(features[0]),
            self.sam_mask_decoder.conv_s1(features[1]),
            features[2],
        ]
        return features, position

    def fold_high_res_projections(self) -> None:
        """Fold the decoder's 1x1 projections of the 1/4 and 1/8 levels (conv_s0, conv_s1) into
        the neck's lateral 1x1 projections of those levels, where no top-down path adds a coarser
        level between the two (every official model): one product from the trunk's channels
        straight to the decoder's, instead of two through d_model channels, and the 1/4 level's
        d_model-channel map (a quarter of the encoder's output bytes) is never made. The same
        function (composed in float64); the module tree, and its state dict, change: for a loaded
        model, as the recipe's steps do."""
        neck = self.image_encoder.neck
        coarsest_first = len(neck.convs) - 1
        for level, name in ((0, "conv_s0"), (1, "conv_s1")):
            projection = getattr(self.sam_mask_decoder, name)
            if level in neck.top_down_levels or not isinstance(projection, nn.Conv2d):
                continue  # summed with the coarser level before the projection, or folded already
            lateral = neck.convs[coarsest_first - level]
            lateral.conv = _composed_1x1(lateral.conv, projection)
            setattr(self.sam_mask_decoder, name, nn.Identity())

    def precompute_position_embedding(self) -> None:
        """The trunk's position embedding at the model's input size, made once
        (Hiera.precompute_position_embedding) instead of at every image."""
        self.image_encoder.trunk.precompute_position_embedding(self.image_size // 4)

    def image_embeddings(self, images: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """What the image predictor decodes prompts against: the 1/16 embedding with the learned
        "no memory" embedding added (an image is a video's first frame, with nothing remembered)
        and the two high-resolution levels."""
        features, _ = self.forward_image(images)
        embedding = features[2] + self.no_mem_embed.view(1, -1, 1, 1)
        return embedding, (features[0], features[1])

    def forward_sam_heads(
        self,
        backbone_features: Tensor,
        point_inputs: tuple[Tensor, Tensor] | None = None,
        mask_inputs: Tensor | None = None,
        high_res_features: tuple[Tensor, Tensor] | None = None,
        multimask_output: bool = False,
    ) -> dict[str, Tensor]:
        """Decode one prompt per row of B (objects of one frame).

        backbone_features [B, C, h, w]; point_inputs (coords [B, N, 2] in input pixels, labels
        [B, N]); mask_inputs [B, 1, H, W] logits or binary. Returns the tracker's view: all masks
        ("multimasks", low-res [B, M, 4h, 4w] and at input size), IoUs [B, M], the chosen mask
        (best IoU among M) low-res and at input size, the object pointer [B, C] and object-score
        logits [B, 1]. An absent object's masks are NO_OBJECT_SCORE everywhere.
        """
        b = backbone_features.shape[0]
        if point_inputs is None:  # one padding point: a prompt of "nothing"
            coords = backbone_features.new_zeros(b, 1, 2, dtype=torch.float32)
            labels = torch.full((b, 1), -1, dtype=torch.int32, device=backbone_features.device)
        else:
            coords, labels = point_inputs
        mask_prompt = None
        if mask_inputs is not None:
            size = self.sam_prompt_encoder.mask_input_size
            mask_prompt = mask_inputs.to(self.dtype)
            if mask_inputs.shape[-2:] != size:
                mask_prompt = F.interpolate(
                    mask_inputs.float(), size=size, mode="bilinear", align_corners=False, antialias=True
                ).to(self.dtype)
        sparse, dense = self.sam_prompt_encoder((coords, labels), None, mask_prompt)
        multimasks, ious, tokens, object_score = self.sam_mask_decoder(
            backbone_features,
            self.sam_prompt_encoder.get_dense_pe(),
            sparse,
            dense,
            multimask_output,
            high_res_features,
        )
        present = object_score > 0  # [B, 1]
        multimasks = torch.where(present[:, :, None, None], multimasks.float(), NO_OBJECT_SCORE)
        multimasks_high = F.interpolate(
            multimasks, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
        )
        if multimask_output:
            best = ious.argmax(dim=-1)
            rows = torch.arange(b, device=best.device)
            low, high, token = multimasks[rows, best, None], multimasks_high[rows, best, None], tokens[rows, best]
        else:
            low, high, token = multimasks, multimasks_high, tokens[:, 0]
        return {
            "multimasks": multimasks,
            "multimasks_high_res": multimasks_high,
            "ious": ious,
            "masks": low,
            "masks_high_res": high,
            "obj_ptr": self.object_pointer(token, present.to(token.dtype)),
            "object_score_logits": object_score,
        }

    def object_pointer(self, token: Tensor, present: Tensor) -> Tensor:
        """The mask token projected to an object pointer, or the learned "no object" pointer
        where the object is absent (present: [B, 1] of 0 or 1)."""
        pointer = self.obj_ptr_proj(token)
        return present * pointer + (1 - present) * self.no_obj_ptr

    def use_mask_as_output(
        self, backbone_features: Tensor, high_res_features: tuple[Tensor, Tensor], mask_inputs: Tensor
    ) -> dict[str, Tensor]:
        """A mask given as a prompt is taken as the answer itself (binary mask -> logits +-10),
        with an object pointer decoded from it; as forward_sam_heads returns."""
        mask = mask_inputs.float()
        high = mask * 20.0 - 10.0
        low = F.interpolate(
            high, size=(high.shape[-2] // 4, high.shape[-1] // 4), mode="bilinear", align_corners=False, antialias=True
        )
        decoded = self.forward_sam_heads(
            backbone_features,
            mask_inputs=self.mask_downsample(mask.to(self.dtype)),
            high_res_features=high_res_features,
        )
        present = (mask.flatten(1) > 0).any(dim=1, keepdim=True).float()
        pointer = decoded["obj_ptr"]
        pointer = present.to(pointer.dtype) * pointer + (1 - present.to(pointer.dtype)) * self.no_obj_ptr
        return {
            "multimasks": low,
            "multimasks_high_res": high,
            "ious": mask.new_ones(mask.shape[0], 1),
            "masks": low,
            "masks_high_res": high,
            "obj_ptr": pointer,
            "object_score_logits": present * 20.0 - 10.0,
        }
