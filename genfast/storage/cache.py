"""`genfast cache`: what lives under GENFAST_HOME, how big it is, and clearing it.

Four parts, each rebuilt on demand except the models: `compiled` (steps compiled ahead of time,
genfast/compilation/artifacts.py), `inductor` (torch.compile's own cache), `kernels` (the native CPU kernels,
built once per variant and torch version) and `models` (downloads and `pull`s). `clear` removes
the rebuildable parts by default; models only when named.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from genfast.errors import UserError
from genfast.storage.paths import genfast_home, inductor_dir, kernels_dir

PARTS = ("compiled", "inductor", "kernels", "models")
REBUILDABLE = ("compiled", "inductor", "kernels")


def part_dir(part: str) -> Path:
    import os

    if part == "inductor":
        # genfast's own choice is one folder per kind of CPU inside this part (compilation.inductor).
        ours = inductor_dir()
        chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        return Path(chosen) if chosen and Path(chosen).parent != ours else ours
    if part == "kernels":
        return kernels_dir()
    return genfast_home() / part


def size_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _describe(entry: dict) -> str:
    d = entry["description"]
    env = d.get("environment", {})
    if "summary" in d:
        return f"{d['summary']}; torch {env.get('torch', '?')}, ISA {env.get('isa', '?')}"
    args = d.get("model_args", {})
    shape = f"dim {args.get('dim')}, {args.get('n_layers')} layers, vocab {args.get('vocab_size')}" if args else "?"
    return (f"{d.get('what', '?')}: {shape}, {d.get('dtype', '?')}, quant {d.get('quant', '?')}, batch "
            f"{d.get('batch', '?')}, {d.get('cache_len', '?')} slots; torch {env.get('torch', '?')}, "
            f"ISA {env.get('isa', '?')}")  # fmt: skip


def cache_command(args: argparse.Namespace) -> int:
    from genfast.compilation import artifacts

    action = args.action or "list"
    if action == "size":
        total = 0
        for part in PARTS:
            n = size_bytes(part_dir(part))
            total += n
            print(f"{part:9} {human(n):>9}  {part_dir(part)}")
        print(f"{'total':9} {human(total):>9}  {genfast_home()}")
        return 0
    if action == "list":
        entries = artifacts.entries()
        print(f"GENFAST_HOME: {genfast_home()}")
        print(f"compiled steps ({len(entries)}):" if entries else "compiled steps: none")
        for entry in entries:
            age = entry["age_s"] / 86400
            print(f"  {entry['key']}  {human(entry['bytes']):>9}  {age:.1f} days  {_describe(entry)}")
        for part in ("inductor", "kernels", "models"):
            print(f"{part}: {human(size_bytes(part_dir(part)))} in {part_dir(part)}")
        return 0
    if action == "clear":
        parts = args.parts or list(REBUILDABLE)
        unknown = [p for p in parts if p not in PARTS]
        if unknown:
            raise UserError(f"unknown cache part {', '.join(unknown)}; use {', '.join(PARTS)}")
        for part in parts:
            path = part_dir(part)
            freed = size_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            print(f"cleared {part}: {human(freed)} ({path})")
        return 0
    raise UserError(f"unknown cache action {action!r}; use list, size or clear")
