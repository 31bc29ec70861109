"""int4 codes eight to an int32 word, the form the CUDA kernels' int4 layouts are made of (Triton's
qlinear, triton/qlinear.py, and aten's tinygemm, genfast.quant.tinygemm)."""

from __future__ import annotations

import torch
from torch import Tensor


def words_from_nibbles(nibbles: Tensor) -> Tensor:
    """int32 words from their eight codes in [0, 15] along the last dimension, code i in bits
    4i..4i+3 (the CUDA kernels' int4 layouts). Formed in int64: callers pack a large weight a few
    rows at a time."""
    shifts = 4 * torch.arange(8, device=nibbles.device, dtype=torch.int64)
    words = (nibbles.to(torch.int64) << shifts).sum(dim=-1)  # the nibbles' bits do not overlap: the sum is their OR
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as int32's two's complement


def nibbles_from_words(words: Tensor) -> Tensor:
    """Inverse of `words_from_nibbles`: [..., 8] uint8 codes. Element-wise, so under torch.compile
    it fuses with what reads the codes."""
    shifts = 4 * torch.arange(8, device=words.device, dtype=torch.int32)
    # An arithmetic shift of a negative word fills with ones above the nibble; the mask drops them.
    return ((words.unsqueeze(-1) >> shifts) & 15).to(torch.uint8)
