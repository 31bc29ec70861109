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
import sys
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("qlinear_avx512.cpp")
TILE_ROWS = 16  # output rows per tile
ROW_GROUP = 64  # rows per unit of work (4 tiles); weights are padded with zero rows to a multiple
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c")
# -fopenmp: at::parallel_for is OpenMP pragmas in headers; without the flag it runs on one thread.
CFLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mf16c", "-mfma"]


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
    if not (build / f"{name}.so").exists():
        print(f"genfast: building the native int8/int4 CPU kernel into {build} (once; ~10-60 s)",
              file=sys.stderr, flush=True)
    try:
        cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                           build_directory=str(build), is_python_module=False, verbose=False)
    except (OSError, RuntimeError) as exc:  # no compiler, no ninja, build error
        log.warning("genfast: native int8/int4 CPU kernel unavailable (%s); using the PyTorch path", exc)
        return f"build failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return None


def available() -> bool:
    return _load() is None


# The schema lives here, not in C++, so the op (and its shape function for torch.compile) exists
# whether or not the native library could be built.
torch.library.define("genfast::qlinear", "(Tensor x, Tensor packed, int bits, int group_size, int out_features) -> Tensor")


@torch.library.register_fake("genfast::qlinear")
def _qlinear_fake(x: Tensor, packed: Tensor, bits: int, group_size: int, out_features: int) -> Tensor:
    return x.new_empty(x.shape[0], out_features)


# Codes [N, K] viewed as (row group s, tile t, row r, block b, chunk c, [nibble half h,] byte j);
# the kernel wants (s, b, t, c, r, j): see the layout notes in qlinear_avx512.cpp.
_TILES = ROW_GROUP // TILE_ROWS


def pack(codes: Tensor, scales: Tensor, mins: Tensor, bits: int) -> Tensor:
    """The kernel's single weight buffer: tiled codes, then scales^T and mins^T (fp16 bytes).
    codes [N_padded, K], scales and mins [N_padded, groups]."""
    parts = [pack_tiles(codes, bits)] + [t.t().contiguous().reshape(-1).view(torch.uint8) for t in (scales, mins)]
    return torch.cat(parts)


def unpack(packed: Tensor, bits: int, n: int, k: int, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of pack: codes [n, k], scales and mins [n, k // group_size]."""
    code_bytes, groups = n * k * bits // 8, k // group_size
    codes = unpack_tiles(packed[:code_bytes], bits, n, k)
    grids = packed[code_bytes:].view(torch.float16).reshape(2, groups, n)
    return codes, grids[0].t(), grids[1].t()


def pack_tiles(codes: Tensor, bits: int) -> Tensor:
    """Codes [N_padded, K] (uint8, N_padded a multiple of 64, K of 32) -> the kernel's layout."""
    n, k = codes.shape
    if bits == 8:
        view = codes.reshape(n // ROW_GROUP, _TILES, TILE_ROWS, k // 32, 8, 4)
    else:
        halves = codes.reshape(n // ROW_GROUP, _TILES, TILE_ROWS, k // 32, 4, 2, 4)
        view = halves[..., 0, :] | (halves[..., 1, :] << 4)
    return view.permute(0, 3, 1, 4, 2, 5).contiguous().reshape(-1)


def unpack_tiles(packed: Tensor, bits: int, n: int, k: int) -> Tensor:
    """Inverse of pack_tiles: [N_padded, K] codes."""
    chunks = 8 if bits == 8 else 4
    view = packed.reshape(n // ROW_GROUP, k // 32, _TILES, chunks, TILE_ROWS, 4).permute(0, 2, 4, 1, 3, 5)
    if bits == 4:
        view = torch.stack([view & 0x0F, view >> 4], dim=-2)
    return view.reshape(n, k)
