"""Loading a model and its tokenizer to run: on the user's device, in their dtype, quantized and
sharded block by block as the weights load (the recipe's dtype and quantization: genfast/llm/recipe.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from genfast.errors import UserError
from genfast.llm.checkpoints.checkpoint import Checkpoint, resolve_checkpoint
from genfast.llm.checkpoints.quantize import describe_quantization, quantize_loaded
from genfast.llm.checkpoints.tokenizer import Tokenizer, load_tokenizer
from genfast.llm.checkpoints.weights import load_model
from genfast.llm.model import invariance
from genfast.llm.model.transformer import Transformer
from genfast.nn import auto_weight_dtype, store_linear_weights
from genfast.platform.hardware import resolve_device, resolve_dtype
from genfast.platform.hugepages import move_to_hugepages
from genfast.quant import INT4_GROUP_SIZES, QUANT_MODES


@dataclass
class LoadedModel:
    checkpoint: Checkpoint  # what it was loaded from (a self-draft loads it again)
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
    # Recipe steps whose transforms changed the model after loading (a process that reloads it to
    # compile for it could not redo them).
    transforms: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return self.checkpoint.path

    @property
    def batch_invariant(self) -> bool:
        return invariance.is_batch_invariant(self.model)

    def dtype_label(self) -> str:
        """e.g. 'bfloat16', or 'float32 (bfloat16 linear weights and KV cache)'."""
        label = str(self.dtype).removeprefix("torch.")
        if self.weight_dtype is not None:
            label += f" ({str(self.weight_dtype).removeprefix('torch.')} linear weights and KV cache)"
        return label


def load(
    model: str | Checkpoint | None,
    device: str = "auto",
    dtype: str = "auto",
    threads: int | None = None,
    quant: str = "none",
    group_size: int | None = None,
    tp: int = 1,
    batch_invariant: bool | None = None,
) -> LoadedModel:
    """Resolve, load and (optionally) quantize a model: `model` is a --model value or a Checkpoint
    already opened; `quant`: none | int8 | int4 (weight-only, round-to-nearest, `group_size`
    columns per scale; default: per channel for int8, 32 for int4).
    `tp` > 1: keep this rank's tensor-parallel shard (after quantizing: codes are sliced, never
    re-quantized); this process must have joined the ranks (tensor_parallel.join).
    `batch_invariant`: every linear and attention through the batch-invariant kernels
    (genfast/llm/model/invariance.py): True demands it (a UserError says why where the model cannot
    run so), None takes it where the model and machine allow, False never."""
    if quant not in QUANT_MODES:
        raise UserError(f"unknown --quant {quant!r}; use one of {', '.join(QUANT_MODES)}")
    if group_size is not None and quant == "none":
        raise UserError("--group-size needs --quant int8 or int4")
    if quant == "int4" and group_size is not None and group_size not in INT4_GROUP_SIZES:
        raise UserError(f"--group-size for int4 must be one of {', '.join(map(str, INT4_GROUP_SIZES))}")
    if quant == "int8" and group_size is not None and group_size % 32:
        raise UserError("--group-size for int8 must be a multiple of 32")
    if batch_invariant and quant != "none":
        raise UserError("--batch-invariant has no kernels for quantized weights yet; drop --quant or it")
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
    checkpoint = model if isinstance(model, Checkpoint) else resolve_checkpoint(model)
    tokenizer = load_tokenizer(checkpoint)
    if quant != "none" and checkpoint.format == "genfast":
        raise UserError(f"{checkpoint.path} is already quantized; load it without --quant")
    bits = {"none": None, "int8": 8, "int4": 4}[quant]
    if tp > 1:
        from genfast.llm.tensor_parallel import check_shardable, current_rank, shard_block

        check_shardable(checkpoint.args, tp)
        rank = current_rank()

    def prepare_block(prefix: str, block: torch.nn.Module) -> None:
        # Quantize and shard each block as it is loaded: the whole model never exists at full size
        # (a model that needs --tp because it does not fit one device must not be loaded whole).
        if bits is not None:
            quantize_loaded(checkpoint, block, bits, group_size, prefix=prefix)
        if tp > 1:
            shard_block(block, rank, tp, prefix)
        store_linear_weights(block, weight_dt)

    transformer = load_model(checkpoint, dt, dev, prepare_block)
    if bits is not None:
        quantize_loaded(checkpoint, transformer, bits, group_size)  # what is left: the output head
    store_linear_weights(transformer, weight_dt)  # the head (and an embedding table tied to it)
    if weight_dt != dt:
        transformer.cache_dtype = weight_dt
    if dev.type == "cpu":
        move_to_hugepages(transformer)  # decode streams the weights: 2 MB pages read them faster
        from genfast.kernels.decode_attention.ops import build_for

        build_for(transformer.args.head_dim)
    if batch_invariant or (batch_invariant is None and invariance.unavailable_reason(transformer) is None):
        invariance.make_batch_invariant(transformer)
    return LoadedModel(
        checkpoint,
        transformer,
        tokenizer,
        dev,
        dt,
        describe_quantization(transformer),
        tp,
        None if weight_dt == dt else weight_dt,
        {
            "model": str(checkpoint.path),
            "device": str(dev),
            "dtype": dtype,
            "quant": quant,
            "group_size": group_size,
            "batch_invariant": batch_invariant,
        },
    )
