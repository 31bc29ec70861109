"""2:4 semi-structured sparsity: magnitude pruning and torch's sparse kernels (CUDA, Ampere and
newer; torch has none for the CPU, where `to_sparse_semi_structured` raises)."""

from __future__ import annotations

import torch
from torch import nn


def sparse_2_4_unavailable(device: torch.device) -> str | None:
    """Why 2:4 sparse kernels cannot run on `device`, or None."""
    if device.type != "cuda":
        return f"torch has no 2:4 semi-structured sparse kernels for {device.type} (CUDA only)"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 8:
        return "2:4 sparse kernels need an Ampere or newer GPU"
    return None


@torch.no_grad()
def prune_2_4_(linear: nn.Linear) -> None:
    """Zero the two smallest-magnitude weights of every 4 consecutive inputs, in place."""
    weight = linear.weight
    if weight.shape[1] % 4:
        raise ValueError(f"2:4 pruning needs in_features divisible by 4, got {weight.shape[1]}")
    groups = weight.view(weight.shape[0], -1, 4)
    smallest = groups.abs().argsort(dim=-1)[..., :2]
    groups.scatter_(-1, smallest, 0)


def sparsify_2_4_(module: nn.Module) -> list[str]:
    """Prune every linear of `module` to 2:4 and store it in torch's semi-structured sparse format
    (CUDA only: call sparse_2_4_unavailable first). Returns the names of the changed linears."""
    from torch.sparse import to_sparse_semi_structured

    names = []
    for name, linear in module.named_modules():
        if isinstance(linear, nn.Linear) and linear.in_features % 64 == 0 and linear.out_features % 64 == 0:
            prune_2_4_(linear)
            linear.weight = nn.Parameter(to_sparse_semi_structured(linear.weight), requires_grad=False)
            names.append(name)
    return names
