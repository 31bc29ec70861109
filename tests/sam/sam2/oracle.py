"""Meta's official sam2 package as the test oracle: the official model and genfast's with the same
random weights (every tensor perturbed, so zero-initialized ones take part)."""

from __future__ import annotations

import torch

from genfast.sam.sam2.build import from_official_keys
from genfast.sam.sam2.config import Sam2Config
from genfast.sam.sam2.modeling.model import Sam2
from genfast.sam.sam2.official import build_official_sam2


def twin_models(
    config: Sam2Config, video: bool = False, seed: int = 0, scale: float = 0.1
) -> tuple[Sam2, torch.nn.Module]:
    """(genfast's model, the official one) with identical random weights, fp32, eval mode."""
    official = build_official_sam2(config, video=video)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in official.state_dict().values():
            tensor.add_(torch.randn(tensor.shape, generator=generator) * scale)
    ours = Sam2(config).eval()
    ours.load_state_dict(from_official_keys(official.state_dict()), strict=True)
    return ours, official
