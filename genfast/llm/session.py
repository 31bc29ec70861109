"""Loading a model and tokenizer for generation with the user's device/dtype/compile choices."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from genfast.errors import UserError
from genfast.llm.checkpoints.quantize import describe_quantization, quantize_loaded
from genfast.llm.checkpoints.random_model import is_random
from genfast.llm.checkpoints.tokenizer import Tokenizer, load_tokenizer, pydoc_tokenizer
from genfast.llm.checkpoints.weights import checkpoint_format, load_model, read_model_args
from genfast.llm.model.transformer import Transformer
from genfast.llm.recipe import RECIPE, LlmSettings
from genfast.nn import auto_weight_dtype, store_linear_weights
from genfast.platform.hardware import dtype_name, resolve_device, resolve_dtype
from genfast.platform.hugepages import move_to_hugepages
from genfast.platform.threads import OtherWork, avoid_busy_cores
from genfast.quant import INT4_GROUP_SIZES, QUANT_MODES
from genfast.recipe import Plan, Target, apply_transforms
from genfast.storage.hub import resolve_model


@dataclass
class LoadedModel:
    path: Path
    model: Transformer
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    quant: str = "none"  # how the weights are stored, e.g. "int4-g32" (also for quantized checkpoints)
    tp: int = 1  # tensor-parallel ranks: the model is this rank's shard (genfast/llm/tensor_parallel.py)
    # Unquantized linears' and the KV cache's storage, when not `dtype` (auto on AVX2: bf16).
    weight_dtype: torch.dtype | None = None
    # The `load` arguments that give this model again (another process compiling for it reloads it).
    load_args: dict[str, Any] = field(default_factory=dict)
    transforms: tuple[str, ...] = ()  # recipe steps whose own transform changed the model (apply_recipe)

    def dtype_label(self) -> str:
        """e.g. 'bfloat16', or 'float32 (bfloat16 linear weights and KV cache)'."""
        label = str(self.dtype).removeprefix("torch.")
        if self.weight_dtype is not None:
            label += f" ({str(self.weight_dtype).removeprefix('torch.')} linear weights and KV cache)"
        return label


def plan(
    step: str, device: str = "auto", dtype: str = "auto", quant: str | None = None, compile: bool = True
) -> Plan[LlmSettings]:
    """The LLM recipe up to `step` (genfast/llm/recipe.py) on `device`, `dtype` being the bf16
    step's; `quant` (when given) and `compile=False` override what the steps set: the flags
    --quant and --no-compile are shorthands on top of --recipe."""
    result = RECIPE.plan(step, Target(resolve_device(device), dtype_name(dtype)))
    settings = result.settings
    if quant is not None:
        if quant not in QUANT_MODES:
            raise UserError(f"unknown --quant {quant!r}; use one of {', '.join(QUANT_MODES)}")
        settings = replace(settings, quant=quant)
    if not compile:
        settings = replace(settings, compile=False)
    return replace(result, settings=settings)


def apply_recipe(loaded: LoadedModel, settings: LlmSettings) -> LoadedModel:
    """What the recipe does to a loaded model beyond `load`'s dtype and quantization: the steps
    that bring their own transform (genfast.recipe.apply_transforms; the model's one part is
    "model"). Compiling is the generator's (make_generator)."""
    apply_transforms(settings, {"model": loaded.model})
    loaded.transforms += tuple(step.name for step in settings.transforms)
    return loaded


def load_for_command(args: argparse.Namespace, settings: LlmSettings, log: Callable[[str], None],
                     tp: int = 1) -> LoadedModel:  # fmt: skip
    """The model that a run command's flags name (--model, --device, --threads, --group-size),
    loaded and run as `settings` say. Without --threads, on the CPU and in one process, the thread
    count leaves the cores that other processes kept busy while it loaded to them
    (genfast/platform/threads.py), and `log` says so."""
    other_work = OtherWork() if args.threads is None else None
    loaded = apply_recipe(
        load(args.model, args.device, settings.dtype, args.threads, settings.quant, args.group_size, tp), settings
    )
    if other_work is not None and genfast_chooses_threads(args, loaded):
        avoid_busy_cores(other_work, log)
    return loaded


def genfast_chooses_threads(args: argparse.Namespace, loaded: LoadedModel) -> bool:
    """Whether the thread count is genfast's to fit beside other work: no --threads, on the CPU, in
    one process (genfast/platform/threads.py also leaves a count from OMP_NUM_THREADS alone)."""
    return args.threads is None and loaded.device.type == "cpu" and loaded.tp == 1


def load(
    model: str | None,
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
    quant: str = "none",
    group_size: int | None = None,
    tp: int = 1,
) -> LoadedModel:
    """Resolve, load and (optionally) quantize a model; `quant`: none | int8 | int4 (weight-only,
    round-to-nearest, `group_size` columns per scale; default: per channel for int8, 32 for int4).
    `tp` > 1: keep this rank's tensor-parallel shard (after quantizing: codes are sliced, never
    re-quantized); this process must have joined the ranks (tensor_parallel.join)."""
    if quant not in QUANT_MODES:
        raise UserError(f"unknown --quant {quant!r}; use one of {', '.join(QUANT_MODES)}")
    if group_size is not None and quant == "none":
        raise UserError("--group-size needs --quant int8 or int4")
    if quant == "int4" and group_size is not None and group_size not in INT4_GROUP_SIZES:
        raise UserError(f"--group-size for int4 must be one of {', '.join(map(str, INT4_GROUP_SIZES))}")
    if quant == "int8" and group_size is not None and group_size % 32:
        raise UserError("--group-size for int8 must be a multiple of 32")
    if threads is not None:
        if threads < 1:
            raise UserError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    dev = resolve_device(device)
    if tp > 1:
        from genfast.llm.tensor_parallel import tp_device

        dev = tp_device(dev)
    dt = resolve_dtype(dtype, dev)
    weight_dt = auto_weight_dtype(dev, dt) if dtype == "auto" else dt
    path = resolve_model(model)
    tokenizer = pydoc_tokenizer() if is_random(path) else load_tokenizer(path)
    if quant != "none" and checkpoint_format(path) == "genfast":
        raise UserError(f"{path} is already quantized; load it without --quant")
    bits = {"none": None, "int8": 8, "int4": 4}[quant]
    if tp > 1:
        from genfast.llm.tensor_parallel import check_shardable, current_rank, shard_block

        check_shardable(read_model_args(path), tp)
        rank = current_rank()

    def prepare_block(prefix: str, block: torch.nn.Module) -> None:
        # Quantize and shard each block as it is loaded: the whole model never exists at full size
        # (a model that needs --tp because it does not fit one device must not be loaded whole).
        if bits is not None:
            quantize_loaded(path, block, bits, group_size, prefix=prefix)
        if tp > 1:
            shard_block(block, rank, tp, prefix)
        store_linear_weights(block, weight_dt)

    transformer = load_model(path, dt, dev, prepare_block)
    if bits is not None:
        quantize_loaded(path, transformer, bits, group_size)  # what is left: the output head
    store_linear_weights(transformer, weight_dt)  # the head (and an embedding table tied to it)
    if weight_dt != dt:
        transformer.cache_dtype = weight_dt
    if dev.type == "cpu":
        move_to_hugepages(transformer)  # decode streams the weights: 2 MB pages read them faster
        from genfast.llm.model.decode_attention import build_for

        build_for(transformer.args.head_dim)
    return LoadedModel(
        path,
        transformer,
        tokenizer,
        dev,
        dt,
        describe_quantization(transformer),
        tp,
        None if weight_dt == dt else weight_dt,
        {"model": str(path), "device": str(dev), "dtype": dtype, "quant": quant, "group_size": group_size},
    )
