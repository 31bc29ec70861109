"""`genfast imagine` end to end on the tiny random pipeline (2 steps, 32 x 32)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from genfast import cli
from tests.busy import busy_loop, needs_proc, threads_restored

SMOKE = ["--model", "tiny-sd15", "--random-weights", "--size", "32x32", "--denoising-steps", "2", "--seed", "3"]


def test_imagine_writes_a_labelled_png_reproducibly(tmp_path, capsys):
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    assert cli.main(["imagine", "a red square", *SMOKE, "-o", str(first)]) == 0
    err = capsys.readouterr().err
    assert "RANDOM weights" in err and err.count("WARNING") == 2 and "denoising" in err
    assert cli.main(["imagine", "a red square", *SMOKE, "-o", str(second)]) == 0
    with Image.open(first) as a, Image.open(second) as b:
        assert a.size == (32, 32) and a.mode == "RGB"
        assert a.text["genfast:random-weights"] == "true" and "Warning" in a.text
        assert a.text["genfast:seed"] == "3" and a.text["genfast:prompt"] == "a red square"
        assert np.array_equal(np.asarray(a), np.asarray(b))  # same seed, same image


def test_imagine_never_overwrites_without_force(tmp_path, capsys):
    out = tmp_path / "keep.png"
    out.write_bytes(b"mine")
    assert cli.main(["imagine", "x", *SMOKE, "-o", str(out)]) == 2
    assert out.read_bytes() == b"mine" and "--force" in capsys.readouterr().err
    assert cli.main(["imagine", "x", *SMOKE, "-o", str(out), "--force"]) == 0
    with Image.open(out) as img:
        assert img.size == (32, 32)


def test_without_size_the_image_has_the_models_own_size(tmp_path, capsys):
    """diffusers' default (the denoiser's sample size times the VAE's factor): a fixed 512x512
    made SDXL draw at a quarter of its trained area and the tiny pipelines at 16x theirs."""
    out = tmp_path / "native.png"
    argv = ["imagine", "x", "--model", "tiny-sdxl", "--random-weights", "--denoising-steps", "1", "-o", str(out)]
    assert cli.main(argv) == 0
    assert "32x32, 1 steps" in capsys.readouterr().err
    with Image.open(out) as img:
        assert img.size == (32, 32) and img.text["genfast:size"] == "32x32"


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--guidance", "-1", "must be >= 0"),
        ("--guidance", "nan", "must be >= 0"),
        ("--seed", "-3", "expected a whole number >= 0"),
        ("--seed", str(2**63), "a seed is 0 to 9223372036854775807"),
    ],
)
def test_imagine_flag_values_out_of_range(flag, value, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(
            ["imagine", "x", "--model", "tiny-sd15", "--random-weights", flag, value, "-o", str(tmp_path / "o.png")]
        )
    assert message in capsys.readouterr().err and not (tmp_path / "o.png").exists()


def test_imagine_refuses_an_output_named_for_another_format(tmp_path, capsys):
    out = tmp_path / "cat.JPG"
    assert cli.main(["imagine", "x", "--model", "tiny-sd15", "--random-weights", "-o", str(out)]) == 2
    assert f"name it {tmp_path / 'cat.png'}" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


def test_imagine_loads_a_pipeline_directory(tmp_path, capsys):
    """A diffusers directory (here the tiny PixArt-α, saved) loads with --model DIR and runs with a
    non-square size and, without --guidance, the pipeline's own default guidance (PixArt's 4.5);
    the image is the in-process pipeline's."""
    import torch

    from genfast.diffusion.pipelines import call_kwargs, tiny_pipeline
    from genfast.diffusion.recipe import DiffusionSettings, apply_recipe

    pipe = tiny_pipeline("pixart")
    pipe.save_pretrained(tmp_path / "pixart")
    apply_recipe(pipe, DiffusionSettings())
    out = tmp_path / "out.png"
    assert (
        cli.main(
            [
                "imagine",
                "a red square",
                "--model",
                str(tmp_path / "pixart"),
                "--size",
                "48x32",
                "--denoising-steps",
                "2",
                "--seed",
                "5",
                "--recipe",
                "baseline",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    assert "RANDOM" not in capsys.readouterr().err
    expected = pipe(
        "a red square",
        height=32,
        width=48,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(5),
        **call_kwargs(pipe),
    ).images[0]
    with Image.open(out) as img:
        assert img.size == (48, 32) and img.text["genfast:random-weights"] == "false"
        assert img.text["genfast:guidance"] == "4.5"
        assert np.array_equal(np.asarray(img), np.asarray(expected))


def test_imagine_says_the_dtype_its_recipe_computes_in(tmp_path, capsys):
    out = tmp_path / "out.png"
    assert (
        cli.main(
            [
                "imagine",
                "x",
                "--model",
                "tiny-sd15",
                "--random-weights",
                "--size",
                "32x32",
                "--denoising-steps",
                "1",
                "--recipe",
                "sdpa",
                "--dtype",
                "float32",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    assert "recipe sdpa in float32" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "tiny-sd15", "--random-weights", "--size", "32x"], "WIDTHxHEIGHT"),
        (["--model", "tiny-sd15", "--random-weights", "--size", "30x32"], "multiples of 8"),
        (["--model", "sd99", "--random-weights"], "--random-weights builds one of"),
        (["--model", "tiny-sd15"], "only with random weights"),
        (["--model", "./no/such/pipeline"], "is not a directory"),
    ],
)
def test_imagine_user_errors(argv, message, tmp_path, capsys):
    out = tmp_path / "out.png"
    assert cli.main(["imagine", "x", *argv, "-o", str(out)]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_imagine_rejects_a_directory_without_model_index(tmp_path, capsys):
    (tmp_path / "pipe").mkdir()
    assert cli.main(["imagine", "x", "--model", str(tmp_path / "pipe"), "-o", str(tmp_path / "o.png")]) == 2
    assert "model_index.json" in capsys.readouterr().err


def test_a_recipe_step_the_pipeline_cannot_take_is_one_line(tmp_path, capsys, monkeypatch):
    """The feature cache needs a UNet or a transformer it knows: on a pipeline whose denoiser it does
    not know (PixArt's, made unknown here) it is refused without a traceback."""
    from genfast.diffusion import block_cache

    monkeypatch.setattr(block_cache, "TRANSFORMERS", ("FluxTransformer2DModel", "SD3Transformer2DModel"))
    out = tmp_path / "out.png"
    assert (
        cli.main(
            [
                "imagine",
                "x",
                "--model",
                "tiny-pixart",
                "--random-weights",
                "--size",
                "32x32",
                "--denoising-steps",
                "1",
                "--recipe",
                "feature-cache",
                "-o",
                str(out),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "denoiser is PixArtTransformer2DModel" in err and "Traceback" not in err and not out.exists()


@pytest.mark.parametrize(
    ("model", "recipe", "compiled"),
    [
        ("tiny-sd15", "compile", ["UNet2DConditionModel", "VAE decoder"]),
        ("tiny-flux", "regional-compile", ["FluxTransformerBlock", "FluxSingleTransformerBlock", "VAE decoder"]),
    ],
)
def test_a_compiled_recipe_is_saved_by_the_first_run_and_loaded_by_the_next(model, recipe, compiled, tmp_path, capsys):
    """The first run shows each compile (a whole UNet; a DiT's repeated blocks, one per kind); a
    later process loads them; the images agree with eager."""
    from genfast.compilation import saved as saved_compile

    smoke = [*SMOKE, "--dtype", "float32", "--model", model]
    assert cli.main(["imagine", "x", *smoke, "--recipe", "sdpa", "-o", str(tmp_path / "eager.png")]) == 0
    capsys.readouterr()
    for run, says in ((1, "compiling the "), (2, "loaded the compiled ")):
        saved_compile._READY.clear()  # as a new process: nothing compiled in memory
        assert cli.main(["imagine", "x", *smoke, "--recipe", recipe, "-o", str(tmp_path / f"{run}.png")]) == 0
        err = capsys.readouterr().err
        assert all(f"{says}{what}" in err for what in compiled), err
    with (
        Image.open(tmp_path / "eager.png") as e,
        Image.open(tmp_path / "1.png") as a,
        Image.open(tmp_path / "2.png") as b,
    ):
        assert np.array_equal(np.asarray(a), np.asarray(b))
        assert np.abs(np.asarray(a, np.int16) - np.asarray(e, np.int16)).max() <= 2


@pytest.mark.alone
@needs_proc
def test_beside_busy_work_it_computes_on_fewer_threads_unless_told(tmp_path, capsys, monkeypatch):
    """Two busy loops keep more than a CPU busy while the pipeline loads: the run leaves that CPU to
    them and says so, with the same image; --threads keeps the count it is given."""
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with threads_restored() as default, busy_loop(count=2):
        chosen, told = tmp_path / "chosen.png", tmp_path / "told.png"
        assert cli.main(["imagine", "x", *SMOKE, "-o", str(chosen)]) == 0
        err = capsys.readouterr().err
        if default >= 2:
            assert "CPUs busy while the model loaded: computing on 1 thread, not" in err
            assert torch.get_num_threads() == 1
        torch.set_num_threads(default)
        assert cli.main(["imagine", "x", *SMOKE, "-o", str(told), "--threads", str(default)]) == 0
        assert "CPUs busy" not in capsys.readouterr().err and torch.get_num_threads() == default
    with Image.open(chosen) as a, Image.open(told) as b:
        assert np.array_equal(np.asarray(a), np.asarray(b))
