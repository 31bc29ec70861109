"""Every native CPU kernel, found from its folder: each folder of genfast/kernels/ with an `ops.py`
declares its `KERNEL` there (and, by importing it, defines its ops' schemas)."""

from __future__ import annotations

import importlib
import os

from genfast.kernels.native import SOURCE_DIR, Kernel


def _find() -> tuple[Kernel, ...]:
    found = []
    for folder in sorted(SOURCE_DIR.iterdir()):
        if (folder / "ops.py").is_file():
            kernel = importlib.import_module(f"{__package__}.{folder.name}.ops").KERNEL
            if kernel.name != folder.name:
                raise RuntimeError(f"{folder / 'ops.py'} declares kernel {kernel.name!r}; name it after its folder")
            found.append(kernel)
    return tuple(sorted(found, key=lambda k: k.rank))


KERNELS = _find()


def by_name(name: str) -> Kernel:
    return next(k for k in KERNELS if k.name == name)


def build_all(kernels: tuple[Kernel, ...] = KERNELS) -> dict[str, str | None]:
    """Build (first use) and load the chosen variant of each kernel side by side, one compiler per
    kernel on its own core; kernel name -> `unavailable_reason()`. Most of a build is its compiler
    parsing PyTorch's headers on one core, so builds side by side finish sooner than in a row."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, min(len(kernels), os.cpu_count() or 1))) as pool:
        return dict(zip((k.name for k in kernels), pool.map(Kernel.unavailable_reason, kernels), strict=True))
