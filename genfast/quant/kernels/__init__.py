"""Native kernels for quantized linears, built on first use with the local C++ compiler.

`qlinear_avx512.cpp` is a VNNI GEMM over 8/4-bit codes (see the file's header for the math and the
tile layout). It is compiled by torch.utils.cpp_extension into GENFAST_KERNEL_DIR (default
GENFAST_HOME/kernels), once per source and torch version, and registers `torch.ops.genfast.qlinear`,
an ordinary custom op that torch.compile calls without a graph break. Machines without
AVX512-VNNI, or without a working compiler, get `available() == False` and the callers use their
pure-PyTorch path; `GENFAST_NATIVE_KERNELS=0` forces that path.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qlinear_avx512.cpp")
TILE_ROWS = 16  # output rows per tile; padded with zero rows to a multiple of this
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c")
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c", "-mfma"]


def kernel_dir() -> Path:
    from genfast.hub import genfast_home

    return Path(os.environ.get("GENFAST_KERNEL_DIR") or genfast_home() / "kernels")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def unavailable_reason() -> str | None:
    """Why the native CPU kernel cannot be used here, or None when it is loaded and ready."""
    return _load()


@cache
def _load() -> str | None:
    if os.environ.get("GENFAST_NATIVE_KERNELS", "1") == "0":
        return "disabled by GENFAST_NATIVE_KERNELS=0"
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    from torch.utils import cpp_extension

    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(CFLAGS).encode())
    name = f"genfast_qlinear_{digest.hexdigest()[:12]}"
    build = kernel_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS,
                           build_directory=str(build), is_python_module=False, verbose=False)
    except (OSError, RuntimeError) as exc:  # no compiler, no ninja, build error
        log.warning("genfast: native int8/int4 CPU kernel unavailable (%s); using the PyTorch path", exc)
        return f"build failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return None


def available() -> bool:
    return _load() is None


# The schema lives here, not in C++, so the op (and its shape function for torch.compile) exists
# whether or not the native library could be built.
torch.library.define(
    "genfast::qlinear",
    "(Tensor x, Tensor packed, Tensor scales, Tensor mins, int bits, int group_size, int out_features) -> Tensor")


@torch.library.register_fake("genfast::qlinear")
def _qlinear_fake(x: Tensor, packed: Tensor, scales: Tensor, mins: Tensor, bits: int, group_size: int,
                  out_features: int) -> Tensor:
    return x.new_empty(x.shape[0], out_features)


def pack_tiles(codes: Tensor, bits: int) -> Tensor:
    """Codes [N_padded, K] (uint8, N_padded a multiple of 16, K of 8) -> the kernel's tile layout."""
    n, k = codes.shape
    if bits == 8:
        tiles = codes.reshape(n // TILE_ROWS, TILE_ROWS, k // 4, 4).transpose(1, 2)
    else:
        chunks = codes.reshape(n // TILE_ROWS, TILE_ROWS, k // 8, 2, 4)
        tiles = (chunks[:, :, :, 0] | (chunks[:, :, :, 1] << 4)).transpose(1, 2)
    return tiles.contiguous().reshape(-1)


def unpack_tiles(packed: Tensor, bits: int, n: int, k: int) -> Tensor:
    """Inverse of pack_tiles: [N_padded, K] codes."""
    if bits == 8:
        return packed.reshape(n // TILE_ROWS, k // 4, TILE_ROWS, 4).transpose(1, 2).reshape(n, k)
    tiles = packed.reshape(n // TILE_ROWS, k // 8, TILE_ROWS, 4).transpose(1, 2)
    return torch.stack([tiles & 0x0F, tiles >> 4], dim=3).reshape(n, k)
