"""GPTQ (Frantar et al., 2022): int4 groupwise weights chosen against calibration activations.

Round-to-nearest (RTN) minimizes each weight's own error. GPTQ minimizes the layer's output error
||X W^T - X Q^T||^2 = tr((W - Q) H (W - Q)^T) with H = 2/n X^T X: it quantizes one input column at
a time and moves that column's rounding error onto the columns not yet quantized, weighted by the
inverse Hessian, so correlated inputs cancel each other's errors. The result is stored on exactly
the grid `grids.quantize` produces (uint8 codes, fp16 scale and minimum per row and group), so one
kernel serves both.

The column loop follows the paper: the inverse Hessian's upper Cholesky factor gives every update
at once, and updates are applied lazily, a block of columns at a time, so the bulk of the work is a
matrix product per block. A group's grid is fitted to its weights as they stand when its first
column comes up, after the updates from earlier columns (the reference GPTQ with groups).
Calibration of a whole model is workload-specific: genfast/llm/checkpoints/calibration.py for the LLM.
"""

from __future__ import annotations

import torch
from torch import Tensor

from genfast.quant.grids import (
    QuantizedWeight,
    check_group_size,
    group_grid,
    padded_in_features,
    quantize_to_grid,
)


class HessianAccumulator:
    """Running H = 2/n * sum x x^T over the rows x of every input seen, in fp32 (or `dtype`).

    Sums, not running means: a rank-k update per batch is one matrix product, and fp32 sums over
    tens of thousands of tokens lose nothing that dampening does not swamp.
    """

    def __init__(
        self, in_features: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
    ) -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=dtype, device=device)
        self.count = 0

    def add(self, x: Tensor) -> None:
        """Add the rows of `x` [..., in_features] (any float dtype)."""
        rows = x.detach().reshape(-1, x.shape[-1]).to(self.sum.dtype)
        self.sum.addmm_(rows.T, rows)
        self.count += rows.shape[0]

    @property
    def hessian(self) -> Tensor:
        if self.count == 0:
            raise ValueError("no inputs were added to the Hessian")
        return self.sum * (2 / self.count)


def _inverse_hessian_factor(hessian: Tensor, damping: float) -> Tensor | None:
    """Upper Cholesky factor of (H + damping * I)^-1, or None if H is not positive definite."""
    h = hessian.clone()
    h.diagonal().add_(damping)
    factor, info = torch.linalg.cholesky_ex(h)
    if info.item() != 0:
        return None
    inverse = torch.cholesky_inverse(factor)
    upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
    return upper if info.item() == 0 and upper.isfinite().all() else None


def _block_size(block_size: int, group_size: int) -> int:
    """A block size at which every group starts at a block start.

    Then a group's weights are all current when its grid is fitted: the block's own columns have
    just been copied out, and later blocks hold every lazy update applied so far.
    """
    if group_size <= block_size:
        return block_size - block_size % group_size
    return block_size if group_size % block_size == 0 else group_size


def gptq_quantize(
    weight: Tensor,
    hessian: Tensor,
    bits: int = 4,
    group_size: int = 128,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
) -> QuantizedWeight:
    """GPTQ-quantize `weight` [N, K] for inputs with Hessian `hessian` [K, K] (see HessianAccumulator).

    Returns a `QuantizedWeight` laid out exactly as `grids.quantize(weight, bits, group_size)`.
    Columns whose inputs are always zero (dead, diag H == 0) are quantized as zeros.
    act_order: quantize columns in order of decreasing diag H (largest inputs first, while the most
    columns are left to absorb their errors). Group grids are then fitted up front to the original
    weights ("static groups"), so groups stay contiguous column ranges and codes stay in column order.
    """
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"Hessian of shape {tuple(hessian.shape)} does not match a weight with {k} columns")
    check_group_size(bits, group_size, k)
    k_padded = padded_in_features(k, group_size)
    device = weight.device

    w = torch.zeros(n, k_padded, dtype=torch.float32, device=device)
    w[:, :k] = weight.detach().float()
    h = torch.eye(k_padded, dtype=torch.float32, device=device)  # padding: independent, zero weight
    h[:k, :k] = hessian.to(device=device, dtype=torch.float32)
    if not h.isfinite().all():
        raise ValueError("the Hessian has non-finite entries")
    dead = h.diagonal() == 0
    h.diagonal()[dead] = 1
    w[:, dead] = 0
    mean_diagonal = h.diagonal()[:k].mean().item()  # of the real columns, not the padding

    codes = torch.zeros(n, k_padded, dtype=torch.uint8, device=device)
    if act_order:
        scales, mins = group_grid(w, bits, group_size)  # static groups, from the original weights
        order = torch.argsort(h.diagonal()[:k], descending=True)
        order = torch.cat([order, torch.arange(k, k_padded, device=device)])
        w, h = w[:, order], h[order][:, order]
        column_group = (order // group_size).tolist()
    else:  # fitted as each group comes up
        scales = torch.zeros(n, k_padded // group_size, dtype=torch.float16, device=device)
        mins = torch.zeros_like(scales)
    hinv = _inverse_hessian_factor(h, damp * mean_diagonal)
    if hinv is None:
        hinv = _inverse_hessian_factor(h, 10 * damp * mean_diagonal)
    if hinv is None:
        raise ValueError(
            f"the Hessian is not positive definite even with dampening {10 * damp:g} x "
            "mean(diag H) (too few or degenerate calibration inputs?)"
        )

    block_size = _block_size(block_size, group_size)
    for start in range(0, k_padded, block_size):
        end = min(start + block_size, k_padded)
        block = w[:, start:end].clone()
        errors = torch.zeros_like(block)
        hinv_block = hinv[start:end, start:end]
        for i in range(end - start):
            col = start + i
            if act_order:
                group = column_group[col]
            else:
                group = col // group_size
                if col % group_size == 0:
                    group_end = col + group_size
                    current = torch.cat([block[:, i:], w[:, end:group_end]], dim=1)[:, :group_size]
                    scales[:, group : group + 1], mins[:, group : group + 1] = group_grid(current, bits, group_size)
            scale, minimum = scales[:, group], mins[:, group]
            column = block[:, i]
            code = quantize_to_grid(column, scale, minimum, bits)
            codes[:, col] = code
            quantized = code.float() * scale.float() + minimum.float()
            error = (column - quantized) / hinv_block[i, i]
            block[:, i:].addr_(error, hinv_block[i, i:], alpha=-1)
            errors[:, i] = error
        w[:, end:] -= errors @ hinv[start:end, end:]

    if act_order:
        codes = torch.empty_like(codes).index_copy_(1, order, codes)
    return QuantizedWeight(codes, scales, mins, bits, group_size, k)
