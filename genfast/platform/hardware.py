"""The hardware layer every workload uses: which device, which dtype `auto` means there, what the
CPU's instruction set is (and which native-kernel variants it allows), synchronize and peak memory.

ISA levels form a tree (`ISA_TREE`): `none`, portable PyTorch code only, at the root; on x86
`avx2` (AVX2 + FMA + F16C), then `avx512` (AVX-512 F/BW/VL; a kernel variant may need more, such
as VNNI or BF16), then `amx` (AMX's tiles; a variant also names AMX-INT8 or AMX-BF16); on ARM
`neon` (Advanced SIMD), then `sve`. A level's code may run wherever the CPU has the flags of the
level and of every level below it, down to the root (`isa_path`).
`GENFAST_ISA` caps the level, so an AVX-512 machine can run and test the AVX2 and portable paths;
it never raises the level above what the CPU has. A capped level also stands for a CPU without VNNI
or native bf16 (the Zen 3 profile), and `torch_isa_env` gives the variables that cap PyTorch's own
kernels the same way, for a new process that should behave as such a CPU throughout.
"""

from __future__ import annotations

import hashlib
import os
import platform
import resource
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from genfast.errors import UserError


@dataclass(frozen=True)
class IsaLevel:
    """One level of the ISA tree: what it adds over the level below it."""

    name: str
    below: str | None  # the next lower level on the way to the portable root; None at the root
    cpu_flags: tuple[str, ...]  # the CPU flags it adds (as /proc/cpuinfo names them)
    cflags: tuple[str, ...]  # the compiler flags that let code use those instructions


# -mavx512dq without a CPU-flag test: every CPU with AVX-512 BW and VL also has DQ.
ISA_TREE = {
    level.name: level
    for level in (
        IsaLevel("amx", "avx512", ("amx_tile",), ("-mamx-tile",)),
        IsaLevel(
            "avx512",
            "avx2",
            ("avx512f", "avx512bw", "avx512vl"),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
        ),
        IsaLevel("avx2", "none", ("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c")),
        # AArch64: Advanced SIMD is part of the base instruction set, so it needs no compiler flag.
        IsaLevel("sve", "neon", ("sve",), ("-march=armv8-a+sve",)),
        IsaLevel("neon", "none", ("asimd",), ()),
        IsaLevel("none", None, (), ()),
    )
}
ISA_LEVELS = tuple(ISA_TREE)  # each branch best first, the portable root last
ISA_ENV = "GENFAST_ISA"
# Variables that cap PyTorch's own CPU code (ATen's kernels and inductor's generated code, oneDNN,
# MKL) to a level. Each is read once, at import or first use, so they only act on a new process.
TORCH_ISA_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# ---- CPU -------------------------------------------------------------------------------------------


def _cpuinfo_field(*names: str) -> str | None:
    """The value of the first /proc/cpuinfo line that starts with one of `names`; None where there
    is no such line or no /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(names):
            return line.split(":", 1)[1].strip()
    return None


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 'flags', ARM 'Features'); empty elsewhere."""
    return frozenset((_cpuinfo_field("flags", "Features") or "").split())


@cache
def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (GenuineIntel, AuthenticAMD, ...); "" elsewhere."""
    return _cpuinfo_field("vendor_id") or ""


def cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def isa_path(level: str) -> tuple[str, ...]:
    """`level` and the levels below it, down to the portable root: the code a CPU of `level` runs."""
    path = [level]
    while (below := ISA_TREE[path[-1]].below) is not None:
        path.append(below)
    return tuple(path)


def lower_levels(level: str) -> tuple[str, ...]:
    """The levels below `level`, best first: those a CPU of `level` can also test (GENFAST_ISA)."""
    return isa_path(level)[1:]


def level_cpu_flags(level: str) -> tuple[str, ...]:
    """The CPU flags code of `level` needs: its own and those of every level below it."""
    return tuple(flag for name in reversed(isa_path(level)) for flag in ISA_TREE[name].cpu_flags)


def level_cflags(level: str) -> tuple[str, ...]:
    """The compiler flags for code of `level`: its own and those of every level below it."""
    return tuple(flag for name in reversed(isa_path(level)) for flag in ISA_TREE[name].cflags)


def detected_isa() -> str:
    """The best ISA level this CPU supports: the deepest one whose flags, and those of the levels
    below it, it has."""
    flags = cpu_flags()
    supported = [level for level in ISA_LEVELS if all(f in flags for f in level_cpu_flags(level))]
    return max(supported, key=lambda level: len(isa_path(level)))


def isa_override() -> str | None:
    """GENFAST_ISA's level, or None when unset; an unknown value is a user error."""
    value = os.environ.get(ISA_ENV, "").strip().lower()
    if not value:
        return None
    if value not in ISA_TREE:
        raise UserError(f"{ISA_ENV}={value!r} is not an ISA level; use one of {', '.join(ISA_LEVELS)}")
    return value


def isa() -> str:
    """The ISA level genfast uses: the detected one, capped by GENFAST_ISA to the best level on
    both of their paths to the root (a cap above the detected level leaves it as it is; one on
    another branch, an ARM level on x86, leaves the root)."""
    detected, cap = detected_isa(), isa_override()
    if cap is None:
        return detected
    allowed = isa_path(cap)
    return next(level for level in isa_path(detected) if level in allowed)


def isa_allows(level: str) -> bool:
    """Whether code written for `level` may run under the active ISA level."""
    return level in isa_path(isa())


# Feature flags that decide which instructions compiled CPU code may use (x86 and ARM names).
CODE_FLAG_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "bmi", "asimd", "sve", "fp", "neon")


def code_target() -> str:
    """A name for what compiled CPU code depends on: the CPU's instruction-set flags and the caps
    on PyTorch's own ISA. Inductor's cache keys include neither, so a cache shared between two
    kinds of CPU (a home directory on a network file system) or used under a cap loads code built
    for the other: seen here, a compiled linear built for AVX-512 gave wrong results under
    ATEN_CPU_CAPABILITY=avx2, and the reverse crashed. genfast keeps one cache per target. The
    vendor is part of it: with the same flags, genfast's graphs differ where `fast_bf16_products`
    does."""
    flags = sorted(f for f in cpu_flags() if f.startswith(CODE_FLAG_PREFIXES))
    variables = sorted({var for caps in TORCH_ISA_ENV.values() for var in caps})
    values = [os.environ.get(var, "") for var in variables]
    digest = hashlib.sha256(" ".join(flags + ["|", cpu_vendor(), "|"] + values).encode()).hexdigest()[:10]
    return f"{detected_isa()}-{digest}"


def torch_isa_env(level: str) -> dict[str, str]:
    """The environment for a process that runs as a CPU of `level` would: GENFAST_ISA for genfast's
    kernels plus the caps on PyTorch's own (`scripts/with_isa.sh` runs a command so)."""
    if level not in ISA_TREE:
        raise UserError(f"{level!r} is not an ISA level; use one of {', '.join(ISA_LEVELS)}")
    return {ISA_ENV: level, **TORCH_ISA_ENV.get(level, {})}


def has_vnni() -> bool:
    """Whether int8 dot products sum u8 x s8 pairs in int32 (AVX512-VNNI, AVX-VNNI, AMX) rather than
    in saturating int16 (AVX2's vpmaddubsw). Under a GENFAST_ISA cap there is none: a capped level
    stands for the CPUs of that level without it, as the caps of `torch_isa_env` make oneDNN."""
    if isa_override() is not None and not isa_allows("avx512"):
        return False
    return any(f in cpu_flags() for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


def has_native_bf16() -> bool:
    """Whether the CPU computes bf16 dot products natively (AVX512-BF16 or AMX-BF16) under the
    active ISA level. Without it, bf16 matmuls are converted to fp32 and run several times slower
    than fp32 itself."""
    flags = cpu_flags()
    return isa_allows("avx512") and ("avx512_bf16" in flags or "amx_bf16" in flags)


@torch.compiler.assume_constant_result  # read while tracing a model's forward: a constant there
def has_amx_bf16() -> bool:
    """Whether PyTorch's own bf16 products (oneDNN's matmuls and convolutions, SDPA's flash kernel)
    run on AMX tiles here: AMX-BF16 under the active ISA level. genfast's own kernels reach the
    tiles only in their AMX variants (the attention kernel's, the int8 linear's); their AVX-512
    code issues vdpbf16ps (`fast_bf16_dot_products`)."""
    return isa_allows("avx512") and "amx_bf16" in cpu_flags()


@torch.compiler.assume_constant_result  # read while tracing a model's forward: a constant there
def fast_bf16_dot_products() -> bool:
    """Whether AVX512-BF16's dot product (vdpbf16ps), which genfast's own kernels issue, does more
    multiply-adds a cycle than fp32 FMAs here: on AMD (Zen 4: twice as many). Intel's cores issue
    it at a quarter of the fp32 FMA's rate, half the multiply-adds a cycle, with AMX or without
    (the tiles are a unit of their own, which oneDNN's code and genfast's AMX variants reach:
    `has_amx_bf16`; docs/notes.md). Cooper Lake, never measured, is taken to be alike."""
    return has_native_bf16() and cpu_vendor() == "AuthenticAMD"


@torch.compiler.assume_constant_result  # read while tracing a model's forward: a constant there
def fast_bf16_products() -> bool:
    """Whether PyTorch's compute-bound bf16 products (oneDNN's) run faster than the same products
    in fp32 here: on AMX-BF16's tiles, or on AVX512-BF16 where its dot products are fast
    (`fast_bf16_dot_products`: AMD). Elsewhere (Intel Xeons with AVX512-BF16 whose hypervisor
    hides AMX) bf16 tensors still halve the bytes moved, so they stay worth keeping; their
    products are faster in fp32, or in int8 (VNNI's rate is above fp32's on both)."""
    return has_amx_bf16() or fast_bf16_dot_products()


# ---- device and dtype ------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    """'auto' is CUDA when torch sees a GPU, else the CPU; anything else must be cpu or cuda[:N].
    cuda:N also becomes the current CUDA device."""
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
    if device.type == "cuda" and device.index is not None:
        gpus = torch.cuda.device_count()
        if device.index >= gpus:
            raise UserError(f"--device {name}: torch sees {gpus} CUDA GPU(s), cuda:0 to cuda:{gpus - 1}")
        # Triton launches a kernel on the current device, whatever device its tensors are on.
        torch.cuda.set_device(device)
    return device


def auto_dtype(device: torch.device) -> torch.dtype:
    """What `--dtype auto` means on `device`: bf16 on CUDA and on CPUs with native bf16 dot
    products (there compiled bf16 decode reads half the bytes and is fastest), fp32 on other CPUs,
    where bf16 arithmetic is emulated."""
    if device.type == "cuda" or has_native_bf16():
        return torch.bfloat16
    return torch.float32


def dtype_name(name: str) -> str:
    """A --dtype value's canonical name: auto, float32, bfloat16 or float16 (aliases such as bf16
    accepted); an unknown one is a user error."""
    if name == "auto":
        return name
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16 (CUDA only)")
    return str(DTYPES[name]).removeprefix("torch.")


def resolve_dtype(name: str, device: torch.device, auto: torch.dtype | None = None) -> torch.dtype:
    """A --dtype value: 'auto' (`auto`, default auto_dtype(device)) or a name in DTYPES; fp16 on
    CPU is refused."""
    if name == "auto":
        return auto or auto_dtype(device)
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; use auto, float32, bfloat16 or float16 (CUDA only)")
    dtype = DTYPES[name]
    if dtype == torch.float16 and device.type == "cpu":
        raise UserError("float16 is slow and poorly supported on CPU; use float32 or bfloat16")
    return dtype


# ---- timing and memory -----------------------------------------------------------------------------


def low_precision_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The dtype of a recipe's "bf16" step (SAM, diffusion) for a --dtype `name`; None leaves the
    step out, so the recipe computes in fp32 throughout. 'auto' leaves it out where bf16 is
    emulated (auto_dtype is fp32 there); float16 is for CUDA only."""
    if name == "auto":
        return None if auto_dtype(device) == torch.float32 else torch.bfloat16
    dtype = resolve_dtype(name, device)
    return None if dtype == torch.float32 else dtype


def low_precision_note(device: torch.device) -> str:
    """Why a recipe's bf16 step is left out, for a table row or a message."""
    why = "this CPU has no native bf16 arithmetic" if device.type == "cpu" and not has_native_bf16() else "--dtype"
    return f"{why}; the later steps compute in fp32 (--dtype bfloat16 runs them in bf16)"


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued so far on the device's current stream (a no-op on the CPU, whose
    ops finish when they return). On CUDA with an event rather than a device synchronization: an
    explicit wait, which CUDA's sync-debug mode (the tests' check for hidden host syncs) does not
    count."""
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            done = torch.cuda.Event()
            done.record()
            done.synchronize()


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device` without a blocking copy (on CUDA: pinned, then copied in stream
    order); small per-call inputs such as token ids and positions."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class HostCopy:
    """A device tensor's values on the host once `values()` is called, copied in stream order
    (pinned memory and an event): reading them waits only for the work queued up to the copy,
    not for anything queued after it, so the device stays busy meanwhile."""

    def __init__(self, tensor: Tensor) -> None:
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._ready: torch.cuda.Event | None = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = tensor, None

    def values(self) -> list:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


def peak_memory_bytes(device: torch.device | str) -> int:
    """CUDA: peak allocated by torch; CPU: the process's peak resident set size."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


def describe_isa() -> str:
    """One line for bench headers and stats: the active ISA level and the flags that matter."""
    notable = [f for f in ("avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8") if f in cpu_flags()]
    text = isa()
    if notable and isa_allows("avx512"):
        text += " (" + ", ".join(notable) + ")"
    if isa_override() is not None:
        text += f" [{ISA_ENV}={isa_override()}; detected {detected_isa()}]"
    return text


def available_memory_bytes(device: torch.device) -> int | None:
    """Free memory on `device`: the GPU's free bytes, or the CPU's MemAvailable (Linux); None
    where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
