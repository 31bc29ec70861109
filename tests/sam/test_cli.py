"""`genfast segment` end to end through cli.main, on a tiny random SAM checkpoint (no real weights
here): masks equal the predictor's, JSON RLE decodes to them, --random-weights is labelled in
every output, and user errors are one line with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from genfast.cli import main
from genfast.compilation import saved as saved_compile
from genfast.interface import images
from genfast.sam.build import build_sam, load_sam_checkpoint
from genfast.sam.commands import RANDOM_WEIGHTS_WARNING
from genfast.sam.predictor import SamPredictor
from tests.busy import busy_loop, needs_proc, threads_restored
from tests.sam.oracle import randomize_
from tests.sam.test_modeling import TINY

HEIGHT, WIDTH = 50, 37  # portrait and not a divisor of the model's 64: resizing and padding matter
# The CLI runs the default recipe (the fused attention kernel), the `predictor` fixture the plain
# model: the same fp32 math summed in another order (measured: 2.8e-6 relative on a capped-AVX2 run
# with the CLI on one thread). Scores agree to this; masks, thresholded far from such noise, exactly.
SCORE_RTOL = 1e-4


def rle_decode(rle: dict) -> np.ndarray:
    """Uncompressed COCO RLE -> bool HxW (runs alternate 0s and 1s, column-major, 0s first)."""
    h, w = rle["size"]
    flat = np.zeros(h * w, dtype=bool)
    position, value = 0, False
    for count in rle["counts"]:
        flat[position : position + count] = value
        position, value = position + count, not value
    assert position == h * w
    return flat.reshape((w, h)).T


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("segment_inputs")
    torch.manual_seed(0)
    model = build_sam(TINY)
    randomize_(model, scale=0.1)
    torch.save(model.state_dict(), root / "tiny.pth")
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH]
    image = np.stack([x * 255 // WIDTH, y * 255 // HEIGHT, (x * y) % 256], axis=-1).astype(np.uint8)
    Image.fromarray(image).save(root / "image.png")
    (root / "not-an-image.png").write_text("hello")
    return {"checkpoint": root / "tiny.pth", "image": root / "image.png", "bad_image": root / "not-an-image.png"}


@pytest.fixture(scope="module")
def predictor(files) -> SamPredictor:
    predictor = SamPredictor(load_sam_checkpoint(files["checkpoint"]))
    predictor.set_image(images.load_image(files["image"]))
    return predictor


def segment(files: dict[str, Path], *args: str) -> int:
    return main(["segment", str(files["image"]), "--checkpoint", str(files["checkpoint"]), *args])


def read_mask(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        assert img.mode == "L"
        values = np.asarray(img)
    assert set(np.unique(values)) <= {0, 255}
    return values == 255


def test_point_mask_png_and_json_match_the_predictor(files, predictor, tmp_path, capsys):
    out, js = tmp_path / "mask.png", tmp_path / "masks.json"
    assert segment(files, "--point", "10,20", "-o", str(out), "--json", str(js)) == 0
    masks, scores, _ = predictor.predict(np.array([[10, 20]]), np.array([1]), multimask_output=True)
    best = int(np.argmax(scores))
    assert np.array_equal(read_mask(out), masks[best])
    doc = json.loads(js.read_text())
    assert doc["random_weights"] is False and "warning" not in doc and doc["mode"] == "prompt"
    assert doc["image_size"] == [HEIGHT, WIDTH] and doc["prompt"]["points"] == [[10.0, 20.0]]
    (record,) = doc["masks"]
    assert np.array_equal(rle_decode(record["segmentation"]), masks[best])
    assert record["predicted_iou"] == pytest.approx(float(scores[best]), rel=SCORE_RTOL)
    assert record["area"] == int(masks[best].sum()) and record["file"] == str(out)
    ys, xs = np.nonzero(masks[best])  # segment-anything's XYWH: inclusive corners, w = x1 - x0
    assert record["bbox"] == [xs.min(), ys.min(), xs.max() - xs.min(), ys.max() - ys.min()]
    with Image.open(tmp_path / "mask-overlay.png") as overlay:
        assert overlay.mode == "RGB" and overlay.size == (WIDTH, HEIGHT)
        assert overlay.text["genfast:random-weights"] == "false" and "Warning" not in overlay.text
    err = capsys.readouterr().err
    assert "WARNING" not in err and "wrote" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mask-overlay.png", "mask.png", "masks.json"]


def test_multimask_with_labels_and_box_writes_ranked_masks(files, predictor, tmp_path):
    out, js = tmp_path / "m.png", tmp_path / "m.json"
    args = ["--point", "10,20", "--point", "30,5.5", "--label", "1", "--label", "0", "--box", "2,3,30,45"]
    assert segment(files, *args, "--multimask", "-o", str(out), "--json", str(js), "--no-overlay") == 0
    masks, scores, _ = predictor.predict(
        np.array([[10, 20], [30, 5.5]]), np.array([1, 0]), np.array([2, 3, 30, 45]), multimask_output=True
    )
    order = np.argsort(-scores, kind="stable")
    doc = json.loads(js.read_text())
    assert [m["rank"] for m in doc["masks"]] == [1, 2, 3]
    assert [m["predicted_iou"] for m in doc["masks"]] == pytest.approx(scores[order].tolist(), rel=SCORE_RTOL)
    for path, record, i in zip([out, tmp_path / "m-2.png", tmp_path / "m-3.png"], doc["masks"], order):
        assert np.array_equal(read_mask(path), masks[i])
        assert np.array_equal(rle_decode(record["segmentation"]), masks[i])
    assert doc["prompt"] == {"points": [[10.0, 20.0], [30.0, 5.5]], "labels": [1, 0], "box": [2.0, 3.0, 30.0, 45.0]}
    assert not (tmp_path / "m-overlay.png").exists()


def test_random_weights_are_labelled_in_every_output(files, tmp_path, capsys):
    out, js = tmp_path / "r.png", tmp_path / "r.json"
    assert segment(files, "--random-weights", "--point", "3,4", "-o", str(out), "--json", str(js)) == 0
    err = capsys.readouterr().err
    assert err.count(f"WARNING: {RANDOM_WEIGHTS_WARNING}") == 2  # first and last line
    assert "RANDOM weights" in err
    doc = json.loads(js.read_text())
    assert doc["random_weights"] is True and doc["warning"] == RANDOM_WEIGHTS_WARNING
    assert doc["checkpoint"] is None and "RANDOM" in doc["model"]
    for png in (out, tmp_path / "r-overlay.png"):
        with Image.open(png) as img:
            assert img.text["genfast:random-weights"] == "true"
            assert img.text["Warning"] == RANDOM_WEIGHTS_WARNING


def test_json_on_stdout(files, capsys):
    assert segment(files, "--box", "0,0,20,20", "--json", "-") == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["prompt"]["box"] == [0.0, 0.0, 20.0, 20.0] and len(doc["masks"]) == 1
    assert "JSON on stdout" in captured.err


def test_auto_writes_label_map_overlay_and_rle(files, tmp_path):
    pytest.importorskip("genfast.sam.automatic")
    out, js = tmp_path / "labels.png", tmp_path / "auto.json"
    assert (
        segment(
            files,
            "--auto",
            "--points-per-side",
            "4",
            "--pred-iou-thresh",
            "0",
            "--stability-score-thresh",
            "0",
            "-o",
            str(out),
            "--json",
            str(js),
        )
        == 0
    )
    doc = json.loads(js.read_text())
    assert doc["mode"] == "auto" and doc["prompt"] is None
    masks = [rle_decode(m["segmentation"]) for m in doc["masks"]]
    assert masks, "thresholds of 0 keep some masks"
    assert [m["area"] for m in doc["masks"]] == sorted((m["area"] for m in doc["masks"]), reverse=True)
    with Image.open(out) as img:
        labels = np.asarray(img)
    assert labels.shape == (HEIGHT, WIDTH) and labels.max() <= len(masks)
    for i, (mask, record) in enumerate(zip(masks, doc["masks"])):
        assert record["label"] == i + 1 and record["area"] == int(mask.sum())
        assert set(record) >= {"bbox", "predicted_iou", "stability_score", "point_coords", "crop_box"}
        assert mask[labels == i + 1].all()  # a label is only painted inside its mask
    assert (labels[masks[-1]] == len(masks)).all()  # the smallest mask is on top
    assert (tmp_path / "labels-overlay.png").is_file()


# ---- errors: one line, exit 2, nothing written ------------------------------------------------------


@pytest.mark.parametrize(
    "args,message",
    [
        (["--point", "10"], "--point expects X,Y"),
        (["--point", "a,b"], "--point expects X,Y"),
        (["--point", "1,2,3"], "--point expects X,Y"),
        (["--point", "nan,2"], "--point expects X,Y"),
        (["--box", "1,2,3"], "--box expects X0,Y0,X1,Y1"),
        (["--box", "30,2,10,20"], "X0 < X1"),
        (["--box", "1,2,3,4", "--box", "1,2,5,6"], "one box"),
        (["--point", "10,20", "--label", "2"], "--label must be 1"),
        (["--point", "10,20", "--label", "1", "--label", "0"], "one label per point"),
        (["--point", "37.5,10"], "outside the image"),
        (["--point", "10,51"], "outside the image"),
        (["--box", "0,0,38,20"], "outside the image"),
        (["--auto", "--point", "10,20"], "--auto segments everything by itself"),
        (["--auto", "--multimask"], "--multimask applies to"),
        ([], "no prompt given"),
        (["--point", "10,20", "--dtype", "int3"], "unknown dtype"),
        (["--point", "10,20", "--model", "sam-vit-b"], "not both"),
    ],
)
def test_prompt_and_flag_errors(files, tmp_path, capsys, args, message):
    out = tmp_path / "out.png"
    assert segment(files, *args, "-o", str(out)) == 2
    assert_one_line_error(capsys, message)
    assert list(tmp_path.iterdir()) == []


def assert_one_line_error(capsys, message: str) -> str:
    """The last stderr line is the error (progress lines may come before it)."""
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert last.startswith("genfast: error:") and err.count("genfast: error") == 1 and "Traceback" not in err, err
    assert message in last, err
    return last


def test_missing_and_unreadable_images(files, tmp_path, capsys, monkeypatch):
    from genfast.sam.recipe import RECIPE

    def plan(*args):  # planning may build a native kernel first: seconds before a bad path is named
        raise AssertionError("the recipe was planned before the image was checked")

    monkeypatch.setattr(RECIPE, "plan", plan)
    out = str(tmp_path / "out.png")
    base = ["segment", "--checkpoint", str(files["checkpoint"]), "--point", "1,1", "-o", out]
    assert main([*base, str(tmp_path / "nope.jpg")]) == 2
    assert_one_line_error(capsys, "does not exist")
    assert main([*base, str(files["bad_image"])]) == 2
    assert_one_line_error(capsys, "cannot read")
    assert main([*base, str(tmp_path)]) == 2  # a directory of images (or a video's frames): none here
    assert_one_line_error(capsys, "no images match")
    assert list(tmp_path.iterdir()) == []


def test_no_checkpoint_names_where_it_looked_and_the_pull_command(files, tmp_path, capsys):
    from genfast.storage.hub import sam_checkpoint_path

    argv = ["segment", str(files["image"]), "--point", "1,1", "-o", str(tmp_path / "o.png")]
    assert main(argv) == 2
    err = assert_one_line_error(capsys, "genfast pull sam-vit-b")
    assert str(sam_checkpoint_path("sam-vit-b")) in err and "no SAM checkpoint" in err
    assert main([*argv, "--model", "vit_h"]) == 2
    assert_one_line_error(capsys, "genfast pull sam-vit-h")
    assert main([*argv, "--model", "vit_q"]) == 2
    assert_one_line_error(capsys, "unknown SAM model 'vit_q'")
    assert main([*argv, "--checkpoint", str(tmp_path / "missing.pth")]) == 2
    assert_one_line_error(capsys, "does not exist")
    assert list(tmp_path.iterdir()) == []


def test_pulled_checkpoint_is_found_by_model_name(files, tmp_path):
    from genfast.storage.hub import sam_checkpoint_path

    cached = sam_checkpoint_path("sam-vit-b")
    cached.parent.mkdir(parents=True)
    cached.symlink_to(files["checkpoint"])  # architecture comes from the shapes, not the name
    out = tmp_path / "o.png"
    assert main(["segment", str(files["image"]), "--point", "1,1", "--model", "sam-vit-b", "-o", str(out)]) == 0
    assert out.is_file()


def test_existing_outputs_need_force_and_stay_untouched(files, tmp_path, capsys):
    out, overlay = tmp_path / "o.png", tmp_path / "o-overlay.png"
    overlay.write_bytes(b"keep me")
    assert segment(files, "--point", "1,1", "-o", str(out)) == 2
    assert_one_line_error(capsys, f"{overlay} already exists; pass --force")
    assert overlay.read_bytes() == b"keep me" and not out.exists()  # all or nothing
    assert segment(files, "--point", "1,1", "-o", str(out), "--force") == 0
    with Image.open(overlay) as img:
        assert img.size == (WIDTH, HEIGHT)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o-overlay.png", "o.png"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["-o", "{d}/missing-dir/o.png"], "does not exist"),
        (["-o", "{d}/o.png", "--overlay", "{d}/o.png"], "two different outputs"),
        (["-o", "{d}"], "is a directory"),
        (["--no-overlay"], "nothing to write"),
        (["-o", "{d}/o.png", "--overlay", "{d}/x.png", "--no-overlay"], "not both"),
        (["-o", "{d}/o.jpg"], "writes images as PNG; name it"),  # PNG bytes under a .jpg name
        (["-o", "{d}/o.png", "--overlay", "{d}/o.webp"], "writes images as PNG; name it"),
        (["-o", "/proc/o.png"], "/proc is not writable"),  # before any work, even for root
    ],
)
def test_output_path_errors(files, tmp_path, capsys, args, message):
    assert segment(files, "--point", "1,1", *[a.format(d=tmp_path) for a in args]) == 2
    assert_one_line_error(capsys, message)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("which", ["mask", "overlay", "json", "linked"])
def test_no_output_may_overwrite_the_input_image_even_with_force(files, tmp_path, capsys, which):
    image = tmp_path / "photo.png"
    image.write_bytes(files["image"].read_bytes())
    outputs = {
        "mask": ["-o", str(image)],
        "overlay": ["-o", str(tmp_path / "m.png"), "--overlay", str(image)],
        "json": ["-o", str(tmp_path / "m.png"), "--json", str(image)],
        "linked": ["-o", str(tmp_path / "link.png")],  # another name for the same file
    }[which]
    if which == "linked":
        (tmp_path / "link.png").symlink_to(image)
    args = ["segment", str(image), "--checkpoint", str(files["checkpoint"]), "--point", "1,1", *outputs, "--force"]
    assert main(args) == 2
    assert_one_line_error(capsys, "this command's input")
    assert image.read_bytes() == files["image"].read_bytes()
    expected = ["link.png", "photo.png"] if which == "linked" else ["photo.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == expected


def test_a_failed_write_leaves_nothing_behind(files, tmp_path, capsys, monkeypatch):
    real_replace, calls = images.os.replace, []

    def fail_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(images.os, "replace", fail_second)
    assert segment(files, "--point", "1,1", "-o", str(tmp_path / "o.png"), "--json", str(tmp_path / "o.json")) == 2
    assert_one_line_error(capsys, f"cannot write {calls[1]}: No space left on device")
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []


# ---- image loading ---------------------------------------------------------------------------------


def test_load_image_converts_modes_and_applies_exif_orientation(tmp_path):
    rgb = np.random.default_rng(0).integers(0, 256, (6, 4, 3), dtype=np.uint8)
    gray = rgb[..., 0]
    Image.fromarray(gray).save(tmp_path / "gray.png")
    assert np.array_equal(images.load_image(tmp_path / "gray.png"), np.repeat(gray[..., None], 3, axis=2))
    Image.fromarray(np.dstack([rgb, np.full((6, 4), 7, np.uint8)])).save(tmp_path / "rgba.png")
    assert np.array_equal(images.load_image(tmp_path / "rgba.png"), rgb)
    Image.fromarray(rgb).convert("P").save(tmp_path / "palette.png")
    with Image.open(tmp_path / "palette.png") as p:
        assert np.array_equal(images.load_image(tmp_path / "palette.png"), np.asarray(p.convert("RGB")))
    Image.fromarray(gray.astype(np.uint16) * 257).save(tmp_path / "gray16.png")
    assert np.array_equal(images.load_image(tmp_path / "gray16.png")[..., 0], gray)
    # Orientation 6: stored landscape, shown rotated 90 degrees clockwise.
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(rgb).save(tmp_path / "rotated.png", exif=exif)
    loaded = images.load_image(tmp_path / "rotated.png")
    assert loaded.shape == (4, 6, 3) and np.array_equal(loaded, np.rot90(rgb, k=-1))


def test_recipe_steps_on_the_command_line(files, predictor, tmp_path, capsys):
    """--recipe names the last step; the exact steps give the predictor's masks; a step that cannot
    run here, or that --dtype leaves out, is refused in one line with nothing written."""
    masks, scores, _ = predictor.predict(np.array([[10, 20]]), np.array([1]), multimask_output=True)
    for step in ("baseline", "sdpa"):
        out = tmp_path / f"{step}.png"
        assert segment(files, "--point", "10,20", "-o", str(out), "--no-overlay", "--recipe", step) == 0
        assert np.array_equal(read_mask(out), masks[int(np.argmax(scores))])
        assert f"recipe {step} in float32" in capsys.readouterr().err
    for step, message in (("sparse-2:4", "step sparse-2:4 cannot run here"), ("bf16", "--dtype float32")):
        out = tmp_path / "refused.png"
        assert segment(files, "--point", "10,20", "-o", str(out), "--recipe", step) == 2
        err = capsys.readouterr().err
        assert message in err and err.startswith("genfast: error:") and not out.exists()


def test_a_compiled_encoder_is_saved_by_the_first_run_and_loaded_by_the_next(files, predictor, tmp_path, capsys):
    """The first run shows that it compiles; the second loads what it saved; both give the eager masks."""
    masks, scores, _ = predictor.predict(np.array([[10, 20]]), np.array([1]), multimask_output=True)
    expected = masks[int(np.argmax(scores))]
    for run, says in ((1, "compiling the SAM image encoder"), (2, "loaded the compiled SAM image encoder")):
        saved_compile._READY.clear()  # as a new process: nothing compiled in memory
        out = tmp_path / f"run{run}.png"
        assert segment(files, "--point", "10,20", "-o", str(out), "--no-overlay", "--recipe", "compile") == 0
        err = capsys.readouterr().err
        assert says in err and "start-up: the model was first called" in err
        assert (read_mask(out) == expected).mean() > 0.995


@pytest.mark.alone
@needs_proc
def test_beside_busy_work_it_computes_on_fewer_threads_unless_told(files, predictor, tmp_path, capsys, monkeypatch):
    """Two busy loops keep more than a CPU busy while the model loads: the run leaves that CPU to
    them and says so, with the same masks; --threads keeps the count it is given."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    masks, scores, _ = predictor.predict(np.array([[10, 20]]), np.array([1]), multimask_output=True)
    with threads_restored() as default, busy_loop(count=2):
        chosen, told = tmp_path / "chosen.png", tmp_path / "told.png"
        assert segment(files, "--point", "10,20", "-o", str(chosen), "--no-overlay") == 0
        err = capsys.readouterr().err
        if default >= 2:
            assert "CPUs busy while the model loaded: computing on 1 thread, not" in err
            assert torch.get_num_threads() == 1
        torch.set_num_threads(default)
        assert segment(files, "--point", "10,20", "-o", str(told), "--no-overlay", "--threads", str(default)) == 0
        assert "CPUs busy" not in capsys.readouterr().err and torch.get_num_threads() == default
    for out in (chosen, told):
        assert np.array_equal(read_mask(out), masks[int(np.argmax(scores))])
