"""SAM 2's mask decoder: SAM's (same two-way transformer, tokens and hypernetworks) with three
additions.

- An object-score token: its output, through a small MLP, says whether the object is in the
  image at all (the video tracker blanks the mask of an object that left the frame).
- High-resolution features: the 1/8 and 1/4 levels of the image encoder are added into the two
  upscaling steps, for sharper masks.
- Dynamic multimask: when one mask is asked for and the single-mask answer is unstable (its area
  changes much between logit thresholds -delta and +delta), the best of the three multimask
  answers is returned instead.
IoU predictions go through a sigmoid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.sam.modeling.common import LayerNorm2d
from genfast.sam.modeling.mask_decoder import MLP
from genfast.sam.modeling.transformer import TwoWayTransformer
from genfast.sam.sam2.config import Sam2Config

STABILITY_DELTA = 0.05
STABILITY_THRESHOLD = 0.98


class Sam2MaskDecoder(nn.Module):
    def __init__(self, config: Sam2Config) -> None:
        super().__init__()
        dim = config.d_model
        self.transformer = TwoWayTransformer(config.decoder_config())
        self.num_mask_tokens = 4
        self.iou_token = nn.Embedding(1, dim)
        self.mask_tokens = nn.Embedding(self.num_mask_tokens, dim)
        self.obj_score_token = nn.Embedding(1, dim)
        self.output_upscaling = nn.Sequential(
            nn.ConvTranspose2d(dim, dim // 4, kernel_size=2, stride=2),
            LayerNorm2d(dim // 4),
            nn.GELU(),
            nn.ConvTranspose2d(dim // 4, dim // 8, kernel_size=2, stride=2),
            nn.GELU(),
        )
        # Applied to the encoder's 1/4 and 1/8 levels once per image (Sam2.forward_image).
        self.conv_s0 = nn.Conv2d(dim, dim // 8, kernel_size=1)
        self.conv_s1 = nn.Conv2d(dim, dim // 4, kernel_size=1)
        self.output_hypernetworks_mlps = nn.ModuleList(MLP(dim, dim, dim // 8, 3) for _ in range(self.num_mask_tokens))
        self.iou_prediction_head = MLP(dim, 256, self.num_mask_tokens, 3)
        self.pred_obj_score_head = MLP(dim, dim, 1, 3)

    def forward(
        self,
        image_embeddings: Tensor,
        image_pe: Tensor,
        sparse_prompt_embeddings: Tensor,
        dense_prompt_embeddings: Tensor,
        multimask_output: bool,
        high_res_features: tuple[Tensor, Tensor],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Masks for B prompts.

        image_embeddings: [1 or B, C, h, w]; image_pe: [1, C, h, w]; sparse: [B, N, C];
        dense: [B, C, h, w]; high_res_features: (1/4 level [1 or B, C/8, 4h, 4w], 1/8 level
        [1 or B, C/4, 2h, 2w]) after conv_s0/conv_s1.
        Returns low-res mask logits [B, M, 4h, 4w], IoU predictions [B, M], the mask tokens the
        tracker turns into object pointers [B, M, C] and object-score logits [B, 1]; M is 3 with
        multimask_output, else 1.
        """
        masks, iou_pred, mask_tokens, object_score = self.predict_masks(
            image_embeddings, image_pe, sparse_prompt_embeddings, dense_prompt_embeddings, high_res_features
        )
        if multimask_output:
            return masks[:, 1:], iou_pred[:, 1:], mask_tokens[:, 1:], object_score
        masks, iou_pred = self._dynamic_multimask(masks, iou_pred)
        return masks, iou_pred, mask_tokens[:, :1], object_score

    def predict_masks(
        self,
        image_embeddings: Tensor,
        image_pe: Tensor,
        sparse_prompt_embeddings: Tensor,
        dense_prompt_embeddings: Tensor,
        high_res_features: tuple[Tensor, Tensor],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """All four masks and IoU predictions, the four mask tokens, the object-score logit."""
        bs = sparse_prompt_embeddings.shape[0]
        if image_embeddings.shape[0] not in (1, bs):
            raise ValueError(
                f"{image_embeddings.shape[0]} image embeddings for {bs} prompts: pass one embedding, or one per prompt"
            )
        output_tokens = torch.cat([self.obj_score_token.weight, self.iou_token.weight, self.mask_tokens.weight])
        tokens = torch.cat([output_tokens.expand(bs, -1, -1), sparse_prompt_embeddings], dim=1)
        src = image_embeddings + shared_batch(dense_prompt_embeddings)
        # One image for every prompt stays one: the transformer's first layer then projects its
        # tokens once for all prompts (they differ only after the first image <- token update).
        hs, src = self.transformer(src, image_pe, tokens)
        mask_tokens = hs[:, 2 : 2 + self.num_mask_tokens]

        feat_s0, feat_s1 = high_res_features
        up1, norm, act1, up2, act2 = self.output_upscaling
        c, h, w = image_embeddings.shape[1:]
        image = src.transpose(1, 2).reshape(bs, c, h, w)  # a channels-last view of the image tokens
        upscaled = act1(norm(channels_last_conv_transpose(up1, image) + feat_s1))
        upscaled = act2(channels_last_conv_transpose(up2, upscaled) + feat_s0)
        hyper_in = torch.stack([mlp(mask_tokens[:, i]) for i, mlp in enumerate(self.output_hypernetworks_mlps)], dim=1)
        b, c, h, w = upscaled.shape
        masks = (hyper_in @ upscaled.reshape(b, c, h * w)).reshape(b, -1, h, w)
        iou_pred = torch.sigmoid(self.iou_prediction_head(hs[:, 1]))
        return masks, iou_pred, mask_tokens, self.pred_obj_score_head(hs[:, 0])

    @staticmethod
    def _dynamic_multimask(masks: Tensor, iou_pred: Tensor) -> tuple[Tensor, Tensor]:
        """The single-mask answer where it is stable, else the multimask answer with the best
        predicted IoU (one per prompt, chosen on the device: no host sync)."""
        single, single_iou = masks[:, :1], iou_pred[:, :1]
        multi, multi_iou = masks[:, 1:], iou_pred[:, 1:]
        best = multi_iou.argmax(dim=-1)
        best_mask = multi.gather(1, best[:, None, None, None].expand(-1, 1, *multi.shape[2:]))
        best_iou = multi_iou.gather(1, best[:, None])
        flat = single.flatten(-2)
        inter = (flat > STABILITY_DELTA).sum(-1).float()
        union = (flat > -STABILITY_DELTA).sum(-1).float()
        stable = torch.where(union > 0, inter / union, 1.0) >= STABILITY_THRESHOLD  # [B, 1]
        return torch.where(stable[..., None, None], single, best_mask), torch.where(stable, single_iou, best_iou)


def channels_last_conv_transpose(conv: nn.ConvTranspose2d, x: Tensor) -> Tensor:
    """conv(x), eagerly with the weight in channels-last memory, so that the convolution keeps the
    map channels-last: the layout of the image tokens it starts from, of the encoder's
    high-resolution features added to it, and of what its LayerNorm and the mask product read.
    With the weight as stored, oneDNN wrote [B, C, H, W] and every following step converted (on
    the CPU the upscaling took twice as long). The weight is small: re-laid out at each call.
    Compiled code is left to inductor, which chooses its layouts itself (the automatic
    generator's compiled decoder was slower with the re-laid out weight)."""
    if torch.compiler.is_compiling():
        return conv(x)
    weight = conv.weight.contiguous(memory_format=torch.channels_last)
    return F.conv_transpose2d(
        x, weight, conv.bias, conv.stride, conv.padding, conv.output_padding, conv.groups, conv.dilation
    )


def shared_batch(x: Tensor) -> Tensor:
    """x with its batch dimension cut to one where every row is the same view (expanded, stride 0:
    the prompt encoder's "no mask" embedding), so that adding it to one image keeps one image."""
    return x[:1] if x.shape[0] > 1 and x.stride(0) == 0 else x


def upsample_logits(logits: Tensor, size: tuple[int, int]) -> Tensor:
    """Mask logits resized bilinearly (no corner alignment), in fp32."""
    return F.interpolate(logits.float(), size=size, mode="bilinear", align_corners=False)
