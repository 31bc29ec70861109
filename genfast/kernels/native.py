"""A native CPU kernel and its variants: which one this CPU runs, and its build and load.

A `Kernel` is one folder of genfast/kernels/ (its name): a C++ source per variant, named after the
variant's ISA level (`avx2.cpp`, `avx512.cpp`, ...), the headers the variants share, and `ops.py`
with the op's schema. A `Variant` names its level of genfast.platform.hardware.ISA_TREE and what
it needs beyond that level (e.g. AVX512-VNNI). `Kernel.choose()` takes the first variant the CPU
and GENFAST_ISA allow; `Kernel.unavailable_reason()` (or `available()`) compiles it on first use
with the local C++ compiler (torch.utils.cpp_extension, into GENFAST_KERNEL_DIR, default
GENFAST_HOME/kernels, once per source, headers, flags and torch version) and loads it. All variants
of a kernel implement the same ops with the same semantics, so one process loads one. Where no
variant fits, the compiler fails or `GENFAST_NATIVE_KERNELS=0` (all of them; `-NAME,...`: those
named, e.g. `-decode_attention` to compare a step with and without it), the caller takes the
portable PyTorch path, and the reason says why.
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
from genfast.storage.paths import kernels_dir

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent  # a folder per kernel, and common/ with the headers all share
COMMON = "common"
DISABLE_ENV = "GENFAST_NATIVE_KERNELS"

# -fopenmp: at::parallel_for is OpenMP pragmas in headers; without the flag it runs on one thread.
BASE_CFLAGS = ("-O3", "-fopenmp")


@dataclass(frozen=True)
class Variant:
    isa: str  # a level of genfast.platform.hardware.ISA_TREE; its source is `<isa>.cpp`
    extra_cpu_flags: tuple[str, ...] = ()  # what the CPU must have beyond the level's flags
    extra_cflags: tuple[str, ...] = ()  # the compiler flags matching those

    @property
    def source(self) -> str:
        return f"{self.isa}.cpp"

    @property
    def cpu_flags(self) -> tuple[str, ...]:
        """Every CPU flag the variant needs (as /proc/cpuinfo names them)."""
        return hardware.level_cpu_flags(self.isa) + self.extra_cpu_flags

    @property
    def cflags(self) -> tuple[str, ...]:
        return BASE_CFLAGS + hardware.level_cflags(self.isa) + self.extra_cflags


@dataclass(frozen=True)
class Kernel:
    name: str  # its folder in genfast/kernels/
    what: str  # a few words for messages, e.g. "int8/int4 linear kernel"
    variants: tuple[Variant, ...]  # best first
    rank: int  # its place in listings (`genfast info`), which the folders' names do not give

    @property
    def folder(self) -> Path:
        return SOURCE_DIR / self.name

    def source(self, variant: Variant) -> Path:
        return self.folder / variant.source

    def headers(self) -> list[Path]:
        """The headers a variant's build reads: the kernel's own and the shared ones."""
        return sorted(self.folder.glob("*.h")) + sorted((SOURCE_DIR / COMMON).glob("*.h"))

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
        return _build(self, variant)

    def available(self) -> bool:
        return self.unavailable_reason() is None

    def loaded(self) -> bool:
        """Whether this process has loaded the kernel's ops (never builds anything)."""
        return self.name in _LOADED

    def loaded_isa(self) -> str | None:
        """The ISA level of the variant in use, or None when the PyTorch path runs."""
        return _LOADED[self.name] if self.available() else None


_LOADED: dict[str, str] = {}  # the kernels whose library this process has loaded: name -> its variant's ISA


def build_name(kernel: Kernel, variant: Variant) -> str:
    """The build's folder and library name: the kernel, its ISA and a digest of its source and
    headers, of torch's version and of the compiler flags, so that any change builds anew. Raises
    OSError where the source is missing."""
    code = kernel.source(variant).read_bytes() + b"".join(h.read_bytes() for h in kernel.headers())
    digest = hashlib.sha256(code + torch.__version__.encode() + " ".join(variant.cflags).encode())
    return f"genfast_{kernel.name}_{variant.isa}_{digest.hexdigest()[:12]}"


def chosen_build(kernel: Kernel) -> str | None:
    """The build name (build_name) of the variant `kernel` runs here, None where none is chosen or
    its source is missing."""
    variant, _ = kernel.choose()
    try:
        return build_name(kernel, variant) if variant else None
    except OSError:
        return None


@cache
def _build(kernel: Kernel, variant: Variant) -> str | None:
    """Compile and load one variant (once per process); None when its ops are ready, else why not."""
    from torch.utils import cpp_extension

    what = kernel.what
    try:
        full_name = build_name(kernel, variant)
    except OSError as exc:  # an install that did not ship the source
        log.warning("genfast: native %s unavailable (%s); using the PyTorch path", what, exc)
        return f"its source is missing: {exc}"
    build_dir = kernels_dir() / full_name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        # One process builds, the others wait and load its library: tensor-parallel ranks start
        # together and would otherwise both compile into one directory.
        lock = open(kernels_dir() / f"{full_name}.lock", "w")  # noqa: SIM115 (closed by the with below)
    except OSError as exc:  # e.g. a read-only home
        why = f"cannot write {kernels_dir()} ({exc.strerror or exc}); GENFAST_KERNEL_DIR names another folder"
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
                sources=[str(kernel.source(variant))],
                extra_cflags=list(variant.cflags),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
        except (OSError, RuntimeError) as exc:  # no compiler, no ninja, build error
            log.warning("genfast: native %s unavailable (%s); using the PyTorch path", what, exc)
            return f"build failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    _LOADED[kernel.name] = variant.isa
    return None
