"""Quantizing a loaded LLM's linears (weight-only int8/int4), and the rule for its output head.

`load(..., quant=...)` calls `quantize_loaded` block by block as the model is read; `genfast
quantize` writes the result to a directory that loads as it is (genfast/quant/checkpoint.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from genfast.quant import DEFAULT_INT4_GROUP_SIZE
from genfast.quant.grids import QuantizedWeight

if TYPE_CHECKING:
    from genfast.llm.checkpoints.checkpoint import Checkpoint

# The output head is the layer most sensitive to quantization (measured on SmolLM2: an int4 head
# alone costs ~5% perplexity, an int8 one ~0.3%), so int4 models keep it in int8, as llama.cpp's
# 4-bit presets keep theirs at 6 or 8 bits.
HEAD = "output"
INT4_HEAD_BITS = 8


def quantize_loaded(
    checkpoint: Checkpoint,
    model: torch.nn.Module,
    bits: int,
    group_size: int | None,
    precomputed: dict[str, QuantizedWeight] | None = None,
    prefix: str = "",
) -> list[str]:
    """Quantize every linear of a model loaded from `checkpoint` in place; returns the names
    replaced. `model` may be a part of the model, the module stored under `prefix` (e.g. a block
    being loaded).

    Per layer, the first that applies: `precomputed` weights (e.g. from GPTQ); the GGUF source's own
    blocks when they already are codes on a genfast grid (Q8_0 for int8, Q4_0/Q4_1 for int4, group
    32) and the group size allows, instead of dequantizing and requantizing; round-to-nearest.
    With bits=4 the output head is quantized to int8 (see INT4_HEAD_BITS)."""
    from genfast.llm.checkpoints.weights import gguf_quantized_linears
    from genfast.nn import ExpertLinear
    from genfast.quant.linear import QuantLinear, quantize_layer, quantized_layer, replace_linears

    precomputed = precomputed or {}
    head_bits = INT4_HEAD_BITS if bits == 4 else bits
    linears = (torch.nn.Linear, ExpertLinear)
    targets = {prefix + name for name, m in model.named_modules() if isinstance(m, linears)}
    direct: dict[str, QuantizedWeight] = {}
    if checkpoint.format == "gguf":
        if group_size in (None, 32):
            only = targets if head_bits == bits else targets - {HEAD}
            direct = gguf_quantized_linears(checkpoint, bits, only=only)
        if head_bits != bits and HEAD in targets:
            direct.update(gguf_quantized_linears(checkpoint, head_bits, only={HEAD}))
    default_group = group_size or (None if bits == 8 else DEFAULT_INT4_GROUP_SIZE)

    def make(local: str, linear: torch.nn.Linear | ExpertLinear) -> torch.nn.Module:
        name = prefix + local
        bias = None if linear.bias is None else linear.bias.detach().clone()
        qw = precomputed.get(name) or direct.get(name)
        if qw is not None:
            return quantized_layer(qw.to(linear.weight.device), bias, dtype=linear.weight.dtype)
        if name == HEAD and head_bits != bits:
            return QuantLinear.from_linear(linear, head_bits)
        return quantize_layer(linear, bits, default_group)

    return [prefix + local for local in replace_linears(model, make)]


def describe_quantization(model: torch.nn.Module) -> str:
    """'none', or the schemes of the model's quantized linears, e.g. 'int4-g32' or 'int8-g576+int8-g32'."""
    from genfast.quant.linear import QuantExpertLinear, QuantLinear

    schemes = []
    for module in model.modules():
        if isinstance(module, (QuantLinear, QuantExpertLinear)):
            scheme = f"int{module.bits}-g{module.group_size}"
            if module.group_size == module.padded_in_features and module.bits == 8:
                scheme = "int8"  # one scale per output channel
            if scheme not in schemes:
                schemes.append(scheme)
    return "+".join(schemes) or "none"
