"""What machine a number was measured on, and its measured peak memory read bandwidth."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from typing import Any

import torch

from genfast.platform import hugepages
from genfast.platform.hardware import cpu_model, describe_isa, synchronize
from genfast.storage.files import write_json_atomic
from genfast.storage.paths import machine_file

_BANDWIDTH_BYTES = 1 << 29  # 512 MiB: far larger than any cache


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({torch.get_num_threads()} threads)"


def machine_info(device: torch.device | str) -> dict[str, Any]:
    return {
        "device": device_name(device),
        "isa": describe_isa() if torch.device(device).type == "cpu" else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }


def describe_machine(info: dict[str, Any]) -> str:
    """'<device>, ISA <isa>, torch <version>' for bench headers and footnotes."""
    isa = f", ISA {info['isa']}" if info.get("isa") else ""
    return f"{info['device']}{isa}, torch {info['torch']}"


def peak_read_bandwidth(device: torch.device | str, remeasure: bool = False) -> float:
    """Bytes/s this device reads from memory at best (a large reduction, best of several runs).

    Measured once per device and thread count and kept in GENFAST_HOME/machine.json;
    GENFAST_PEAK_BW_GBS overrides it (e.g. with a STREAM result).
    """
    if os.environ.get("GENFAST_PEAK_BW_GBS"):
        return float(os.environ["GENFAST_PEAK_BW_GBS"]) * 1e9
    key = device_name(device)
    if torch.device(device).type == "cpu" and hugepages.unavailable_reason() is None:
        key += ", huge pages"  # measured in the memory the weights live in
    store = machine_file()
    known: dict[str, float] = {}
    if store.is_file():
        try:
            known = json.loads(store.read_text())
        except (OSError, json.JSONDecodeError):
            known = {}
    if key in known and not remeasure:
        return known[key]
    known[key] = measure_read_bandwidth(device)
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(store, known, indent=1)
    except OSError as exc:  # e.g. a read-only home: measured again next time
        print(f"genfast: cannot keep the measured bandwidth in {store} ({exc.strerror or exc})", file=sys.stderr)
    return known[key]


def measure_read_bandwidth(device: torch.device | str, repeats: int = 7) -> float:
    device = torch.device(device)
    # A GPU reads 512 MiB in a fraction of a millisecond, where a launch's overhead would show: read 4 GiB there.
    nbytes = _BANDWIDTH_BYTES * (8 if device.type == "cuda" else 1)
    if device.type == "cpu":  # where an LLM's weights are (huge pages where the kernel has them)
        x = hugepages.empty((nbytes // 4,), torch.float32).fill_(1.0)
    else:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        x.sum()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best
