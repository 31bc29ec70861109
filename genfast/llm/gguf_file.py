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

GGUF_MAGIC = b"GGUF"
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
