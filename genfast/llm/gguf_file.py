"""Reading GGUF files: metadata as plain Python values and tensors dequantized on demand.

The file is memory-mapped by the `gguf` package; a tensor is dequantized only when asked for,
so peak memory while loading is the model plus one tensor.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genfast.errors import UserError
from genfast.quant.grids import QuantizedWeight

GGUF_MAGIC = b"GGUF"
# Bytes per block of 32 weights for the types that load without requantization.
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
# Types genfast dequantizes (the `gguf` package implements the arithmetic).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


def is_gguf(path: Path) -> bool:
    """True when `path` is a file that starts with the GGUF magic (the name is not consulted)."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_gguf(path: Path) -> GGUFFile:
    """A GGUFFile, shared by the model and tokenizer loaders (parsing 100k vocabulary strings
    takes seconds); a file changed on disk is read again."""
    stat = path.stat()
    return _open_cached(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_cached(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


class GGUFFile:
    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader  # imported here: only GGUF users pay for it

        self.path = path
        try:
            self._reader = GGUFReader(path, "r")
            self.metadata: dict[str, Any] = {k: _field_value(f) for k, f in self._reader.fields.items()}
        except (ValueError, OSError, IndexError, KeyError, struct.error, UnicodeDecodeError) as e:
            raise UserError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from e
        self._tensors = {t.name: t for t in self._reader.tensors}

    @property
    def tensor_names(self) -> set[str]:
        return set(self._tensors)

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def quantized(self, name: str) -> QuantizedWeight | None:
        """The tensor's own blocks as genfast codes when its type maps exactly onto a genfast grid
        (Q8_0 -> int8, Q4_0 / Q4_1 -> int4, 32 columns per group), else None."""
        t = self._tensors[name]
        kind = t.tensor_type.name
        if kind not in _BLOCK_BYTES:
            return None
        rows, cols = (int(d) for d in reversed(t.shape))
        blocks = np.asarray(t.data, dtype=np.uint8).reshape(rows, cols // 32, _BLOCK_BYTES[kind])
        blocks = torch.from_numpy(np.array(blocks))
        scales = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
        if kind == "Q8_0":  # d, 32 x int8: w = q * d
            codes = (blocks[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
            mins = (-128 * scales.float()).to(torch.float16)
            return QuantizedWeight(codes.reshape(rows, cols), scales, mins, 8, 32, cols)
        if kind == "Q4_0":  # d, 16 bytes: w = (q - 8) * d
            nibbles, mins = blocks[..., 2:], (-8 * scales.float()).to(torch.float16)
        else:  # Q4_1: d, m, 16 bytes: w = q * d + m
            nibbles, mins = blocks[..., 4:], blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
        # Byte j of a block holds element j (low nibble) and element j + 16 (high nibble).
        codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)
        return QuantizedWeight(codes.reshape(rows, cols), scales, mins, 4, 32, cols)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor in its logical shape (rows = output features), as float32."""
        from gguf.quants import dequantize

        t = self._tensors[name]
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise UserError(
                f"{self.path}: tensor {name} is stored as {kind}; genfast reads {', '.join(SUPPORTED_TYPES)}"
            )
        shape = tuple(int(d) for d in reversed(t.shape))
        try:
            if kind == "F32":
                array = np.asarray(t.data, dtype=np.float32)
            elif kind == "F16":
                array = np.asarray(t.data).astype(np.float32)
            else:
                array = dequantize(t.data, t.tensor_type)
            # np.array copies: the memory map is read-only and torch wants writable memory.
            return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))
        except (ValueError, OSError) as e:
            raise UserError(f"{self.path}: tensor {name} cannot be read (truncated file?): {e}") from e


def _field_value(field: Any) -> Any:
    """Decode one GGUF key/value (strings, numbers, bools and arrays of them)."""
    from gguf import GGUFValueType

    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]].tolist()[0]
    return bool(value) if types[0] == GGUFValueType.BOOL else value
