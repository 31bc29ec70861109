"""`genfast info`: what this machine is and how genfast runs on it, so a user can see why it is fast
or slow here: CPU, ISA level, threads, measured read bandwidth, the CPUs other processes keep busy,
what `--dtype auto` means, and which variant of each native kernel runs (and why)."""

from __future__ import annotations

import argparse
import os
import platform

import torch

from genfast import __version__
from genfast.bench.machine import peak_read_bandwidth
from genfast.kernels import registry
from genfast.kernels.qlinear import ops as qlinear
from genfast.platform import hardware, hugepages
from genfast.platform.threads import OtherWork, threads_for


def machine_report(measure_bandwidth: bool = True) -> list[tuple[str, str]]:
    """(label, value) lines; building the chosen kernel variants (once, cached) checks that they work."""
    cpu = torch.device("cpu")
    other_work = OtherWork()  # sampled while the report is made (the bandwidth measurement: ~1 s)
    lines = [
        ("genfast", f"{__version__} (torch {torch.__version__}, Python {platform.python_version()})"),
        ("CPU", f"{hardware.cpu_model()}, {os.cpu_count()} logical cores, {torch.get_num_threads()} threads"),
        ("ISA", hardware.describe_isa()),
    ]
    if measure_bandwidth:
        lines.append(
            (
                "read bandwidth",
                f"{peak_read_bandwidth(cpu) / 1e9:.1f} GB/s (measured, {torch.get_num_threads()} threads)",
            )
        )
    lines.append(("LLM weights on the CPU", hugepages.describe()))
    busy = other_work.busy_cores()
    if busy is not None:
        threads = threads_for(busy)
        lines.append(
            (
                "other work now",
                f"{busy:.1f} CPUs busy with other processes at normal priority: generate, chat and serve "
                f"would compute on {threads} thread{'s' if threads > 1 else ''} (without --threads)",
            )
        )
    auto = hardware.auto_dtype(cpu)
    why = (
        "native bf16 dot products"
        if auto == torch.bfloat16
        else "no native bf16 dot products here: bf16 arithmetic would be emulated"
    )
    lines.append(("--dtype auto", f"{str(auto).removeprefix('torch.')} on the CPU ({why})"))
    reasons = registry.build_all()  # first use: side by side, not one compiler after another
    for kernel in registry.KERNELS:
        variant, why = kernel.choose()
        reason = reasons[kernel.name]  # `why` again when no variant fits
        if reason is None:
            lines.append((kernel.what, f"native {variant.isa} ({why})"))
        else:
            lines.append((kernel.what, f"PyTorch path ({reason})"))
    quant = (
        "native kernel: faster than unquantized decode"
        if qlinear.available()
        else "dequantize path: saves memory, but decode is slower than unquantized"
    )
    lines.append(("--quant int8/int4", f"{quant} (on the CPU)"))
    cuda = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) or "none visible"
    lines.append(("CUDA", cuda))
    if torch.cuda.is_available():
        from genfast.quant.linear import triton_available

        if triton_available():
            import triton

            on_cuda = f"Triton {triton.__version__} kernels"
        else:
            on_cuda = "dequantize path (Triton is not installed)"
        lines.append(("--quant on CUDA", on_cuda))
    return lines


def info_command(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    lines = machine_report(measure_bandwidth=not args.no_bandwidth)
    width = max(len(label) for label, _ in lines)
    for label, value in lines:
        print(f"{label + ':':<{width + 1}} {value}")
    return 0
