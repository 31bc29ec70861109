"""Quantized checkpoints: one safetensors file whose header says how every layer is quantized.

Layout (format "genfast-quantized", version 1):
- for each quantized linear NAME: `NAME.codes` (uint8; int4 codes two per byte, even column in the
  low nibble), `NAME.scales` and `NAME.mins` (fp16, [out_features, groups]), `NAME.bias` if any;
  a mixture's experts (header "experts": E) stack theirs: [E, out_features, ...];
- every other tensor of the model under its state-dict name, in the dtype it was saved in;
- header metadata: "format", "version", "layers" (JSON: NAME -> bits, group_size, in_features,
  out_features, bias) and whatever the caller adds (the LLM adds its config and the method).
Nothing is inferred from file names; a file that does not say what it is is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from genfast.errors import UserError
from genfast.nn import ExpertLinear
from genfast.quant.grids import QuantizedWeight, check_group_size, pack_nibbles, unpack_nibbles
from genfast.quant.linear import QuantExpertLinear, QuantLinear, quantized_layer, replace_linears
from genfast.storage.files import make_public

FORMAT = "genfast-quantized"
VERSION = "1"


def _storage_tensors(name: str, layer: QuantLinear | QuantExpertLinear) -> dict[str, Tensor]:
    qw = layer.quantized_weight()
    tensors = {
        f"{name}.codes": pack_nibbles(qw.codes) if qw.bits == 4 else qw.codes,
        f"{name}.scales": qw.scales,
        f"{name}.mins": qw.mins,
    }
    if layer.bias is not None:
        tensors[f"{name}.bias"] = layer.bias
    return tensors


def save_quantized(
    model: nn.Module, path: Path, metadata: dict[str, str] | None = None, float_dtype: torch.dtype | None = None
) -> None:
    """Write `model` (with QuantLinear layers) to `path`, atomically (a reader never sees half a file).
    Unquantized floating-point tensors are stored in `float_dtype` (default: as they are)."""
    from safetensors.torch import save_file

    tensors: dict[str, Tensor] = {}
    layers: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        if isinstance(module, (QuantLinear, QuantExpertLinear)):
            tensors.update(_storage_tensors(name, module))
            layers[name] = {
                "bits": module.bits,
                "group_size": module.group_size,
                "in_features": module.in_features,
                "out_features": module.out_features,
                "bias": module.bias is not None,
            }
            if isinstance(module, QuantExpertLinear):
                layers[name]["experts"] = module.n_experts
    quantized_prefixes = tuple(f"{name}." for name in layers)
    for name, tensor in model.state_dict().items():
        if not name.startswith(quantized_prefixes) and ".kv_cache." not in name:
            tensors[name] = tensor.to(float_dtype) if float_dtype and tensor.is_floating_point() else tensor
    header = {"format": FORMAT, "version": VERSION, "layers": json.dumps(layers), **(metadata or {})}
    # safetensors refuses shared or non-contiguous storage: give each tensor its own.
    tensors = {k: v.detach().contiguous().clone() for k, v in tensors.items()}
    staging = path.with_name(f".{path.name}.partial")
    save_file(tensors, str(staging), metadata=header)
    make_public(staging)  # safetensors writes it 0600
    os.replace(staging, path)


class QuantizedCheckpoint:
    """A quantized safetensors file opened for reading (memory-mapped), with its header checked."""

    def __init__(self, path: Path) -> None:
        from safetensors import SafetensorError, safe_open

        self.path = path
        try:
            self._file = safe_open(str(path), framework="pt")
        except (OSError, SafetensorError) as e:
            raise UserError(f"cannot read {path} (missing, truncated or corrupt): {e}") from e
        self.metadata: dict[str, str] = self._file.metadata() or {}
        if self.metadata.get("format") != FORMAT:
            raise UserError(f"{path} is not a genfast quantized checkpoint (no format={FORMAT!r} in its header)")
        if self.metadata.get("version") != VERSION:
            raise UserError(
                f"{path}: quantized checkpoint version {self.metadata.get('version')!r} is not "
                f"supported (this genfast reads version {VERSION})"
            )
        try:
            self.layers: dict[str, dict[str, Any]] = json.loads(self.metadata["layers"])
        except (KeyError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: header has no valid 'layers' entry: {e}") from e
        self.names = set(self._file.keys())

    def get(self, name: str) -> Tensor:
        if name not in self.names:
            raise UserError(f"{self.path}: tensor {name} is missing (the header and the tensors disagree)")
        return self._file.get_tensor(name)

    def quantized_weight(self, name: str) -> QuantizedWeight:
        spec = self.layers[name]
        try:
            bits, group_size = int(spec["bits"]), int(spec["group_size"])
            n, k = int(spec["out_features"]), int(spec["in_features"])
            lead = (int(spec["experts"]),) if "experts" in spec else ()
            check_group_size(bits, group_size, k)
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{self.path}: layer {name} has an invalid quantization entry {spec}: {e}") from e
        codes, scales, mins = (self.get(f"{name}.{part}") for part in ("codes", "scales", "mins"))
        k_padded = -(-k // group_size) * group_size
        want = {
            "codes": (*lead, n, k_padded // 2 if bits == 4 else k_padded),
            "scales": (*lead, n, k_padded // group_size),
            "mins": (*lead, n, k_padded // group_size),
        }
        for part, tensor in (("codes", codes), ("scales", scales), ("mins", mins)):
            if tuple(tensor.shape) != want[part]:
                raise UserError(
                    f"{self.path}: {name}.{part} has shape {tuple(tensor.shape)}, but the header "
                    f"({bits}-bit, group {group_size}, {n}x{k}) implies {want[part]}"
                )
        if codes.dtype != torch.uint8 or scales.dtype != torch.float16 or mins.dtype != torch.float16:
            raise UserError(
                f"{self.path}: layer {name} has tensors of unexpected dtypes "
                f"({codes.dtype}, {scales.dtype}, {mins.dtype})"
            )
        if bits == 4:
            codes = unpack_nibbles(codes)
        return QuantizedWeight(codes, scales, mins, bits, group_size, k)


def load_quantized_into(
    model: nn.Module,
    checkpoint: QuantizedCheckpoint,
    convert: Callable[[str, Tensor], Tensor] | None = None,
    prefix: str = "",
    layers: Collection[str] | None = None,
) -> None:
    """Replace the linears named in the header by QuantLinear layers (experts: QuantExpertLinear)
    and fill every other tensor.

    `model` is built from the same config (on the target device, any floating dtype); `convert`
    maps each floating tensor to the model's dtype/device (default: cast to the parameter's).
    To fill a part of a model: `model` is the module the checkpoint stores under `prefix`
    (e.g. "layers.3."), and `layers` the header's layers it holds (default: all of them)."""
    layers = list(checkpoint.layers if layers is None else layers)
    modules = dict(model.named_modules())
    for name in layers:
        if not (name.startswith(prefix) and isinstance(modules.get(name[len(prefix) :]), (nn.Linear, ExpertLinear))):
            raise UserError(f"{checkpoint.path}: header lists layer {name}, which this model has no linear for")

    def make(local: str, linear: nn.Linear | ExpertLinear) -> nn.Module:
        name = prefix + local
        qw = checkpoint.quantized_weight(name)
        shape = (*qw.codes.shape[:-1], qw.in_features)
        if shape != tuple(linear.weight.shape):
            raise UserError(
                f"{checkpoint.path}: layer {name} is {'x'.join(map(str, shape))} in the "
                f"checkpoint but {tuple(linear.weight.shape)} in the model config"
            )
        device = linear.weight.device
        qw = qw.to(device)
        bias = checkpoint.get(f"{name}.bias").to(device) if checkpoint.layers[name].get("bias") else None
        return quantized_layer(qw, bias, dtype=linear.weight.dtype)

    local_layers = {name[len(prefix) :] for name in layers}
    replace_linears(model, make, keep=lambda local, _: local not in local_layers)
    state = model.state_dict()
    quantized_prefixes = tuple(f"{local}." for local in local_layers)
    with torch.no_grad():
        for local, target in state.items():
            if local.startswith(quantized_prefixes) or ".kv_cache." in local:
                continue
            name = prefix + local
            tensor = checkpoint.get(name)
            if tensor.shape != target.shape:
                raise UserError(
                    f"{checkpoint.path}: tensor {name} has shape {tuple(tensor.shape)}, the model "
                    f"config implies {tuple(target.shape)}"
                )
            target.copy_(convert(name, tensor) if convert else tensor)
