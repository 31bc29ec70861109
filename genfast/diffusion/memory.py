"""How much memory loading and running a pipeline takes, known before anything is loaded.

The pipeline's models are built on the meta device from their configs (no memory) and their
bytes counted as they will be held: parameters and stored buffers in the load dtype, or, for the
linears `--quant int8` quantizes, one byte per weight plus the per-channel scales. Loading goes in
two stages, and the peak is the larger:
- the text encoders and the VAE as stored (`--quant int8` quantizes the encoders next);
- then the text encoders as kept, the VAE and the transformer, plus, while the transformer is
  loaded in parts, one of its blocks at full size (genfast/diffusion/loading.py); without
  `--quant` the transformer is loaded whole.
Activations are allowed ACTIVATION_BYTES plus BYTES_PER_PIXEL per image pixel (the VAE decoder's
full-size feature maps dominate).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from genfast.diffusion.loading import TEXT_ENCODERS, block_lists
from genfast.errors import UserError

GIB = 2**30
ACTIVATION_BYTES = GIB // 2
BYTES_PER_PIXEL = 2048  # 0.5 GiB at 512x512, 2 GiB at 1024x1024


def module_bytes(module: nn.Module, dtype: torch.dtype, quantized: Any = None) -> int:
    """Bytes `module` holds with its floating tensors in `dtype`; `quantized(name, linear)` True
    for a linear held as int8 codes (one byte a weight, a 2-byte scale per output channel)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    int8 = {id(m.weight) for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and quantized is not None and quantized(name, m)}  # fmt: skip
    stored = module.state_dict(keep_vars=True)
    total = 0
    for tensor in {id(t): t for t in stored.values()}.values():
        if id(tensor) in int8:
            total += tensor.numel() + 2 * tensor.shape[0]
        else:
            total += tensor.numel() * (itemsize if tensor.is_floating_point() else tensor.element_size())
    return total


@dataclass(frozen=True)
class MemoryEstimate:
    peak: int
    transformer: int
    text_encoders: int
    quant: str

    def describe(self) -> str:
        return (
            f"~{self.peak / GIB:.1f} GiB (transformer {self.transformer / GIB:.1f} GiB, text encoders "
            f"{self.text_encoders / GIB:.1f} GiB{' in int8' if self.quant == 'int8' else ''}, and activations)"
        )


def estimate(
    models: dict[str, nn.Module], dtype: torch.dtype, quant: str, min_features: int, pixels: int
) -> MemoryEstimate:
    """The peak memory of loading and running a pipeline whose models (by component name:
    transformer, vae, text_encoder...) are `models`, built on the meta device, in `dtype`, with
    `--quant` `quant` (the transformer's linears of >= `min_features` in int8, the text encoders'
    but T5's `wo`: genfast/diffusion/loading.py), for images of `pixels` pixels."""
    int8 = quant == "int8"

    def wide(name: str, linear: nn.Linear) -> bool:
        return min(linear.in_features, linear.out_features) >= min_features

    def encoder_linear(name: str, linear: nn.Linear) -> bool:
        return not name.endswith(".wo")

    encoders = [models[n] for n in TEXT_ENCODERS if n in models]
    stored_encoders = sum(module_bytes(m, dtype) for m in encoders)
    kept_encoders = sum(module_bytes(m, dtype, encoder_linear if int8 else None) for m in encoders)
    vae = module_bytes(models["vae"], dtype) if "vae" in models else 0
    transformer = models["transformer"]
    held = module_bytes(transformer, dtype, wide if int8 else None)
    loading = 0
    if int8:
        blocks = [block for _, blocks in block_lists(transformer) for block in blocks]
        loading = max((module_bytes(b, dtype) for b in blocks), default=0)
    activations = ACTIVATION_BYTES + BYTES_PER_PIXEL * pixels
    peak = max(stored_encoders + vae, kept_encoders + vae + held + loading) + activations
    return MemoryEstimate(peak, held, kept_encoders, quant)


def directory_models(directory: Path) -> dict[str, nn.Module] | None:
    """The transformer, VAE and text encoders of a diffusers pipeline directory on the meta device,
    from their configs; None where the directory is not such a pipeline (a UNet one, unreadable
    files: the load says what is wrong)."""
    import diffusers
    import transformers

    try:
        index = json.loads((directory / "model_index.json").read_text())
        models = {}
        for name in ("transformer", "vae", *TEXT_ENCODERS):
            entry = index.get(name)
            if not isinstance(entry, list) or entry[1] is None:
                continue
            library, cls_name = entry
            if library == "transformers":
                cls = getattr(transformers, cls_name)
                config = transformers.AutoConfig.from_pretrained(directory / name)
                with torch.device("meta"):
                    models[name] = cls(config)
            else:
                cls = getattr(diffusers, cls_name)
                config = {k: v for k, v in json.loads((directory / name / "config.json").read_text()).items()
                          if not k.startswith("_")}  # fmt: skip
                with torch.device("meta"):
                    models[name] = cls.from_config(config)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return models if "transformer" in models else None


def check_fits(need: MemoryEstimate, available: int | None, what: str) -> None:
    """UserError when `need` exceeds `available` bytes (None: unknown, not checked), saying what
    to try."""
    if available is None or need.peak <= available:
        return
    advice = (
        "try --quant int8 (the transformer and text encoders in int8, loaded in parts)"
        if need.quant == "none"
        else "free memory (close other programs) or use a machine with more"
    )
    raise UserError(f"{what} needs {need.describe()}; this machine has {available / GIB:.1f} GiB available: {advice}")
