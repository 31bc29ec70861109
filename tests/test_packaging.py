"""The native kernels' C++ sources are compiled on the user's machine, so the package must ship them."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_source_is_package_data():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {
        path
        for package, patterns in package_data.items()
        for pattern in patterns
        for path in (ROOT / package.replace(".", "/")).glob(pattern)
    }
    sources = set((ROOT / "genfast").rglob("*.cpp")) | set((ROOT / "genfast").rglob("*.h"))
    assert sources and sources <= shipped, f"not in [tool.setuptools.package-data]: {sorted(sources - shipped)}"
