"""Loading a model and tokenizer for generation with the user's device/dtype/compile choices."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from genfast.errors import UserError
from genfast.hub import resolve_model
from genfast.llm.checkpoint import load_model
from genfast.llm.generate import Generator
from genfast.llm.model import Transformer
from genfast.llm.tokenizer import Tokenizer, load_tokenizer
from genfast.quant import QUANT_MODES

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise UserError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but this torch build sees no CUDA GPU")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device {name!r} is not supported; use cpu or cuda")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16: on CUDA, and on CPUs too, where compiled bf16 decode is the fastest
    (docs/performance.md); fp16 on CPU is refused (no fast kernels)."""
    if name == "auto":
        return torch.bfloat16
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16")
    dtype = DTYPES[name]
    if dtype == torch.float16 and device.type == "cpu":
        raise UserError("float16 is slow and poorly supported on CPU; use bfloat16 or float32")
    return dtype


@dataclass
class LoadedModel:
    path: Path
    model: Transformer
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    quant: str = "none"


def load(model: str | None, device: str = "auto", dtype: str = "auto", threads: int | None = None,
         quant: str = "none") -> LoadedModel:
    """Resolve, load and (optionally) quantize a model; `quant`: none | int8 (weight-only)."""
    if quant not in QUANT_MODES:
        raise UserError(f"unknown --quant {quant!r}; use one of {', '.join(QUANT_MODES)}")
    if threads is not None:
        if threads < 1:
            raise UserError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = resolve_model(model)
    tokenizer = load_tokenizer(path)
    transformer = load_model(path, dt, dev)
    if quant == "int8":
        from genfast.quant.weight_only import quantize_linears_int8

        quantize_linears_int8(transformer)
    return LoadedModel(path, transformer, tokenizer, dev, dt, quant)


def make_generator(loaded: LoadedModel, max_seq_len: int | None, batch_size: int, compile: bool) -> Generator:
    return Generator(loaded.model, loaded.tokenizer, max_seq_len=max_seq_len, max_batch_size=batch_size,
                     compile=compile)
