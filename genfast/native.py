"""Building genfast's native CPU kernels on first use with the local C++ compiler.

Each kernel is one C++ source next to the Python code that uses it. torch.utils.cpp_extension
compiles it into GENFAST_KERNEL_DIR (default GENFAST_HOME/kernels), once per source, flags and
torch version; the library registers its ops with torch.library, so torch.compile calls them
without a graph break. A kernel is skipped, and its caller takes its pure-PyTorch path, when the
CPU lacks the instructions, when no compiler works, or when `GENFAST_NATIVE_KERNELS=0`.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def kernel_dir() -> Path:
    from genfast.hub import genfast_home

    return Path(os.environ.get("GENFAST_KERNEL_DIR") or genfast_home() / "kernels")


@cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def build(name: str, source: Path, cflags: Sequence[str], required_cpu_flags: Sequence[str],
          what: str) -> str | None:
    """Compile and load `source` (once per process); None when its ops are ready, else why not.

    `what` names the kernel in the one line printed while building and in warnings.
    """
    return _build(name, source, tuple(cflags), tuple(required_cpu_flags), what)


@cache
def _build(name: str, source: Path, cflags: tuple[str, ...], required: tuple[str, ...], what: str) -> str | None:
    if os.environ.get("GENFAST_NATIVE_KERNELS", "1") == "0":
        return "disabled by GENFAST_NATIVE_KERNELS=0"
    missing = [flag for flag in required if flag not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    from torch.utils import cpp_extension

    try:
        code = source.read_bytes()
    except OSError as exc:  # an install that did not ship the source
        log.warning("genfast: native %s unavailable (%s); using the PyTorch path", what, exc)
        return f"its source is missing: {exc}"
    digest = hashlib.sha256(code + torch.__version__.encode() + " ".join(cflags).encode())
    full_name = f"genfast_{name}_{digest.hexdigest()[:12]}"
    build_dir = kernel_dir() / full_name
    build_dir.mkdir(parents=True, exist_ok=True)
    # One process builds, the others wait and load its library: tensor-parallel ranks start
    # together and would otherwise both compile into one directory.
    with open(kernel_dir() / f"{full_name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (build_dir / f"{full_name}.so").exists():
            print(f"genfast: building the native {what} into {build_dir} (once; ~10-60 s)", file=sys.stderr,
                  flush=True)
        try:
            cpp_extension.load(name=full_name, sources=[str(source)], extra_cflags=list(cflags),
                               extra_ldflags=["-fopenmp"], build_directory=str(build_dir),
                               is_python_module=False, verbose=False)
        except (OSError, RuntimeError) as exc:  # no compiler, no ninja, build error
            log.warning("genfast: native %s unavailable (%s); using the PyTorch path", what, exc)
            return f"build failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return None
