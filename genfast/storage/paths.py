"""Where genfast keeps what it makes and downloads, under GENFAST_HOME (default ~/.cache/genfast):

    models/<alias or org--name>/   a Hugging Face directory or a single .gguf file
    models/sam-vit-b/              an official SAM checkpoint (also -l, -h)
    compiled/                      steps compiled ahead of time (genfast.compilation.artifacts)
    inductor/<cpu kind>/           torch.compile's own cache, one folder per kind of CPU
    kernels/                       the native CPU kernels, built once per variant and torch version
    machine.json                   the measured memory bandwidth of this machine

Only paths: nothing here reads, writes or downloads.
"""

from __future__ import annotations

import os
from pathlib import Path


def genfast_home() -> Path:
    return Path(os.environ.get("GENFAST_HOME") or Path.home() / ".cache" / "genfast")


def models_dir() -> Path:
    return genfast_home() / "models"


def model_cache_dir(name: str) -> Path:
    """The cache directory of an alias or a hub id ('org/name' -> 'org--name')."""
    return models_dir() / name.replace("/", "--")


def model_label(model: str) -> str:
    """How a model is named in reports: a cached model by its cache name, anything else as given."""
    try:
        return Path(model).resolve().relative_to(models_dir().resolve()).as_posix()
    except ValueError:
        return model


def kernels_dir() -> Path:
    """Where the native kernels are built (GENFAST_KERNEL_DIR moves them)."""
    return Path(os.environ.get("GENFAST_KERNEL_DIR") or genfast_home() / "kernels")


def compiled_dir() -> Path:
    return genfast_home() / "compiled"


def inductor_dir() -> Path:
    return genfast_home() / "inductor"


def machine_file() -> Path:
    return genfast_home() / "machine.json"
