"""Reading GGUF files: metadata as plain Python values and tensors dequantized on demand.

The file is memory-mapped; a tensor is dequantized only when asked for, so peak memory while
loading is the model plus one tensor. The header is parsed here (see `_Header`); the K-quants'
dequantization is the `gguf` package's.
"""

from __future__ import annotations

import functools
import math
import mmap
import struct
from dataclasses import dataclass
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
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")


def is_gguf(path: Path) -> bool:
    """True when `path` is a file that starts with the GGUF magic (the name is not consulted)."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_gguf(path: Path) -> GGUFFile:
    """A GGUFFile. A Checkpoint opens its file once for the config, weights and tokenizer; this
    keeps it for the next Checkpoint of the same file too (a benchmark loads its model once per
    row, and parsing 100k vocabulary strings takes seconds). A file changed on disk is read again."""
    stat = path.stat()
    return _open_cached(path.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_cached(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


# GGML tensor types: id -> (name, weights per block, bytes per block).
_GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2),
    39: ("MXFP4", 32, 17),  # an e8m0 scale, then 16 bytes of e2m1 pairs (gpt-oss's experts)
}  # fmt: skip
# GGUF metadata value types: id -> struct format of a scalar (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # logical: rows (output features) first
    type_id: int
    offset: int  # in the file

    @property
    def type_name(self) -> str:
        return _GGML_TYPES[self.type_id][0] if self.type_id in _GGML_TYPES else f"type {self.type_id}"

    @property
    def nbytes(self) -> int:
        _, per_block, block_bytes = _GGML_TYPES[self.type_id]
        return math.prod(self.shape) // per_block * block_bytes


class _Header:
    """GGUF's key/value metadata and tensor table, parsed with struct from the mapped bytes.

    The `gguf` package's reader builds a numpy view per field element: ~5 s for a 49k-token
    vocabulary on a 2-core CPU, every start. Reading the same layout directly takes ~0.1 s."""

    def __init__(self, data: memoryview) -> None:
        self.data, self.pos = data, 4
        version = self._unpack("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (genfast reads 2 and 3)")
        n_tensors, n_kv = self._unpack("Q"), self._unpack("Q")
        self.metadata = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("Q") for _ in range(self._unpack("I"))]
            infos.append((name, tuple(reversed(dims)), self._unpack("I"), self._unpack("Q")))
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-self.pos // alignment) * alignment
        self.tensors = {name: _TensorInfo(name, shape, kind, start + offset) for name, shape, kind, offset in infos}

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def _string(self, errors: str = "strict") -> str:
        length = self._unpack("Q")
        self.pos += length
        if self.pos > len(self.data):
            raise ValueError("a string runs past the end of the file")
        return bytes(self.data[self.pos - length : self.pos]).decode("utf-8", errors)

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("I"), self._unpack("Q")
            if item == _STRING:
                return [self._string("replace") for _ in range(count)]
            if item == _ARRAY:
                return [self._value(self._unpack("I")) for _ in range(count)]
            fmt = "<" + _SCALARS[item]
            size = struct.calcsize(fmt) * count
            values = np.frombuffer(self.data, np.dtype(fmt), count, self.pos).tolist()
            self.pos += size
            return values
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._unpack(_SCALARS[kind])


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:  # the map keeps its own handle
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._map = np.frombuffer(self._mmap, dtype=np.uint8)
            header = _Header(memoryview(self._map))
        except (ValueError, OSError, IndexError, KeyError, struct.error, UnicodeDecodeError) as e:
            raise UserError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from e
        self.metadata: dict[str, Any] = header.metadata
        self._tensors = header.tensors
        for t in self._tensors.values():
            if t.type_id in _GGML_TYPES and t.offset + t.nbytes > len(self._map):
                raise UserError(f"{path} is not a readable GGUF file (truncated or corrupt?): tensor {t.name} "
                                "runs past the end of the file")  # fmt: skip

    @property
    def tensor_names(self) -> set[str]:
        return set(self._tensors)

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].type_name

    def _blocks(self, t: _TensorInfo) -> np.ndarray:
        """The tensor's bytes, one row (output feature) per row."""
        return self._map[t.offset : t.offset + t.nbytes].reshape(t.shape[0], -1)

    def _copy(self, t: _TensorInfo) -> np.ndarray:
        """`_blocks` as a writable copy, the map's pages it read released after (MADV_DONTNEED):
        the copy is what the model keeps, and the read-only map's pages would otherwise stay in
        the process's resident memory until the file is closed (6.8 GiB of gpt-oss-20b's GGUF)."""
        out = np.array(self._blocks(t))
        advice = getattr(mmap, "MADV_DONTNEED", None)  # Linux and most Unixes
        if advice is not None:
            start = t.offset - t.offset % mmap.PAGESIZE
            self._mmap.madvise(advice, start, t.offset + t.nbytes - start)
        return out

    def quantized(self, name: str) -> QuantizedWeight | None:
        """The tensor's own blocks as genfast codes when its type maps exactly onto a genfast grid
        (Q8_0 -> int8, Q4_0 / Q4_1 -> int4, 32 columns per group), else None. Stacked experts
        ([E, N, K]) keep their leading dimension."""
        t = self._tensors[name]
        kind = t.type_name
        if kind not in _BLOCK_BYTES:
            return None
        rows, cols = math.prod(t.shape[:-1]), t.shape[-1]
        blocks = torch.from_numpy(self._copy(t).reshape(rows, cols // 32, _BLOCK_BYTES[kind]))
        scales = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]
        if kind == "Q8_0":  # d, 32 x int8: w = q * d
            codes = (blocks[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
            mins = (-128 * scales.float()).to(torch.float16)
            return _shaped(QuantizedWeight(codes.reshape(rows, cols), scales, mins, 8, 32, cols), t.shape)
        if kind == "Q4_0":  # d, 16 bytes: w = (q - 8) * d
            nibbles, mins = blocks[..., 2:], (-8 * scales.float()).to(torch.float16)
        else:  # Q4_1: d, m, 16 bytes: w = q * d + m
            nibbles, mins = blocks[..., 4:], blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
        # Byte j of a block holds element j (low nibble) and element j + 16 (high nibble).
        codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)
        return _shaped(QuantizedWeight(codes.reshape(rows, cols), scales, mins, 4, 32, cols), t.shape)

    def raw_blocks(self, name: str) -> torch.Tensor:
        """The tensor's blocks as stored, uint8 [*leading dims, bytes per row] (e.g. MXFP4 codes
        kept as they are), a copy."""
        t = self._tensors[name]
        return torch.from_numpy(self._copy(t)).reshape(*t.shape[:-1], -1)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor in its logical shape (rows = output features), as float32."""
        t = self._tensors[name]
        kind = t.type_name
        if kind not in SUPPORTED_TYPES:
            raise UserError(
                f"{self.path}: tensor {name} is stored as {kind}; genfast reads {', '.join(SUPPORTED_TYPES)}"
            )
        if kind in _BLOCK_BYTES:  # unpacked and scaled by torch, all blocks at once
            qw = self.quantized(name)
            assert qw is not None
            return qw.dequantize(torch.float32).reshape(t.shape)
        raw = self._copy(t)  # writable: the map is read-only
        if kind in ("F32", "F16", "BF16"):
            dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]
            return torch.from_numpy(raw).view(dtype).reshape(t.shape).float()
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize  # the K-quants' arithmetic, from llama.cpp's own package

        return torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType[kind]), np.float32).reshape(t.shape))


def _shaped(qw: QuantizedWeight, shape: tuple[int, ...]) -> QuantizedWeight:
    """A QuantizedWeight read as rows, given the tensor's leading dimensions back (experts)."""
    if len(shape) == 2:
        return qw
    lead = shape[:-1]
    return QuantizedWeight(
        qw.codes.reshape(*lead, -1), qw.scales.reshape(*lead, -1), qw.mins.reshape(*lead, -1),
        qw.bits, qw.group_size, qw.in_features,
    )  # fmt: skip
