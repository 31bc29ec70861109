"""SAM's prompt encoder: points and box corners become tokens ("sparse" embeddings), a mask
prompt becomes a map added to the image embedding ("dense" embedding).

Coordinates are in the resized, padded input frame (pixels of the image_size square). A point
is encoded at its pixel centre (+0.5) with random Fourier features, plus a learned embedding of
its label: 1 foreground, 0 background, 2 and 3 a box's top-left and bottom-right corner, -1
padding (which gets no positional part at all).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from genfast.sam.config import SamConfig
from genfast.sam.modeling.common import LayerNorm2d


class PositionEmbeddingRandom(nn.Module):
    """Fourier features of 2-D positions with a fixed random Gaussian frequency matrix.

    The matrix is a buffer, not a parameter, but is saved in the checkpoint: it must be loaded,
    not redrawn.
    """

    def __init__(self, num_pos_feats: int) -> None:
        super().__init__()
        self.register_buffer("positional_encoding_gaussian_matrix", torch.randn(2, num_pos_feats))

    def encode(self, coords: Tensor) -> Tensor:
        """Positions in [0, 1]^2, [..., 2] as (x, y) -> [..., 2 * num_pos_feats] (sin ‖ cos), in the
        model's dtype. Computed in fp32 whatever that dtype: the angles reach tens of radians, where
        bf16 would leave sin/cos with no correct digits."""
        matrix = self.positional_encoding_gaussian_matrix
        angles = (2 * coords.float() - 1) @ matrix.float() * (2 * math.pi)
        return torch.cat([angles.sin(), angles.cos()], dim=-1).to(matrix.dtype)

    def forward(self, size: tuple[int, int]) -> Tensor:
        """Encoding of every cell centre of an h x w grid: [C, h, w]."""
        h, w = size
        device = self.positional_encoding_gaussian_matrix.device
        y = (torch.arange(h, device=device, dtype=torch.float32) + 0.5) / h
        x = (torch.arange(w, device=device, dtype=torch.float32) + 0.5) / w
        grid = torch.stack([x[None, :].expand(h, w), y[:, None].expand(h, w)], dim=-1)
        return self.encode(grid).permute(2, 0, 1)

    def forward_with_coords(self, coords: Tensor, image_size: tuple[int, int]) -> Tensor:
        """Pixel coordinates [..., 2] (x, y) in an image of image_size (H, W)."""
        # Scaled with Python numbers: a scale tensor built from a list would be a host-to-device
        # copy, which waits for the GPU.
        coords = coords.float()
        return self.encode(torch.stack([coords[..., 0] / image_size[1], coords[..., 1] / image_size[0]], dim=-1))


class PromptEncoder(nn.Module):
    def __init__(self, config: SamConfig) -> None:
        super().__init__()
        dim, grid = config.prompt_embed_dim, config.image_embedding_size
        self.embed_dim = dim
        self.input_image_size = (config.image_size, config.image_size)
        self.image_embedding_size = (grid, grid)
        self.mask_input_size = (4 * grid, 4 * grid)  # mask prompts are 4x the embedding (256 px)
        self.pe_layer = PositionEmbeddingRandom(dim // 2)
        # Label embeddings: background point, foreground point, top-left and bottom-right box corners.
        self.point_embeddings = nn.ModuleList(nn.Embedding(1, dim) for _ in range(4))
        self.not_a_point_embed = nn.Embedding(1, dim)
        c = config.mask_in_chans
        self.mask_downscaling = nn.Sequential(
            nn.Conv2d(1, c // 4, kernel_size=2, stride=2),
            LayerNorm2d(c // 4),
            nn.GELU(),
            nn.Conv2d(c // 4, c, kernel_size=2, stride=2),
            LayerNorm2d(c),
            nn.GELU(),
            nn.Conv2d(c, dim, kernel_size=1),
        )
        self.no_mask_embed = nn.Embedding(1, dim)

    def get_dense_pe(self) -> Tensor:
        """Positional encoding of the image embedding's grid: [1, C, h, w]."""
        return self.pe_layer(self.image_embedding_size).unsqueeze(0)

    def _embed_points(self, coords: Tensor, labels: Tensor, pad: bool) -> Tensor:
        coords = coords + 0.5  # pixel centres
        if pad:  # without a box, a padding point stands in for the box's two tokens
            coords = torch.cat([coords, coords.new_zeros(coords.shape[0], 1, 2)], dim=1)
            labels = torch.cat([labels, labels.new_full((labels.shape[0], 1), -1)], dim=1)
        pe = self.pe_layer.forward_with_coords(coords, self.input_image_size)
        labels = labels[..., None]
        # Written with where (no in-place masked writes) so it traces into one graph.
        emb = torch.where(labels == -1, self.not_a_point_embed.weight, pe)
        # Labels 2 and 3 are box corners given as points (SAM 2's predictors pass boxes so).
        for label, embedding in enumerate(self.point_embeddings):
            emb = emb + torch.where(labels == label, embedding.weight, 0.0)
        return emb

    def _embed_boxes(self, boxes: Tensor) -> Tensor:
        corners = (boxes + 0.5).reshape(-1, 2, 2)
        pe = self.pe_layer.forward_with_coords(corners, self.input_image_size)
        corner_labels = torch.cat([self.point_embeddings[2].weight, self.point_embeddings[3].weight])
        return pe + corner_labels

    def forward(
        self, points: tuple[Tensor, Tensor] | None, boxes: Tensor | None, masks: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Embed one batch of prompts (B = number of prompts, each for the same image).

        points: (coords [B, N, 2] as (x, y), labels [B, N]); boxes: [B, 4] as (x0, y0, x1, y1);
        masks: low-res mask logits [B, 1, 4h, 4w]. Returns sparse [B, N', C] and dense
        [B, C, h, w] embeddings.
        """
        if points is not None:
            bs = points[0].shape[0]
        elif boxes is not None:
            bs = boxes.shape[0]
        elif masks is not None:
            bs = masks.shape[0]
        else:
            bs = 1
        sparse = [self.not_a_point_embed.weight.new_empty(bs, 0, self.embed_dim)]
        if points is not None:
            sparse.append(self._embed_points(points[0], points[1], pad=boxes is None))
        if boxes is not None:
            sparse.append(self._embed_boxes(boxes))
        if masks is not None:
            dense = self.mask_downscaling(masks)
        else:
            h, w = self.image_embedding_size
            dense = self.no_mask_embed.weight.reshape(1, -1, 1, 1).expand(bs, -1, h, w)
        return torch.cat(sparse, dim=1), dense
