"""A pipeline's transformer quantized as it is loaded (`genfast imagine --quant int8`).

FLUX.1's transformer has 11.9 G parameters: 23.8 GB in bf16, more than a 24 GiB machine can
hold beside anything else. diffusers' loader fills the whole model at its stored precision before
any quantization could run, so genfast builds the transformer on the meta device from its config
(no memory), then allocates and fills it part by part: first everything outside its repeated
blocks (the embedders and the output layer), then one block at a time. Each part is quantized as
soon as it is filled (`prepare`), before the next is read, so at most one block exists at full
precision: peak memory is the quantized model plus one block (a FLUX.1 double-stream block is
340 M parameters, 0.7 GB in bf16). The weights come from the directory's safetensors shards,
read tensor by tensor (each shard is opened, read for one part and closed: its mapped pages do not
stay resident), or are drawn at random (`--random-weights`), part by part too.

`--quant int8` is the recipe's dynamic-int8 step (genfast/diffusion/recipe.py) applied while
loading: every linear of >= `int8_min_features` inputs and outputs becomes genfast's int8
QuantLinear (int8 activations x per-channel int8 weights, the native kernel on CPU). The step
itself then finds no float linear left to quantize: applying it again changes nothing. The text
encoders' linears become weight-only int8 (`quantize_text_encoders`).

The same code loads any diffusers transformer whose blocks are repeated and whose buffers are all
stored (FLUX.1, SD 3/3.5; not PixArt, whose position table is computed when it is built):
`repeated_blocks` (genfast/diffusion/compiling.py) finds the blocks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from genfast.errors import UserError

QUANTS = ("none", "int8")
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")  # a pipeline's attributes
SINGLE_FILE = "diffusion_pytorch_model.safetensors"
INDEX_FILE = SINGLE_FILE + ".index.json"

Filler = Callable[[nn.Module, str], None]  # fills the module stored under a prefix, in place
Prepare = Callable[[str, nn.Module], None]  # e.g. quantizes a part once it is filled


def empty_model(cls: type, config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    """`cls(**config)` on the meta device, in `dtype`: its shapes without memory."""
    with torch.device("meta"):
        model = cls.from_config(config) if hasattr(cls, "from_config") else cls(**config)
    # torch's own cast: diffusers' `to` warns about keep-in-fp32 modules, none of which a cast of
    # tensors without storage can upset.
    return nn.Module.to(model, dtype=dtype).eval()


def block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The ModuleLists holding the model's repeated blocks (FLUX.1: double- and single-stream)."""
    from genfast.diffusion.compiling import repeated_blocks

    blocks = {id(b) for b in repeated_blocks(model)}
    return [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) and all(id(b) in blocks for b in module)
    ]


def load_in_parts(
    model: nn.Module, fill: Filler, device: torch.device | str, prepare: Prepare | None = None
) -> nn.Module:
    """Allocate and fill `model` (built on the meta device: `empty_model`) on `device` part by
    part: the stem (every module outside the repeated blocks) first, then each block
    ("transformer_blocks.0." ...), calling `prepare(prefix, block)` on each block once filled,
    and last `prepare("", model)` (the stem's turn: what is still unprepared is the stem's). Only
    the block being filled is at its stored size beside the prepared ones and the stem."""
    computed = [name for name, _ in model.named_buffers() if name not in model.state_dict()]
    if computed:  # not in a checkpoint, and to_empty would leave them uninitialized
        raise UserError(
            f"{type(model).__name__} computes buffers when built ({computed[0]}), which loading in parts would leave "
            "empty: load it without --quant (PixArt's transformer is 0.6 G parameters)"
        )
    lists = block_lists(model)
    for name, _ in lists:  # the stem alone, as the LLM loader does with its layers
        model.set_submodule(name, nn.ModuleList())
    fill(model.to_empty(device=device), "")
    for name, blocks in lists:
        model.set_submodule(name, blocks)
    for list_name, blocks in lists:
        for i, block in enumerate(blocks):
            prefix = f"{list_name}.{i}."
            fill(block.to_empty(device=device), prefix)
            if prepare is not None:
                prepare(prefix, block)
    if prepare is not None:
        prepare("", model)
    return model.requires_grad_(False)


def _stored(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's tensors a checkpoint stores: parameters and persistent buffers."""
    persistent = set()
    for name, sub in module.named_modules():
        skip = getattr(sub, "_non_persistent_buffers_set", set())
        persistent |= {(f"{name}.{b}" if name else b) for b, _ in sub.named_buffers(recurse=False) if b not in skip}
    return [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if n in persistent)]


class SafetensorsWeights:
    """A diffusers model directory's weights (one safetensors file, or shards with an index),
    read tensor by tensor into the parts of a model being loaded (`fill`)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index, single = directory / INDEX_FILE, directory / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise UserError(f"{index}: not a readable safetensors index ({e})") from e
            self.files = {name: directory / file for name, file in weight_map.items()}
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), single)
        else:
            raise UserError(
                f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}: genfast loads transformers quantized "
                "from safetensors only"
            )
        self.unread = set(self.files)

    def fill(self, module: nn.Module, prefix: str) -> None:
        from safetensors import safe_open

        by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
        for local, tensor in _stored(module):
            name = prefix + local
            if name not in self.files:
                raise UserError(f"{self.directory}: the checkpoint lacks tensor {name}, which the config implies")
            by_file.setdefault(self.files[name], []).append((name, tensor))
        with torch.no_grad():
            for path, tensors in by_file.items():
                with safe_open(path, framework="pt") as f:  # closed after this part: its pages unmapped
                    for name, tensor in tensors:
                        stored = f.get_tensor(name)
                        if stored.shape != tensor.shape:
                            raise UserError(
                                f"{path}: tensor {name} has shape {tuple(stored.shape)} but the config implies "
                                f"{tuple(tensor.shape)}; the checkpoint and its config disagree"
                            )
                        tensor.copy_(stored)
                        self.unread.discard(name)

    def check_all_read(self) -> None:
        if self.unread:
            name = sorted(self.unread)[0]
            raise UserError(
                f"{self.directory}: tensor {name} (and {len(self.unread) - 1} more) fits nowhere in the model "
                "its config describes"
            )


def fill_random(module: nn.Module, prefix: str) -> None:
    """Random weights as the modules' constructors draw them (`reset_parameters`: torch's Linear,
    LayerNorm, Conv and Embedding initializations) from torch's global generator; other
    parameters (diffusers' RMSNorm) as their constructors set them, norms' 1-D weights to one and
    biases to zero; other tensors (SD3's position table) N(0, 0.02). For timing: the values do not
    change the speed."""
    with torch.no_grad():
        drawn: set[int] = set()
        for _, sub in module.named_modules():
            own = list(sub.parameters(recurse=False))
            if own and hasattr(sub, "reset_parameters"):
                sub.reset_parameters()
                drawn |= {id(p) for p in own}
        for name, tensor in _stored(module):
            if id(tensor) in drawn or not tensor.is_floating_point():
                continue
            if tensor.dim() == 1 and name.endswith(("weight", "bias")):
                tensor.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                tensor.normal_(0.0, 0.02)


def int8_prepare(min_features: int) -> Prepare:
    """The dynamic-int8 step's quantization (genfast/diffusion/recipe.py) of one loaded part."""
    from genfast.quant.linear import narrower_than, quantize_dynamic_int8

    def prepare(prefix: str, part: nn.Module) -> None:
        quantize_dynamic_int8(part, keep=narrower_than(min_features))

    return prepare


def transformer_spec(directory: Path) -> tuple[type, dict[str, Any]]:
    """The transformer class and config of a diffusers pipeline directory."""
    import diffusers

    try:
        library, name = json.loads((directory / "model_index.json").read_text())["transformer"]
        config = json.loads((directory / "transformer" / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"{directory}: no transformer/config.json or no transformer in model_index.json ({e}): --quant int8 "
            "loads the transformer of a transformer pipeline (FLUX.1, SD 3/3.5, PixArt)"
        ) from e
    cls = getattr(diffusers, name, None)
    if library != "diffusers" or cls is None:
        raise UserError(f"{directory}: transformer class {library}.{name} is not one diffusers has")
    return cls, {k: v for k, v in config.items() if not k.startswith("_")}


def load_transformer(
    directory: Path, dtype: torch.dtype, device: torch.device | str, prepare: Prepare | None = None
) -> nn.Module:
    """The pipeline directory's transformer, filled from its safetensors in parts (`load_in_parts`)."""
    cls, config = transformer_spec(directory)
    weights = SafetensorsWeights(directory / "transformer")
    model = load_in_parts(empty_model(cls, config, dtype), weights.fill, device, prepare)
    weights.check_all_read()
    return model


def random_transformer(
    cls: type, config: dict[str, Any], dtype: torch.dtype, device: torch.device | str, seed: int,
    prepare: Prepare | None = None,
) -> nn.Module:  # fmt: skip
    """A transformer of `cls(**config)` with random weights drawn part by part (`fill_random`)
    from `seed`, each part prepared (quantized) before the next is drawn."""
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return load_in_parts(empty_model(cls, config, dtype), fill_random, device, prepare)


def quantize_text_encoders(pipe: Any) -> list[str]:
    """Every text encoder's linears as weight-only int8 (per output channel, activations in int8
    blocks of 32 by the native kernel: llama.cpp's Q8_0 arithmetic, which FLUX.1 users commonly
    run T5-XXL in). T5's feed-forward output (`wo`) stays: transformers reads its weight's dtype.
    T5-XXL: 9.5 GB in bf16 -> 5.9 GB. Returns the encoders quantized."""
    from genfast.quant.linear import quantize_linears

    def keep(name: str, linear: nn.Linear) -> bool:
        return name.endswith(".wo")

    names = [n for n in TEXT_ENCODERS if getattr(pipe, n, None) is not None]
    for name in names:
        quantize_linears(getattr(pipe, name), 8, keep=keep)
    return names
