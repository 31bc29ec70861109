"""Why decode's linear kernels run at the speed they do: Nsight Compute's counters for each kernel
of one block's linears, per variant of benchmarks/cuda_linear.py.

    python benchmarks/cuda_kernel_stalls.py [--shapes llama-2-7b] [--rows 1,8]
                                            [--variants "bf16 F.linear,int4 g32 triton"]

The script runs itself under `ncu` (Nsight Compute; `--clock-control none`, so the GPU keeps its
own clocks). Each variant is compiled as cuda_linear.py compiles it and warmed up, then launched
once more after a marker kernel, with the profiler on for that launch only. ncu flushes the caches
before each kernel it measures, so the weights come from DRAM as in decode.

Per kernel that takes at least 3% of its variant's time, the table gives:
- its time and the DRAM bytes it read per second;
- occupancy: warps resident per SM, achieved against theoretical (the most that fit its registers,
  shared memory and block size);
- the share of cycles in which a scheduler issued, and eligible warps per scheduler per cycle;
- the top stall reasons, as warps stalled per issued instruction. long_scoreboard is a wait for
  global memory, wait a fixed-latency dependency, barrier a __syncthreads, math_pipe_throttle a
  busy execution unit.

A kernel bound by DRAM reads at ~3 TB/s on an H100. One that reads less has few warps resident
(occupancy), or warps that wait (stalls) with no other warp eligible to issue.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl

# column -> ncu metric (base units with --print-units base: nanoseconds, bytes)
METRICS = {
    "time": "gpu__time_duration.sum",
    "dram_read": "dram__bytes_read.sum",
    "achieved": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "theoretical": "sm__maximum_warps_per_active_cycle_pct",
    "issue": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "eligible": "smsp__warps_eligible.avg.per_cycle_active",
    "registers": "launch__registers_per_thread",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
}
STALLS = (
    "long_scoreboard", "wait", "short_scoreboard", "barrier", "mio_throttle", "lg_throttle", "math_pipe_throttle",
    "not_selected", "no_instruction", "dispatch_stall", "branch_resolving", "membar", "drain",
)  # fmt: skip
STALL_METRICS = {f"stall {s}": f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS}
CORE = ("time", "dram_read", "achieved", "theoretical")  # kept if ncu refuses the others
MARKER = "_variant_marker"
# Units to seconds and bytes (--print-units base gives nsecond and byte; the others in case it does not).
SCALE = {"nsecond": 1e-9, "ns": 1e-9, "usecond": 1e-6, "us": 1e-6, "msecond": 1e-3, "ms": 1e-3, "second": 1.0,
         "s": 1.0, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}  # fmt: skip
SCALED = ("time", "dram_read")  # the columns whose unit matters
SHOWN_SHARE = 0.03


@triton.jit
def _variant_marker(ptr):
    """Launched before each variant's profiled call: where one variant's kernels begin."""
    tl.store(ptr, 1)


def profile_variants(shapes: list[str], rows_wanted: list[int], wanted: list[str] | None, labels_path: str) -> None:
    """Under ncu (--profile-from-start off): each variant compiled and warmed up with the profiler
    off, then one marked call with it on; the variants' labels, in order, to `labels_path`."""
    from cuda_linear import compiled_variants

    flag = torch.zeros(1, device="cuda", dtype=torch.int32)
    labels = []
    for shape in shapes:
        for name, _, rows, run, xs in compiled_variants(shape, wanted, rows_wanted):
            for _ in range(3):  # compiles, then Triton's and cuBLAS's first-call work
                run(xs)
            _variant_marker[(1,)](flag)
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            _variant_marker[(1,)](flag)
            run(xs)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            labels.append([shape, name, rows])
    with open(labels_path, "w") as f:
        json.dump(labels, f)


def parse_raw_csv(text: str) -> list[dict[str, object]]:
    """ncu's `--page raw --csv` report: one dict per kernel, in launch order, "Kernel Name" and
    every metric column in base units (floats; None where ncu gave no number)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no kernel table in ncu's output")
    reader = csv.reader(io.StringIO("\n".join(lines[start:])))
    header = next(reader)
    units = dict(zip(header, next(reader, []), strict=False))  # the row under the header
    for column in SCALED:
        unit = units.get(METRICS[column])
        if unit is not None and unit not in SCALE:
            raise ValueError(f"{METRICS[column]} in {unit!r}, a unit this script does not know")
    kernels = []
    for row in reader:
        cells = dict(zip(header, row, strict=False))
        if not cells.get("ID", "").strip().isdigit():
            continue
        kernel: dict[str, object] = {"Kernel Name": cells.get("Kernel Name", "?")}
        for column, metric in {**METRICS, **STALL_METRICS}.items():
            raw = cells.get(metric, "").replace(",", "").strip()
            try:
                kernel[column] = float(raw) * (SCALE[units[metric]] if column in SCALED else 1.0)
            except ValueError:
                kernel[column] = None
        kernels.append(kernel)
    return kernels


def by_variant(kernels: list[dict[str, object]], labels: list) -> list[tuple[list, list[dict[str, object]]]]:
    """The kernels after each marker, paired with the variants in the order they ran."""
    groups: list[list[dict[str, object]]] = []
    for kernel in kernels:
        if MARKER in str(kernel["Kernel Name"]):
            groups.append([])
        elif groups:
            groups[-1].append(kernel)
    if len(groups) != len(labels):
        raise ValueError(f"{len(groups)} marked groups of kernels for {len(labels)} variants")
    return list(zip(labels, groups, strict=True))


def short_name(name: str, width: int = 48) -> str:
    name = name.split("(")[0].strip()
    return name if len(name) <= width else name[: width - 3] + "..."


def table(groups: list[tuple[list, list[dict[str, object]]]]) -> list[str]:
    """Markdown rows: per variant, its kernels that take at least SHOWN_SHARE of its time."""

    def number(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    out = [
        "| shapes | variant | rows | kernel | grid x block, registers | us | DRAM read GB/s | occupancy % "
        "achieved / theoretical | issue active % | eligible warps per scheduler | top stalls (warps per issue) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (shape, name, rows), kernels in groups:
        total = sum(k["time"] or 0.0 for k in kernels)
        out.append(f"| {shape} | {name} | {rows} | all {len(kernels)} kernels | | {total * 1e6:.1f} | | | | | |")
        for k in kernels:
            if not k["time"] or k["time"] < SHOWN_SHARE * total:
                continue
            stalls = sorted(((k[c], c.split(" ", 1)[1]) for c in STALL_METRICS if k[c] is not None), reverse=True)
            top = ", ".join(f"{reason} {value:.1f}" for value, reason in stalls[:3]) or "-"
            launch = f"{number(k['grid'], '.0f')} x {number(k['block'], '.0f')}, {number(k['registers'], '.0f')}"
            gbs = None if k["dram_read"] is None else k["dram_read"] / k["time"] / 1e9
            occupancy = f"{number(k['achieved'], '.0f')} / {number(k['theoretical'], '.0f')}"
            out.append(
                f"| | | | {short_name(str(k['Kernel Name']))} | {launch} | {k['time'] * 1e6:.1f} "
                f"| {number(gbs, '.0f')} "
                f"| {occupancy} | {number(k['issue'], '.0f')} | {number(k['eligible'], '.2f')} | {top} |"
            )
    return out


def find_ncu() -> str:
    """ncu on PATH, else where CUDA toolkits and Nsight Compute's own installer put it."""
    candidates = ["/usr/local/cuda/bin/ncu", *sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)]
    found = shutil.which("ncu") or next((path for path in candidates if os.access(path, os.X_OK)), None)
    if found is None:
        raise SystemExit("cuda_kernel_stalls: needs Nsight Compute's `ncu` on PATH (CUDA toolkits ship it)")
    return found


def profile(ncu: str, metrics: list[str], args: argparse.Namespace, folder: str) -> subprocess.CompletedProcess:
    child = [sys.executable, os.path.abspath(__file__), "--child", os.path.join(folder, "labels.json"),
             "--shapes", args.shapes, "--rows", args.rows]  # fmt: skip
    if args.variants:
        child += ["--variants", args.variants]
    # application-only: not inductor's compile workers, which launch no kernels
    command = [ncu, "--profile-from-start", "off", "--target-processes", "application-only", "--clock-control",
               "none", "--metrics", ",".join(metrics), "--export", os.path.join(folder, "report"), "--force-overwrite",
               *child]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama-2-7b")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--variants", help="comma-separated cuda_linear.py variant names (default: all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the process ncu profiles: the labels' file
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    wanted = args.variants.split(",") if args.variants else None
    if args.child:
        profile_variants(args.shapes.split(","), rows, wanted, args.child)
        return
    ncu = find_ncu()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}\n")
    with tempfile.TemporaryDirectory() as folder:
        done = profile(ncu, [*METRICS.values(), *STALL_METRICS.values()], args, folder)
        if done.returncode != 0 and "metric" in done.stdout + done.stderr:
            # a metric this ncu or GPU lacks fails the whole run: keep the core ones
            print(f"ncu failed with every metric ({done.stderr.strip()[-300:]}); again with {', '.join(CORE)}\n")
            done = profile(ncu, [METRICS[c] for c in CORE], args, folder)
        if done.returncode != 0:
            sys.exit(f"cuda_kernel_stalls: ncu failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        raw_page = ["--csv", "--page", "raw", "--print-units", "base"]
        report_file = os.path.join(folder, "report.ncu-rep")
        report = subprocess.run(
            [ncu, "--import", report_file, *raw_page], capture_output=True, text=True, check=True
        ).stdout
        with open(os.path.join(folder, "labels.json")) as f:
            labels = json.load(f)
    print("\n".join(table(by_variant(parse_raw_csv(report), labels))))


if __name__ == "__main__":
    main()
