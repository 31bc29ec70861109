"""Quantization grids: how float weights map to integer codes and back (no kernels here).

Every scheme stores unsigned 8-bit codes `u` and, per output row and group of `group_size`
input columns, a scale and a minimum, so that

    w[n, k] ≈ u[n, k] * scale[n, g] + min[n, g],   g = k // group_size.

- int8 (symmetric): u = q + 128 with q in [-127, 127], min = -128 * scale; per output channel by
  default (group_size = in_features).
- int4 (asymmetric): u in [0, 15], scale = (max - min) / 15 over the group (llama.cpp's Q4_1 form;
  Q4_0's symmetric blocks are the special case min = -8 * scale).

One form for both lets a single kernel serve int8 and int4. Scales and minima are stored in fp16
(2 bytes each per group, as GGUF does) and the codes are computed against the fp16-rounded values,
so the stored grid is exactly the one the codes were chosen on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from genfast.quant import INT4_GROUP_SIZES

BITS = (4, 8)
SCALE_DTYPE = torch.float16


@dataclass
class QuantizedWeight:
    """Codes [N, K_padded] uint8, scales and mins [N, K_padded // group_size] fp16; a mixture's
    experts stack theirs ([E, N, ...], one grid per expert row as for a plain weight)."""

    codes: Tensor
    scales: Tensor
    mins: Tensor
    bits: int
    group_size: int
    in_features: int  # K before padding to a whole number of groups

    @property
    def out_features(self) -> int:
        return self.codes.shape[-2]

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(
            self.codes.to(device),
            self.scales.to(device),
            self.mins.to(device),
            self.bits,
            self.group_size,
            self.in_features,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """[N, in_features] weight ([E, N, in_features] for experts) in `dtype` (computed in fp32)."""
        groups = self.codes.float().reshape(*self.scales.shape, self.group_size)
        w = groups * self.scales.float()[..., None] + self.mins.float()[..., None]
        return w.reshape(self.codes.shape)[..., : self.in_features].to(dtype)


def padded_in_features(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size) * group_size


def check_group_size(bits: int, group_size: int, in_features: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if group_size <= 0 or group_size % 32:
        raise ValueError(f"group size must be a positive multiple of 32, got {group_size}")
    if bits == 4 and group_size not in INT4_GROUP_SIZES and group_size != padded_in_features(in_features, 32):
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")


def _pad_columns(w: Tensor, k_padded: int) -> Tensor:
    return torch.nn.functional.pad(w, (0, k_padded - w.shape[1])) if k_padded != w.shape[1] else w


def group_grid(w: Tensor, bits: int, group_size: int) -> tuple[Tensor, Tensor]:
    """(scales, mins) fp16 [N, groups] for a padded fp32 weight [N, K_padded]."""
    n, k = w.shape
    groups = w.reshape(n, k // group_size, group_size)
    if bits == 8:
        scales = (groups.abs().amax(dim=-1) / 127).to(SCALE_DTYPE)
        scales = torch.where(scales.float() > 0, scales, torch.ones_like(scales))  # all-zero groups
        return scales, (-128 * scales.float()).to(SCALE_DTYPE)
    lo = groups.amin(dim=-1).clamp(max=0)  # the range always spans 0 (as llama.cpp's Q4_1 does not need to)
    hi = groups.amax(dim=-1).clamp(min=0)
    scales = ((hi - lo) / 15).to(SCALE_DTYPE)
    scales = torch.where(scales.float() > 0, scales, torch.ones_like(scales))
    return scales, lo.to(SCALE_DTYPE)


def quantize_to_grid(w: Tensor, scales: Tensor, mins: Tensor, bits: int) -> Tensor:
    """Nearest codes (uint8) for fp32 `w` [N, K] on a given grid; scales/mins [N, K] or broadcastable."""
    top = 255 if bits == 8 else 15
    lowest = 1 if bits == 8 else 0  # int8 is symmetric: q = u - 128 in [-127, 127]
    u = torch.round((w - mins.float()) / scales.float())
    return u.clamp(lowest, top).to(torch.uint8)


# Rows are quantized this many elements at a time: the fp32 temporaries take ~20 bytes per weight,
# which for a whole output head (e.g. 152k x 896) was 2.7 GB at once; per chunk it is ~80 MB.
QUANTIZE_CHUNK_ELEMENTS = 1 << 22


def quantize(weight: Tensor, bits: int, group_size: int | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of a [N, K] weight (or experts' [E, N, K]). int8 defaults to
    one group per row."""
    if weight.dim() == 3:  # rows are quantized independently: the experts' rows, one after another
        flat = quantize(weight.reshape(-1, weight.shape[-1]), bits, group_size)
        lead = weight.shape[:2]
        return QuantizedWeight(
            *(t.reshape(*lead, t.shape[-1]) for t in (flat.codes, flat.scales, flat.mins)),
            bits,
            flat.group_size,
            flat.in_features,
        )
    n, k = weight.shape
    group_size = group_size or (padded_in_features(k, 32) if bits == 8 else 128)
    check_group_size(bits, group_size, k)
    k_padded = padded_in_features(k, group_size)
    codes = torch.empty(n, k_padded, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(n, k_padded // group_size, dtype=SCALE_DTYPE, device=weight.device)
    mins = torch.empty_like(scales)
    rows = max(1, QUANTIZE_CHUNK_ELEMENTS // k_padded)
    for start in range(0, n, rows):  # rows are independent: chunking changes no result
        w = _pad_columns(weight[start : start + rows].detach().float(), k_padded)
        s, m = group_grid(w, bits, group_size)
        # The grid broadcast over each group's columns (not expanded to [rows, K]: the same values,
        # without two more fp32 copies of the chunk; 3x faster on FLUX.1's 12288 x 3072 linears).
        groups = w.reshape(w.shape[0], -1, group_size)
        grid = quantize_to_grid(groups, s[..., None], m[..., None], bits)
        codes[start : start + rows] = grid.reshape(w.shape)
        scales[start : start + rows], mins[start : start + rows] = s, m
    return QuantizedWeight(codes, scales, mins, bits, group_size, k)


def pack_nibbles(codes: Tensor) -> Tensor:
    """[..., K] codes in [0, 15] -> [..., K / 2] bytes, even column in the low nibble (storage form)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
