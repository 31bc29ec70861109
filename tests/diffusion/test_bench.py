"""`genfast bench diffusion` end to end on the tiny pipeline, and the real-size configs."""

from __future__ import annotations

import json

import pytest
import torch

from genfast import cli


def test_bench_diffusion_writes_the_ladder(tmp_path, capsys):
    out = tmp_path / "rows.json"
    ladder = "--steps baseline,bf16,sdpa --dtype bfloat16 --repeats 1"
    argv = ["bench", "diffusion", "--arch", "tiny-sd15", "--size", "32", "--denoising-steps", "2", *ladder.split()]
    code = cli.main([*argv, "--json", str(out)])
    assert code == 0
    rows = {row["step"]: row for row in json.loads(out.read_text())}
    assert list(rows) == ["baseline", "bf16", "sdpa"]
    for row in rows.values():
        assert row["s_per_image"] > 0 and 0 < row["s_per_denoiser_step"] < row["s_per_image"]
        assert row["peak_mem_gb"] > 0 and row["model"] == "tiny-sd15 (random weights)"
    assert rows["baseline"].get("psnr_db") is None and rows["baseline"]["speedup"] == 1
    # bf16 steps against the fp32 images: within the recipe's 35 dB budget.
    assert rows["bf16"]["psnr_db"] >= 35 and rows["sdpa"]["psnr_vs_sdpa_db"] >= 35
    assert "| baseline |" in capsys.readouterr().out


def test_the_bf16_row_says_why_it_is_left_out(tmp_path):
    """--dtype auto on a CPU that emulates bf16 (or --dtype float32): the row is skipped with the
    reason, and the later steps compute in fp32."""
    from genfast.bench.ladder import measure_row

    row = measure_row(
        {
            "ladder": "genfast.diffusion.bench:DiffusionLadder",
            "row": {"step": "bf16", "group": {}},
            "options": {
                "device": "cpu",
                "dtype": "float32",
                "repeats": 1,
                "threads": None,
                "arch": "tiny-sd15",
                "size": 32,
                "denoising_steps": 1,
            },
            "workdir": str(tmp_path),
        }
    )
    assert row["note"].startswith("skipped:") and "fp32" in row["note"] and "s_per_image" not in row


@pytest.mark.slow
def test_bench_dynamic_shapes_row_reports_no_recompile_at_a_new_size(tmp_path):
    out = tmp_path / "rows.json"
    assert (
        cli.main(
            [
                "bench",
                "diffusion",
                "--arch",
                "tiny-sd15",
                "--size",
                "128",
                "--denoising-steps",
                "1",
                "--repeats",
                "1",
                "--steps",
                "dynamic-shapes",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    (row,) = json.loads(out.read_text())
    assert row["step"] == "dynamic-shapes" and row["compile_s"] > 0
    assert row["new_size_graphs"] == 0  # 64x64 after 128x128: the graphs were reused


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arch", "sd3"], "unknown --arch"),
        (["--arch", "tiny-sd15", "--size", "30"], "multiple of 8"),
        (["--arch", "tiny-sd15", "--steps", "baseline,warp"], "unknown step"),
    ],
)
def test_bench_diffusion_user_errors(argv, message, capsys):
    assert cli.main(["bench", "diffusion", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("arch, unet_params", [("sd15", 859.52e6), ("sdxl", 2567.46e6)])
def test_real_size_configs_have_the_published_parameter_counts(arch, unet_params):
    """Built on the meta device (no memory): SD 1.5's UNet has 859.5M parameters, SDXL's 2567.5M."""
    from diffusers import UNet2DConditionModel

    from genfast.diffusion import pipelines

    with torch.device("meta"):
        unet = UNet2DConditionModel(**(pipelines._SDXL_UNET if arch == "sdxl" else pipelines._SD15_UNET))
    assert sum(p.numel() for p in unet.parameters()) == pytest.approx(unet_params, rel=1e-4)
