"""genfast's native CPU kernels: one declaration per kernel, a variant per ISA, chosen at run time.

Every C++ source lives in this folder, with the headers its variants share. A `Kernel` lists its
variants best first; each variant names its ISA level (genfast.platform.hardware.ISA_LEVELS), the CPU flags
it needs and the compiler flags that match them. `Kernel.choose()` takes the first variant the CPU
and GENFAST_ISA allow; `Kernel.unavailable_reason()` (or `available()`) compiles it on first use
with the local C++ compiler (torch.utils.cpp_extension, into GENFAST_KERNEL_DIR, default
GENFAST_HOME/kernels, once per source, headers, flags and torch version) and loads it; the library
registers its ops with torch.library, so torch.compile calls them without a graph break. All
variants of a kernel register the same ops with the same semantics, so one process loads one.
Where no variant fits, the compiler fails or `GENFAST_NATIVE_KERNELS=0` (all of them; `-NAME,...`:
those named, e.g. `-decode_attention` to compare a step with and without it), the caller takes its
pure-PyTorch path (the portable fallback), and the reason says why.

CUDA's kernels are Triton's (`qlinear_triton.py`, imported only where a GPU uses it): they compile
on first use through Triton and need nothing from this registry.

Adding a variant (e.g. ARM NEON): write `<name>_<isa>.cpp` next to the others, add the ISA level to
genfast.platform.hardware.ISA_LEVELS with its CPU flags, and list the variant in its Kernel below.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from genfast.platform import hardware

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
DISABLE_ENV = "GENFAST_NATIVE_KERNELS"

# -fopenmp: at::parallel_for is OpenMP pragmas in headers; without the flag it runs on one thread.
_AVX512 = ("-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c")
_AVX2 = ("-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c")


@dataclass(frozen=True)
class Variant:
    isa: str  # a level of genfast.platform.hardware.ISA_LEVELS
    source: str  # file name in this folder
    cpu_flags: tuple[str, ...]  # what the CPU must have (as /proc/cpuinfo names it)
    cflags: tuple[str, ...]  # the matching compiler flags

    @property
    def path(self) -> Path:
        return SOURCE_DIR / self.source


@dataclass(frozen=True)
class Kernel:
    name: str
    what: str  # a few words for messages, e.g. "int8/int4 linear kernel"
    variants: tuple[Variant, ...]  # best first

    def choose(self) -> tuple[Variant | None, str]:
        """The variant this machine runs and why (or None and why none)."""
        setting = os.environ.get(DISABLE_ENV, "1")
        if setting == "0" or f"-{self.name}" in setting.split(","):
            return None, f"disabled by {DISABLE_ENV}={setting}"
        passed_over = []
        for variant in self.variants:
            missing = [flag for flag in variant.cpu_flags if flag not in hardware.cpu_flags()]
            if missing:
                passed_over.append(f"{variant.isa}: this CPU lacks {', '.join(missing)}")
            elif not hardware.isa_allows(variant.isa):
                passed_over.append(f"{variant.isa}: not allowed by {hardware.ISA_ENV}={hardware.isa_override()}")
            else:
                return variant, "best variant for this CPU" + (f" ({'; '.join(passed_over)})" if passed_over else "")
        return None, "; ".join(passed_over) or "no variant for this CPU"

    def unavailable_reason(self) -> str | None:
        """None when the chosen variant is built and its ops are loaded, else why not."""
        variant, why = self.choose()
        if variant is None:
            return why
        if self.name in _LOADED:  # one variant per process (its ops are registered once), also where
            return None  # the choice would differ now (a test pretending another CPU)
        return _build(self.name, variant, self.what)

    def available(self) -> bool:
        return self.unavailable_reason() is None

    def loaded(self) -> bool:
        """Whether this process has loaded the kernel's ops (never builds anything)."""
        return self.name in _LOADED

    def loaded_isa(self) -> str | None:
        """The ISA level of the variant in use, or None when the PyTorch path runs."""
        return _LOADED[self.name] if self.available() else None


QLINEAR = Kernel(
    "qlinear",
    "int8/int4 linear kernel",
    (
        Variant(
            "avx512",
            "qlinear_avx512.cpp",
            ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c"),
            _AVX512 + ("-mavx512vnni",),
        ),
        Variant("avx2", "qlinear_avx2.cpp", ("avx2", "fma", "f16c"), _AVX2),
    ),
)
LINEAR_FEW_ROWS = Kernel(
    "linear_few_rows",
    "few-row bf16 linear kernel",
    (
        Variant(
            "avx512", "linear_few_rows_avx512.cpp", ("avx512f", "avx512bw", "avx512_bf16"), _AVX512 + ("-mavx512bf16",)
        ),
        Variant("avx2", "linear_few_rows_avx2.cpp", ("avx2", "fma", "f16c"), _AVX2),
    ),
)
# AVX2 only: it serves fp32 compute over bf16-stored weights, which `--dtype auto` picks where the
# CPU has no native bf16; an AVX-512 CPU without BF16 (Skylake-X to Ice Lake) runs this variant too.
LINEAR_WIDENING_GEMM = Kernel(
    "linear_widening_gemm",
    "bf16-weight GEMM kernel",
    (Variant("avx2", "linear_widening_gemm_avx2.cpp", ("avx2", "fma", "f16c"), _AVX2),),
)
REL_POS_ATTENTION = Kernel(
    "rel_pos_attention",
    "fused SAM attention kernel",
    (
        Variant(
            "avx512",
            "rel_pos_attention_avx512.cpp",
            ("avx512f", "avx512bw", "avx512_bf16"),
            _AVX512 + ("-mavx512bf16",),
        ),
        Variant("avx2", "rel_pos_attention_avx2.cpp", ("avx2", "fma", "f16c"), _AVX2),
    ),
)
GROUP_NORM = Kernel(
    "group_norm",
    "GroupNorm CPU kernel",
    (
        Variant("avx512", "group_norm_avx512.cpp", ("avx512f", "avx512bw"), _AVX512),
        Variant("avx2", "group_norm_avx2.cpp", ("avx2", "fma", "f16c"), _AVX2),
    ),
)
DECODE_ATTENTION = Kernel(
    "decode_attention",
    "decode attention kernel",
    (
        Variant("avx512", "decode_attention_avx512.cpp", ("avx512f", "avx512bw"), _AVX512),
        Variant("avx2", "decode_attention_avx2.cpp", ("avx2", "fma", "f16c"), _AVX2),
    ),
)
KERNELS = (QLINEAR, LINEAR_FEW_ROWS, LINEAR_WIDENING_GEMM, REL_POS_ATTENTION, GROUP_NORM, DECODE_ATTENTION)
_LOADED: dict[str, str] = {}  # the kernels whose library this process has loaded: name -> its variant's ISA


def build_all(kernels: tuple[Kernel, ...] = KERNELS) -> dict[str, str | None]:
    """Build (first use) and load the chosen variant of each kernel side by side, one compiler per
    kernel on its own core; kernel name -> `unavailable_reason()`. One at a time, the five AVX2
    variants took 40-55 s on a 2-core Xeon, two thirds of it each compiler parsing PyTorch's
    headers; side by side 28 s (docs/performance.md, "Kernels built side by side")."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, min(len(kernels), os.cpu_count() or 1))) as pool:
        return dict(zip((k.name for k in kernels), pool.map(Kernel.unavailable_reason, kernels), strict=True))


def by_name(name: str) -> Kernel:
    return next(k for k in KERNELS if k.name == name)


def kernel_dir() -> Path:
    from genfast.storage.paths import kernels_dir

    return kernels_dir()


def build_name(name: str, variant: Variant) -> str:
    """The build's folder and library name: the kernel, its ISA and a digest of its sources, of
    torch's version and of the compiler flags, so that any change builds anew. Raises OSError
    where the sources are missing."""
    # The headers variants share (e.g. qlinear.h) are part of every build's identity.
    code = variant.path.read_bytes() + b"".join(h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h")))
    digest = hashlib.sha256(code + torch.__version__.encode() + " ".join(variant.cflags).encode())
    return f"genfast_{name}_{variant.isa}_{digest.hexdigest()[:12]}"


def chosen_build(kernel: Kernel) -> str | None:
    """The build name (build_name) of the variant `kernel` runs here, None where none is chosen or
    its source is missing."""
    variant, _ = kernel.choose()
    try:
        return build_name(kernel.name, variant) if variant else None
    except OSError:
        return None


@cache
def _build(name: str, variant: Variant, what: str) -> str | None:
    """Compile and load one variant (once per process); None when its ops are ready, else why not."""
    from torch.utils import cpp_extension

    try:
        full_name = build_name(name, variant)
    except OSError as exc:  # an install that did not ship the source
        log.warning("genfast: native %s unavailable (%s); using the PyTorch path", what, exc)
        return f"its source is missing: {exc}"
    build_dir = kernel_dir() / full_name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        # One process builds, the others wait and load its library: tensor-parallel ranks start
        # together and would otherwise both compile into one directory.
        lock = open(kernel_dir() / f"{full_name}.lock", "w")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:  # e.g. a read-only home
        why = f"cannot write {kernel_dir()} ({exc.strerror or exc}); GENFAST_KERNEL_DIR names another folder"
        log.warning("genfast: native %s unavailable: %s; using the PyTorch path", what, why)
        return why
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # cpp_extension marks a build in progress with a `lock` file in its folder and waits, with
        # no limit, while one exists. A build that was killed (Ctrl-C during the first use) leaves
        # it behind, and every later start would hang. Holding our lock, no other process builds
        # here, so one found now is such a leftover.
        stale = build_dir / "lock"
        if stale.exists():
            print(f"genfast: removing {stale}, left by an interrupted build", file=sys.stderr, flush=True)
            stale.unlink()
        if not (build_dir / f"{full_name}.so").exists():
            print(
                f"genfast: building the native {what} ({variant.isa}) into {build_dir} (once; ~10-60 s)",
                file=sys.stderr,
                flush=True,
            )
        try:
            cpp_extension.load(
                name=full_name,
                sources=[str(variant.path)],
                extra_cflags=list(variant.cflags),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
        except (OSError, RuntimeError) as exc:  # no compiler, no ninja, build error
            log.warning("genfast: native %s unavailable (%s); using the PyTorch path", what, exc)
            return f"build failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    _LOADED[name] = variant.isa
    return None
