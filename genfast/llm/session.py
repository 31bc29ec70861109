"""Loading a model and tokenizer for generation with the user's device/dtype/compile choices."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from genfast.errors import UserError
from genfast.hardware import resolve_device, resolve_dtype
from genfast.hub import resolve_model
from genfast.llm.checkpoint import checkpoint_format, load_model, read_model_args
from genfast.llm.generate import Generator
from genfast.llm.model import Transformer
from genfast.llm.tokenizer import Tokenizer, load_tokenizer
from genfast.nn import auto_weight_dtype, store_linear_weights
from genfast.quant import DEFAULT_INT4_GROUP_SIZE, INT4_GROUP_SIZES, QUANT_MODES
from genfast.quant.grids import QuantizedWeight


@dataclass
class LoadedModel:
    path: Path
    model: Transformer
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    quant: str = "none"  # how the weights are stored, e.g. "int4-g32" (also for quantized checkpoints)
    tp: int = 1  # tensor-parallel ranks: the model is this rank's shard (genfast/llm/tensor_parallel.py)
    weight_dtype: torch.dtype | None = None  # unquantized linears' storage, when not `dtype` (auto on AVX2: bf16)

    def dtype_label(self) -> str:
        """e.g. 'bfloat16', or 'float32 (bfloat16 linear weights)'."""
        label = str(self.dtype).removeprefix("torch.")
        if self.weight_dtype is not None:
            label += f" ({str(self.weight_dtype).removeprefix('torch.')} linear weights)"
        return label


def load(model: str | None, device: str = "auto", dtype: str = "auto", threads: int | None = None,
         quant: str = "none", group_size: int | None = None, tp: int = 1) -> LoadedModel:
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
    tokenizer = load_tokenizer(path)
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
    return LoadedModel(path, transformer, tokenizer, dev, dt, describe_quantization(transformer), tp,
                       None if weight_dt == dt else weight_dt)


# The output head is the layer most sensitive to quantization (measured on SmolLM2: an int4 head
# alone costs ~5% perplexity, an int8 one ~0.3%), so int4 models keep it in int8, as llama.cpp's
# 4-bit presets keep theirs at 6 or 8 bits.
HEAD = "output"
INT4_HEAD_BITS = 8


def quantize_loaded(path: Path, model: torch.nn.Module, bits: int, group_size: int | None,
                    precomputed: dict[str, QuantizedWeight] | None = None, prefix: str = "") -> list[str]:
    """Quantize every linear of a loaded model in place; returns the names replaced. `model` may
    be a part of the model, the module stored under `prefix` (e.g. a block being loaded).

    Per layer, the first that applies: `precomputed` weights (e.g. from GPTQ); the GGUF source's own
    blocks when they already are codes on a genfast grid (Q8_0 for int8, Q4_0/Q4_1 for int4, group
    32) and the group size allows, instead of dequantizing and requantizing; round-to-nearest.
    With bits=4 the output head is quantized to int8 (see INT4_HEAD_BITS)."""
    from genfast.llm.checkpoint import gguf_quantized_linears
    from genfast.quant.linear import QuantLinear, replace_linears

    precomputed = precomputed or {}
    head_bits = INT4_HEAD_BITS if bits == 4 else bits
    targets = {prefix + name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    direct: dict[str, QuantizedWeight] = {}
    if checkpoint_format(path) == "gguf":
        if group_size in (None, 32):
            direct = gguf_quantized_linears(path, bits, only=targets if head_bits == bits else targets - {HEAD})
        if head_bits != bits and HEAD in targets:
            direct.update(gguf_quantized_linears(path, head_bits, only={HEAD}))
    default_group = group_size or (None if bits == 8 else DEFAULT_INT4_GROUP_SIZE)

    def make(local: str, linear: torch.nn.Linear) -> QuantLinear:
        name = prefix + local
        bias = None if linear.bias is None else linear.bias.detach().clone()
        qw = precomputed.get(name) or direct.get(name)
        if qw is not None:
            return QuantLinear(qw.to(linear.weight.device), bias)
        if name == HEAD and head_bits != bits:
            return QuantLinear.from_linear(linear, head_bits)
        return QuantLinear.from_linear(linear, bits, default_group)

    return [prefix + local for local in replace_linears(model, make)]


def describe_quantization(model: torch.nn.Module) -> str:
    """'none', or the schemes of the model's quantized linears, e.g. 'int4-g32' or 'int8-g576+int8-g32'."""
    from genfast.quant.linear import QuantLinear

    schemes = []
    for module in model.modules():
        if isinstance(module, QuantLinear):
            scheme = f"int{module.bits}-g{module.group_size}"
            if module.group_size == module.padded_in_features and module.bits == 8:
                scheme = "int8"  # one scale per output channel
            if scheme not in schemes:
                schemes.append(scheme)
    return "+".join(schemes) or "none"


def make_generator(loaded: LoadedModel, max_seq_len: int | None, batch_size: int, compile: bool,
                   draft: str | None = None, speculate_k: int | None = None) -> Generator:
    """A Generator, or with `draft` (see genfast.llm.speculative.parse_draft) a speculative one
    drafting `speculate_k` tokens per target pass."""
    if draft is None:
        if speculate_k is not None:
            raise UserError("--speculate-k needs --draft, --self-draft or --prompt-lookup")
        return Generator(loaded.model, loaded.tokenizer, max_seq_len=max_seq_len, max_batch_size=batch_size,
                         compile=compile)
    from genfast.llm.speculative import DEFAULT_K, SpeculativeGenerator, make_drafter

    if batch_size != 1:
        raise UserError(f"speculative decoding runs one prompt at a time; got {batch_size} prompts")
    if loaded.tp > 1:
        raise UserError("speculative decoding does not combine with --tp yet; drop one of them")
    return SpeculativeGenerator(loaded.model, loaded.tokenizer, make_drafter(draft, loaded),
                                k=speculate_k or DEFAULT_K, max_seq_len=max_seq_len, compile=compile)
