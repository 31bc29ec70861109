"""Compiled code kept on disk, so that a later run starts without compiling.

A step function compiled ahead of time (`torch.compile(...).aot_compile`, torch 2.13) is saved as
GENFAST_HOME/compiled/<key>/<name>.aot. The key is a hash of everything the compiled code depends
on: what the caller passes (architecture, dtypes, quantization, shapes, sampling) and the
environment (torch and genfast versions, a digest of genfast's Python sources, the CPU's ISA level
and which native-kernel variants it selects, the device type, inductor's global settings). The
digest is there because the compiled code is traced from genfast's modules: a checkout or install between two releases
changes them under one version number, and an artifact traced from the old code would otherwise
be loaded and run as if it were the new one. The thread count is not part of the key: the code
reads it at run time (inductor's `cpp.dynamic_threads`). An artifact that cannot be read or whose checks fail (a
corrupt file, one written by another torch) is removed and rebuilt, and the user is told.

Saves are atomic (a temporary file renamed into place), so a reader never sees half an artifact;
a lock file keeps two processes from compiling the same key at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch

from genfast import __version__
from genfast.interface.startup import start_ticks
from genfast.storage.files import write_json_atomic
from genfast.storage.paths import compiled_dir

# Bump when the layout of an artifact directory changes, or when steps saved before would now be
# compiled differently (2: artifact.json lists the kernels; 3: one-row bf16 linears take the kernel;
# 4: fp32 compute with bf16 weights keeps a bf16 KV cache; 5: CPU decode without size asserts).
FORMAT = 5


def root() -> Path:
    return compiled_dir()


def environment() -> dict[str, Any]:
    """What every compiled artifact depends on besides its own inputs."""
    from genfast.kernels import native, registry
    from genfast.platform import hardware

    return {
        "format": FORMAT,
        "torch": torch.__version__,
        "genfast": __version__,
        "genfast_sources": source_digest(),
        "python": list(sys.version_info[:2]),
        "isa": hardware.isa(),
        "code_target": hardware.code_target(),
        # The variant's build name: its ISA and a digest of its sources (a packed layout may change with them).
        "kernels": {k.name: native.chosen_build(k) for k in registry.KERNELS},
        "inductor_config": inductor_config_digest(),
    }


def inductor_config_digest() -> str:
    """A digest of inductor's global settings, the portable ones its own caches key on: a setting
    changed in the process (a kernel profiler turned on, a tuning flag) changes the code inductor
    generates beyond the options a caller passes, and an artifact compiled under it must not be
    loaded by a process without it."""
    import torch._inductor.config as inductor_config

    settings = inductor_config.save_config_portable()
    return hashlib.sha256(repr(sorted(settings.items())).encode()).hexdigest()[:16]


@cache
def source_digest() -> str:
    """A digest of the Python files of the installed genfast package (their paths and contents)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def saved_guards(entries: Any) -> list[bool]:
    """The guards a saved function keeps (`guard_filter_fn` of aot_compile): none on globals, none
    that cannot be serialized (among them identity checks, e.g. of the code objects diffusers'
    attention processors inspect: an address is not stable across runs, and the classes are in
    the key), and not dynamo's global-state guard, which pins the thread count and grad mode.
    Grad mode is left to the caller: every saved function runs with gradients off, and inference
    mode, which the tensors' own guards see, is in its key."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES

    def keep(g: Any) -> bool:
        unserializable = any(kind in unsupported for kind in (g.guard_type, *g.derived_guard_types))
        return not (g.is_global or unserializable or g.guard_type == "GLOBAL_STATE")

    return [keep(g) for g in entries]


def key(parts: Mapping[str, Any]) -> str:
    """A short stable hash of `parts` (JSON-able) and the environment."""
    text = json.dumps({"parts": parts, "environment": environment()}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


class Artifacts:
    """The compiled step functions stored under one key."""

    def __init__(self, key: str, description: Mapping[str, Any]) -> None:
        self.key = key
        self.dir = root() / key
        self.description = dict(description)

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.aot"

    def complete(self, names: list[str]) -> bool:
        return all(self.path(n).is_file() for n in names)

    def load(self, name: str, f_globals: dict[str, Any], log: Callable[[str], None]) -> Callable[..., Any] | None:
        """The saved function `name`, or None when there is none; an unreadable one is removed.
        The native kernels the compiling process had loaded are loaded first (the compiled code
        calls their ops), and inductor is told the vector ISA, which is part of the key, instead of
        compiling a probe program to find it (1 s of every load, measured)."""
        from genfast.kernels import registry

        path = self.path(name)
        if not path.is_file():
            return None
        for kernel in self.saved_description().get("kernels", []):
            registry.by_name(kernel).available()
        try:
            with open(path, "rb") as f, torch._inductor.config.patch({"cpp.vec_isa_ok": True}):
                return torch.compiler.load_compiled_function(f, f_globals=f_globals)
        except Exception as e:  # a damaged or foreign file can fail anywhere in unpickling
            self.discard(name, f"{path} could not be loaded ({type(e).__name__}: {str(e)[:200]})", log)
            return None

    def try_save(self, name: str, compiled: Any, log: Callable[[str], None]) -> None:
        """`save`, or say why not (a read-only GENFAST_HOME, a full disk): the compiled function
        still serves this run, and the next run compiles it again."""
        try:
            self.save(name, compiled)
        except OSError as exc:
            why = exc.strerror or exc
            log(f"genfast: cannot save the compiled {name} in {self.dir} ({why}): the next run compiles it again")

    def save(self, name: str, compiled: Any) -> None:
        """Write one aot-compiled function atomically, with a description of what it is for."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path(name).with_suffix(f".tmp{os.getpid()}")
        try:
            compiled.save_compiled_function(str(tmp))
            tmp.replace(self.path(name))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        from genfast.kernels import registry

        # What `load` must load first: every kernel any saved step may call. A later step can use
        # one the first did not (decode's attention kernel, not prefill's), so the list grows.
        recorded = self.saved_description().get("kernels")
        loaded = {k.name for k in registry.KERNELS if k.loaded()}
        if recorded is None or not loaded <= set(recorded):
            names = sorted(loaded | set(recorded or ()))
            document = {**self.description, "environment": environment(), "kernels": names}
            write_json_atomic(self.dir / "artifact.json", document, indent=1)

    def saved_description(self) -> dict[str, Any]:
        """The description saved with the artifacts ({} when there is none or it is unreadable)."""
        try:
            return json.loads((self.dir / "artifact.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def discard(self, name: str, why: str, log: Callable[[str], None]) -> None:
        """Remove the artifact `name` (stale or damaged) so that it is rebuilt."""
        log(f"genfast: {why}; discarding it: the compiled step is rebuilt")
        self.path(name).unlink(missing_ok=True)

    def try_lock(self) -> bool:
        """Take the right to compile this key (False: another live process holds it)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        lock = self.dir / "compiling.lock"
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _holder_alive(lock):
                return False
            lock.unlink(missing_ok=True)  # left by a process that died
            return self.try_lock()
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {start_ticks(os.getpid()) or ''}".strip())
        return True

    def unlock(self) -> None:
        (self.dir / "compiling.lock").unlink(missing_ok=True)

    def compiling(self) -> bool:
        """Whether a live process is compiling this key now."""
        lock = self.dir / "compiling.lock"
        return lock.exists() and _holder_alive(lock)


def _holder_alive(lock: Path) -> bool:
    """Whether the process that wrote `lock` ("PID [START]") still runs: a live process with that
    pid is not enough, since after a reboot or a long uptime another process can have it (and
    runs would stay eager, "another process is compiling", for as long as that one lives)."""
    try:
        pid, *start = lock.read_text().split()
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    return not start or start_ticks(int(pid)) in (None, start[0])


def entries() -> list[dict[str, Any]]:
    """Every key under root(): its path, size, age and description (for `genfast cache`)."""
    found = []
    for directory in sorted(root().glob("*")) if root().is_dir() else []:
        if not directory.is_dir():
            continue
        files = [p for p in directory.rglob("*") if p.is_file()]
        info = directory / "artifact.json"
        try:
            description = json.loads(info.read_text()) if info.is_file() else {}
        except (OSError, json.JSONDecodeError):
            description = {}
        found.append({
            "key": directory.name,
            "path": str(directory),
            "bytes": sum(p.stat().st_size for p in files),
            "age_s": time.time() - max((p.stat().st_mtime for p in files), default=directory.stat().st_mtime),
            "description": description,
        })  # fmt: skip
    return found
