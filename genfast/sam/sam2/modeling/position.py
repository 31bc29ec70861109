"""SAM 2's fixed sine position encodings (no parameters): the 2-D one of feature maps (FPN neck,
memory encoder) and the 1-D one of the tracker's object-pointer time offsets.

Both are the "Attention Is All You Need" encoding, computed in fp32 as the official model
computes them; frequencies go as temperature^(-2i/d).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def _inverse_frequencies(num_feats: int, temperature: float, device: torch.device) -> Tensor:
    """temperature^(2 * (i // 2) / num_feats) for i < num_feats: each frequency appears twice,
    once for a sine and once for a cosine (the official layout)."""
    i = torch.arange(num_feats, dtype=torch.float32, device=device)
    return temperature ** (2 * torch.div(i, 2, rounding_mode="floor") / num_feats)


def get_1d_sine_pe(positions: Tensor, dim: int, temperature: float = 10000.0) -> Tensor:
    """Sine encoding of (float) positions [...] -> [..., dim]: dim/2 sines, then dim/2 cosines."""
    angles = positions.unsqueeze(-1) / _inverse_frequencies(dim // 2, temperature, positions.device)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class PositionEmbeddingSine(nn.Module):
    """2-D sine encoding of a feature map's grid: row and column indices (from 1) normalized to
    (0, 2*pi], the first num_pos_feats/2 channels encoding the row, the rest the column, each as
    interleaved sine/cosine pairs.

    forward(x [B, C, H, W]) -> [B, num_pos_feats, H, W] in x's dtype, a broadcast view over the
    batch of a table cached per (H, W, device, dtype): it depends on nothing but the shape, and the
    tracker asks for the same one every frame. (The official returns fp32 and its callers cast it
    to x's dtype; the values are the same.)

    The tables of the grid sizes given as `sizes` are made once, as non-persistent buffers (they
    follow the module's device and dtype, and are no part of its state dict): a compiled caller
    (the image encoder) reads them as inputs, where it would otherwise recompute them on every
    call, a sine and a cosine per element (140 ms of sam2.1-hiera-tiny's 1 s encoder on two Zen 4
    threads, whose eager run reads them from the cache).
    """

    def __init__(
        self,
        num_pos_feats: int,
        temperature: float = 10000.0,
        normalize: bool = True,
        sizes: tuple[tuple[int, int], ...] = (),
    ) -> None:
        super().__init__()
        if num_pos_feats % 2:
            raise ValueError(f"num_pos_feats must be even, got {num_pos_feats}")
        self.num_pos_feats = num_pos_feats // 2  # per axis, as the official attribute
        self.temperature = temperature
        self.normalize = normalize
        self.scale = 2 * math.pi
        self._cache: dict[tuple, Tensor] = {}
        for height, width in sizes:
            table = self.table(height, width, torch.device("cpu"), torch.float32)
            self.register_buffer(self._buffer_name(height, width), table, persistent=False)

    @staticmethod
    def _buffer_name(height: int, width: int) -> str:
        return f"table_{height}x{width}"

    def table(self, height: int, width: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The [num_pos_feats, H, W] encoding (computed in fp32, then cast)."""
        y = torch.arange(1, height + 1, dtype=torch.float32, device=device)
        x = torch.arange(1, width + 1, dtype=torch.float32, device=device)
        if self.normalize:
            eps = 1e-6
            y = y / (height + eps) * self.scale
            x = x / (width + eps) * self.scale
        inv = _inverse_frequencies(self.num_pos_feats, self.temperature, device)
        pos_y, pos_x = y[:, None] / inv, x[:, None] / inv  # [H, F], [W, F]
        # Even features take the sine, odd ones the cosine, interleaved.
        pos_y = torch.stack((pos_y[:, 0::2].sin(), pos_y[:, 1::2].cos()), dim=2).flatten(1)
        pos_x = torch.stack((pos_x[:, 0::2].sin(), pos_x[:, 1::2].cos()), dim=2).flatten(1)
        f = self.num_pos_feats
        pos = torch.cat((pos_y[:, None, :].expand(height, width, f), pos_x[None, :, :].expand(height, width, f)), -1)
        return pos.permute(2, 0, 1).to(dtype).contiguous()

    def forward(self, x: Tensor) -> Tensor:
        height, width = x.shape[-2:]
        made = getattr(self, self._buffer_name(height, width), None)
        if made is not None:
            pos = made.to(x.dtype)
        elif torch.compiler.is_compiling():  # a graph computes (and may fold) it; no cache to guard on
            pos = self.table(height, width, x.device, x.dtype)
        else:
            key = (height, width, x.device, x.dtype)
            pos = self._cache.get(key)
            if pos is None:
                pos = self._cache[key] = self.table(height, width, x.device, x.dtype)
        return pos.unsqueeze(0).expand(x.shape[0], -1, -1, -1)
