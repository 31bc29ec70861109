"""SAM's mask decoder: learned output tokens (one IoU token, 1 + 3 mask tokens) run through the
two-way transformer with the prompt tokens; each mask token's output, through its own small MLP
(a "hypernetwork"), becomes the weights of a per-pixel dot product with the 4x upscaled image
embedding. The first mask token is the single-mask answer, the other three the multimask answers.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.sam.config import SamConfig
from genfast.sam.modeling.common import LayerNorm2d
from genfast.sam.modeling.prompt_encoder import PromptEncoder
from genfast.sam.modeling.transformer import TwoWayTransformer


def bytes_per_prompt(prompt_encoder: PromptEncoder, dtype: torch.dtype) -> int:
    """The largest intermediate of a mask decoder (SAM's or SAM 2's) for one prompt, in bytes:
    the upscaled image embedding, an eighth of its channels at four times its height and width
    (`output_upscaling`)."""
    h, w = prompt_encoder.image_embedding_size
    return prompt_encoder.embed_dim // 8 * 16 * h * w * dtype.itemsize


class MLP(nn.Module):
    """Linear layers with ReLU between them (not after the last)."""

    def __init__(self, in_dim: int, hidden_dim: int, out_dim: int, num_layers: int) -> None:
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (num_layers - 1) + [out_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in pairwise(dims))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


class MaskDecoder(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        dim = config.prompt_embed_dim
        self.transformer = TwoWayTransformer(config)
        self.num_mask_tokens = config.num_multimask_outputs + 1
        self.iou_token = nn.Embedding(1, dim)
        self.mask_tokens = nn.Embedding(self.num_mask_tokens, dim)
        self.output_upscaling = nn.Sequential(
            nn.ConvTranspose2d(dim, dim // 4, kernel_size=2, stride=2),
            LayerNorm2d(dim // 4),
            nn.GELU(),
            nn.ConvTranspose2d(dim // 4, dim // 8, kernel_size=2, stride=2),
            nn.GELU(),
        )
        self.output_hypernetworks_mlps = nn.ModuleList(MLP(dim, dim, dim // 8, 3) for _ in range(self.num_mask_tokens))
        self.iou_prediction_head = MLP(dim, config.iou_head_hidden_dim, self.num_mask_tokens, config.iou_head_depth)

    def forward(
        self,
        image_embeddings: Tensor,
        image_pe: Tensor,
        sparse_prompt_embeddings: Tensor,
        dense_prompt_embeddings: Tensor,
        multimask_output: bool,
    ) -> tuple[Tensor, Tensor]:
        """Masks for B prompts: low-res mask logits [B, M, 4h, 4w] and predicted IoUs [B, M].

        image_embeddings: [1, C, h, w] (shared by all prompts, as in the original) or [B, C, h, w]
        (one per prompt); image_pe: [1, C, h, w]; sparse: [B, N, C]; dense: [B, C, h, w].
        M is 3 with multimask_output, else 1.
        """
        masks, iou_pred = self.predict_masks(
            image_embeddings, image_pe, sparse_prompt_embeddings, dense_prompt_embeddings
        )
        keep = slice(1, None) if multimask_output else slice(0, 1)
        return masks[:, keep], iou_pred[:, keep]

    def predict_masks(
        self,
        image_embeddings: Tensor,
        image_pe: Tensor,
        sparse_prompt_embeddings: Tensor,
        dense_prompt_embeddings: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """All 1 + num_multimask_outputs masks and IoU predictions."""
        bs = sparse_prompt_embeddings.shape[0]
        if image_embeddings.shape[0] not in (1, bs):
            raise ValueError(
                f"{image_embeddings.shape[0]} image embeddings for {bs} prompts: pass one embedding, or one per prompt"
            )
        output_tokens = torch.cat([self.iou_token.weight, self.mask_tokens.weight], dim=0)
        tokens = torch.cat([output_tokens.expand(bs, -1, -1), sparse_prompt_embeddings], dim=1)

        src = image_embeddings + dense_prompt_embeddings  # broadcasts one image over the prompts
        b, c, h, w = src.shape
        pos_src = image_pe.expand(b, -1, -1, -1)
        hs, src = self.transformer(src, pos_src, tokens)
        iou_token_out = hs[:, 0]
        mask_tokens_out = hs[:, 1 : 1 + self.num_mask_tokens]

        upscaled = self.output_upscaling(src.transpose(1, 2).reshape(b, c, h, w))
        hyper_in = torch.stack(
            [mlp(mask_tokens_out[:, i]) for i, mlp in enumerate(self.output_hypernetworks_mlps)], dim=1
        )
        b, c, h, w = upscaled.shape
        masks = (hyper_in @ upscaled.reshape(b, c, h * w)).reshape(b, -1, h, w)
        return masks, self.iou_prediction_head(iou_token_out)
