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
        (["--arch", "tiny-sd15", "--steps", "cache-dit"], "caches transformer blocks: tiny-sd15's denoiser is a UNet"),
        (["--arch", "tiny-flux", "--cache-threshold", "-0.5"], "--cache-threshold -0.5: must be a finite number >= 0"),
        (["--arch", "tiny-sd3", "--cache-threshold", "nan"], "--cache-threshold nan: must be a finite number >= 0"),
        (["--arch", "flux-dev", "--cache-threshold", "inf"], "--cache-threshold inf: must be a finite number >= 0"),
        (["--arch", "sdxl", "--cache-threshold", "0.5"], "sdxl's feature cache is DeepCache"),
        (["--arch", "tiny-sd15", "--cache-threshold", "0"], "tiny-sd15's feature cache is DeepCache"),
        (["--arch", "tiny-flux", "--cache-blocks", "0,1"], "--cache-blocks 0,1: give F,B, front blocks >= 1"),
        (["--arch", "tiny-flux", "--cache-blocks", "2"], "--cache-blocks 2: give F,B"),
        (["--arch", "tiny-flux", "--cache-blocks", "1,-1"], "--cache-blocks 1,-1: give F,B"),
        (["--arch", "flux-schnell", "--cache-blocks", "2,1"], "needs a block to skip between its front and back"),
        (["--arch", "sd15", "--cache-blocks", "1,0"], "sd15's denoiser is a UNet"),
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


@pytest.mark.parametrize("arch", ["tiny-flux", "tiny-sd3"])
def test_bench_diffusion_on_dit_pipelines_starts_with_diffusers_own_row(arch, tmp_path):
    """FLUX.1- and SD 3.5-shaped pipelines: the `diffusers` row (its own pipeline in bf16) first,
    timed like the recipe's rows, its PSNR against the baseline moved into its row."""
    out = tmp_path / "rows.json"
    argv = ["bench", "diffusion", "--arch", arch, "--size", "32", "--denoising-steps", "1", "--repeats", "1"]
    assert cli.main([*argv, "--steps", "diffusers,baseline", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [row["step"] for row in rows] == ["diffusers", "baseline"]
    diffusers, baseline = rows
    for row in rows:
        assert row["s_per_image"] > 0 and 0 < row["s_per_denoiser_step"] < row["s_per_image"]
        assert row["peak_mem_gb"] > 0 and row["model"] == f"{arch} (random weights)"
    assert diffusers["speedup"] == 1 and baseline["speedup"] > 0  # speed-ups against what users run
    assert diffusers["psnr_db"] >= 30 and diffusers["psnr_vs_sdpa_db"] >= 30  # bf16 against fp32
    assert "diffusers_psnr" not in baseline and baseline.get("psnr_db") is None


def test_the_default_ladder_starts_with_the_diffusers_row():
    from genfast.diffusion.bench import DiffusionLadder
    from genfast.diffusion.recipe import RECIPE

    ladder = DiffusionLadder()
    assert ladder.steps(None) == ["diffusers", *RECIPE.names, "cache-dit"]
    assert ladder.steps("sdpa,diffusers,baseline") == ["diffusers", "baseline", "sdpa"]
    assert ladder.steps("bf16") == ["bf16"]
    assert ladder.steps("cache-dit,feature-cache") == ["feature-cache", "cache-dit"]
    # cache-dit caches transformer blocks: no row of it on a UNet pipeline, unless named (an error).
    assert [row.step for row in ladder.rows(["diffusers", "cache-dit"], {"arch": "tiny-sd15"})] == ["diffusers"]
    assert [row.step for row in ladder.rows(["cache-dit"], {"arch": "tiny-flux"})] == ["cache-dit"]


def test_a_step_that_fails_on_a_dit_pipeline_is_a_row_with_the_reason(tmp_path, monkeypatch):
    """genfast's steps on FLUX.1/SD 3.5 are new: a failure becomes the row's note, the ladder goes on."""
    from genfast.bench import ladder
    from genfast.diffusion.bench import DiffusionLadder

    def fails(spec):
        raise RuntimeError("no kernel for this shape\nsecond line")

    monkeypatch.setattr(ladder, "measure_row", fails)
    out, spec = tmp_path / "row.json", tmp_path / "spec.json"
    spec.write_text(json.dumps({"row": {"step": "compile", "group": {}}, "out": str(out)}))
    assert DiffusionLadder().launch(spec, {"arch": "tiny-flux"}) == 0
    row = json.loads(out.read_text())
    assert row["step"] == "compile" and "s_per_image" not in row
    assert row["note"] == "failed on tiny-flux: RuntimeError: no kernel for this shape"
    assert DiffusionLadder().launch(spec, {"arch": "tiny-sd15"}) is None  # UNets: as every ladder


def _options(
    arch: str,
    blocks: int | None = None,
    size: int = 512,
    cache_threshold: float | None = None,
    cache_blocks: str | None = None,
) -> dict:
    from genfast.cli import build_parser
    from genfast.diffusion.bench import DiffusionLadder

    argv = ["bench", "diffusion", "--arch", arch, "--size", str(size), "--device", "cpu", "--dtype", "bfloat16"]
    argv += ["--blocks", str(blocks)] if blocks is not None else []
    argv += ["--cache-threshold", str(cache_threshold)] if cache_threshold is not None else []
    argv += ["--cache-blocks", cache_blocks] if cache_blocks is not None else []
    return DiffusionLadder().options(build_parser().parse_args(argv))


def test_real_dit_archs_are_estimated_from_their_parameter_counts():
    options = _options("flux-dev")  # the default block count: 3 of 57
    assert options["blocks"] == 3 and "3 of 57 blocks" in options["depth"]
    assert options["parameters"] == pytest.approx(1.14e9, rel=0.01)  # 3 blocks, 1-layer CLIP and T5, the VAE
    assert options["attention_scores"] == 24 * (32 * 32 + 512) ** 2


def test_rows_that_do_not_fit_in_memory_are_refused_before_building(monkeypatch, capsys):
    from genfast.diffusion import bench
    from genfast.diffusion.bench import GIB, DiffusionLadder
    from genfast.recipe import Target

    monkeypatch.setattr(bench, "available_memory_bytes", lambda device: GIB)
    assert cli.main(["bench", "diffusion", "--arch", "flux-schnell", "--blocks", "1"]) == 2
    err = capsys.readouterr().err
    assert "1 of 57 blocks" in err and "GiB" in err and "available" in err and "--blocks" in err
    # Enough for bf16, not for the fp32 baseline: that row alone is skipped, saying what it needs.
    options, target = _options("flux-schnell", blocks=1), Target(torch.device("cpu"), "bfloat16")
    bf16 = bench.memory_needed_bytes(options, "sdpa", target)
    monkeypatch.setattr(bench, "available_memory_bytes", lambda device: bf16 + GIB)
    ladder = DiffusionLadder()
    assert ladder.skip_reason(bench.Row("sdpa"), options, target) is None
    reason = ladder.skip_reason(bench.Row("baseline"), options, target)
    assert reason.startswith("needs ~") and "GiB in float32" in reason


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arch", "tiny-flux", "--blocks", "2"], "--blocks applies to"),
        (["--arch", "flux-dev", "--blocks", "58"], "57 transformer blocks"),
        (["--arch", "sd35-medium", "--size", "520"], "multiple of 16"),
    ],
)
def test_bench_diffusion_blocks_errors(argv, message, capsys):
    assert cli.main(["bench", "diffusion", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_cache_rows_on_a_dit_pipeline(monkeypatch):
    """feature-cache runs on FLUX.1 and SD 3.5 (their block cache); the cache-dit row is skipped,
    with the reason, where cache-dit is not installed."""
    import importlib.util

    from genfast.diffusion.bench import DiffusionLadder, Row
    from genfast.recipe import Target

    ladder, target = DiffusionLadder(), Target(torch.device("cpu"), "bfloat16")
    for arch in ("tiny-flux", "tiny-sd3", "tiny-sd15"):
        assert ladder.skip_reason(Row("feature-cache"), {"arch": arch}, target) is None
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "cache_dit" else find_spec(name))
    reason = ladder.skip_reason(Row("cache-dit"), {"arch": "tiny-flux"}, target)
    assert reason.startswith("cache-dit is not installed")


def test_the_cache_dit_row_says_when_cache_dit_is_missing(tmp_path):
    """End to end where cache-dit is not installed (the test environment): a row that says so."""
    import importlib.util

    if importlib.util.find_spec("cache_dit") is not None:
        pytest.skip("cache-dit is installed here: test_the_cache_dit_row measures it")
    out = tmp_path / "rows.json"
    argv = ["bench", "diffusion", "--arch", "tiny-flux", "--size", "32", "--denoising-steps", "1", "--repeats", "1"]
    assert cli.main([*argv, "--steps", "cache-dit", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["step"] == "cache-dit" and row["note"].startswith("skipped: cache-dit is not installed")


def test_the_cache_dit_row(tmp_path):
    """Where cache-dit is installed: its DBCache on diffusers' own tiny FLUX.1 pipeline, timed like
    the other rows, with its PSNR and its configuration (genfast's block cache's) in the note."""
    pytest.importorskip("cache_dit")
    out = tmp_path / "rows.json"
    argv = ["bench", "diffusion", "--arch", "tiny-flux", "--size", "32", "--denoising-steps", "4", "--repeats", "1"]
    assert cli.main([*argv, "--steps", "diffusers,baseline,cache-dit", "--json", str(out)]) == 0
    rows = {row["step"]: row for row in json.loads(out.read_text())}
    row = rows["cache-dit"]
    assert row["s_per_image"] > 0 and 0 < row["s_per_denoiser_step"] < row["s_per_image"]
    assert row["psnr_db"] >= 30 and row["speedup"] > 0
    assert "DBCache_F1B0_W1I1M0MC1_R0.08" in row["note"] and "cached 0 of 4 steps" in row["note"]


def test_the_cache_threshold_reaches_the_cache_rows_only():
    """--cache-threshold is the feature-cache step's tuned threshold: every row's process gets it in
    the options, and only plans that apply the feature cache (and cache-dit's configuration, made
    from that plan) change; without it every row's settings are the recipe's."""
    from genfast.diffusion.bench import DiffusionLadder, Row
    from genfast.diffusion.recipe import BLOCK_CACHE_THRESHOLD, RECIPE
    from genfast.recipe import Target

    ladder, target = DiffusionLadder(), Target(torch.device("cpu"), "bfloat16")
    default, tuned = _options("tiny-flux"), _options("tiny-flux", cache_threshold=0.5)
    for step in ("sdpa", "regional-compile", "feature-cache"):
        assert ladder.plan(Row(step), default, target).settings == RECIPE.plan(step, target).settings
    assert RECIPE.plan("feature-cache", target).settings.block_cache_threshold == BLOCK_CACHE_THRESHOLD == 0.08
    assert ladder.plan(Row("diffusers"), tuned, target) is None
    for step in ("sdpa", "regional-compile"):  # their compiled code's key stays the recipe's
        assert ladder.plan(Row(step), tuned, target).settings == RECIPE.plan(step, target).settings
    plan = ladder.plan(Row("feature-cache"), tuned, target)
    assert plan.settings.block_cache_threshold == 0.5 and plan.settings.feature_cache
    assert ("feature-cache", "block_cache_threshold 0.5 (the recipe's: 0.08)") in plan.notes
    # The header says so, only when it differs from the recipe's.
    assert "threshold" not in ladder.header(default, "a CPU")
    assert "both caches' threshold 0.5 (the recipe's: 0.08)" in ladder.header(tuned, "a CPU")
    assert "threshold" not in ladder.header(_options("tiny-flux", cache_threshold=0.08), "a CPU")


def test_the_cache_blocks_reach_both_cache_rows():
    """--cache-blocks F,B is the feature-cache step's tuned front and back blocks, beside
    --cache-threshold; the header says so, and cache-dit's configuration is made from that plan."""
    from genfast.diffusion.bench import DiffusionLadder, Row
    from genfast.recipe import Target

    ladder, target = DiffusionLadder(), Target(torch.device("cpu"), "bfloat16")
    options = _options("flux-schnell", blocks=5, cache_threshold=0.5, cache_blocks="2,1")
    plan = ladder.plan(Row("feature-cache"), options, target)
    settings = plan.settings
    assert (settings.block_cache_front, settings.block_cache_back, settings.block_cache_threshold) == (2, 1, 0.5)
    assert ladder.plan(Row("sdpa"), options, target).settings.block_cache_front == 1  # the recipe's elsewhere
    assert "both caches' front and back blocks F2B1" in ladder.header(options, "a CPU")
    assert "front and back" not in ladder.header(_options("flux-schnell"), "a CPU")


def test_a_step_left_out_by_without_is_neither_applied_nor_noted(tmp_path):
    """--without channels-last on a DiT pipeline: the later row's plan leaves the step out, and the
    row's note (made again once the pipeline is known) does not list it among the VAE-only steps."""
    out = tmp_path / "rows.json"
    argv = ["bench", "diffusion", "--arch", "tiny-flux", "--size", "32", "--denoising-steps", "1", "--repeats", "1"]
    assert cli.main([*argv, "--steps", "fused-qkv", "--json", str(out)]) == 0
    assert "channels-last: changes the VAE only" in json.loads(out.read_text())[0]["note"]
    assert cli.main([*argv, "--steps", "fused-qkv", "--without", "channels-last", "--json", str(out), "--force"]) == 0
    (row,) = json.loads(out.read_text())
    assert row["without"] == ["channels-last"] and "channels-last" not in (row["note"] or "")


@pytest.mark.slow
def test_a_high_cache_threshold_caches_steps_in_both_cache_rows(tmp_path, capsys):
    """Random weights change the first block's residual by more than the recipe's threshold; with
    --cache-threshold 10 the block cache skips every step it may (warm-up 1, at most one in a row:
    steps 2 and 4 of 4), and cache-dit, configured alike, the same ones (where it is installed);
    --cache-blocks 1,1 (one back block of tiny FLUX.1's four) reaches both."""
    out = tmp_path / "rows.json"
    argv = ["bench", "diffusion", "--arch", "tiny-flux", "--size", "32", "--denoising-steps", "4", "--repeats", "1"]
    argv += ["--steps", "feature-cache,cache-dit", "--cache-threshold", "10", "--cache-blocks", "1,1"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "both caches' threshold 10.0 (the recipe's: 0.08)" in err and "front and back blocks F1B1" in err
    rows = {row["step"]: row for row in json.loads(out.read_text())}
    feature_cache, cache_dit = rows["feature-cache"], rows["cache-dit"]
    assert feature_cache["s_per_image"] > 0 and "cached 2 of 4 steps" in feature_cache["note"]
    assert "block_cache_threshold 10.0 (the recipe's: 0.08)" in feature_cache["note"]
    assert "block_cache_back 1 (the recipe's: 0)" in feature_cache["note"]
    if cache_dit["note"].startswith("skipped: cache-dit is not installed"):
        return
    assert cache_dit["s_per_image"] > 0 and "cached 2 of 4 steps" in cache_dit["note"]
    assert "DBCache_F1B1_W1I1M0MC1_R10.0" in cache_dit["note"]
