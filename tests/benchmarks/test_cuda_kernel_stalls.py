"""benchmarks/cuda_kernel_stalls.py's reading of an Nsight Compute report (no GPU or ncu here: a
report in the form `ncu --import R --csv --page raw --print-units base` prints)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import cuda_kernel_stalls as stalls

STALL = stalls.STALL_METRICS


def report(kernels: list[tuple[str, str, str, str]]) -> str:
    """A raw-page CSV: (kernel name, time in ns, DRAM bytes read, long_scoreboard stalls) per kernel."""
    metrics = [stalls.METRICS["time"], stalls.METRICS["dram_read"], STALL["stall long_scoreboard"], STALL["stall wait"]]
    lines = [
        "==PROF== Disconnected from process 1234",
        ",".join(f'"{c}"' for c in ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", *metrics]),
        ",".join(f'"{c}"' for c in ["", "", "", "", "", "nsecond", "byte", "", ""]),
    ]
    for i, (name, ns, read, long_sb) in enumerate(kernels):
        lines.append(",".join(f'"{c}"' for c in [str(i), "1234", "python3", "host", name, ns, read, long_sb, "0.5"]))
    return "\n".join(lines)


def cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_kernels_are_read_in_base_units_and_grouped_by_marker():
    text = report([
        ("_variant_marker", "1,024", "0", "0"),
        ("_gemv", "150,000", "126,000,000", "9.5"),  # 0.84 TB/s
        ("triton_poi_fused_add_0", "2,000", "65,536", "1.0"),
        ("_variant_marker", "1,000", "0", "0"),
        ("Kernel2(cutlass::Params)", "50,000", "150,000,000", "3.2"),
    ])  # fmt: skip
    kernels = stalls.parse_raw_csv(text)
    assert [k["Kernel Name"] for k in kernels][1] == "_gemv"
    assert kernels[1]["time"] == pytest.approx(150e-6) and kernels[1]["dram_read"] == 126e6
    assert kernels[1]["achieved"] is None  # a metric the report lacks
    groups = stalls.by_variant(kernels, [["llama-2-7b", "int4 g32 triton", 1], ["llama-2-7b", "bf16 F.linear", 1]])
    names = [[k["Kernel Name"] for k in g] for _, g in groups]
    assert names == [["_gemv", "triton_poi_fused_add_0"], ["Kernel2(cutlass::Params)"]]
    rows = stalls.table(groups)
    assert rows[2].startswith("| llama-2-7b | int4 g32 triton | 1 | all 2 kernels | | 152.0 |")
    gemv = cells(rows[3])
    assert gemv[3] == "_gemv" and gemv[5] == "150.0" and gemv[6] == "840"
    assert gemv[10] == "long_scoreboard 9.5, wait 0.5"
    assert "triton_poi_fused_add_0" not in "\n".join(rows)  # 1.3% of its variant's time
    assert cells(rows[5])[3] == "Kernel2" and cells(rows[5])[6] == "3000"


def test_a_report_that_does_not_match_the_variants_is_an_error():
    kernels = stalls.parse_raw_csv(report([("_variant_marker", "1", "0", "0"), ("_gemv", "5", "5", "1")]))
    with pytest.raises(ValueError, match="1 marked groups of kernels for 2 variants"):
        stalls.by_variant(kernels, [["a", "b", 1], ["a", "c", 1]])
    with pytest.raises(ValueError, match="in 'furlong', a unit this script does not know"):
        stalls.parse_raw_csv(report([]).replace('"nsecond"', '"furlong"'))
    with pytest.raises(ValueError, match="no kernel table"):
        stalls.parse_raw_csv("==ERROR== the application returned an error")
