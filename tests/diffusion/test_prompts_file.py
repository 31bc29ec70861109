"""`genfast imagine --prompts FILE -o OUTDIR` on the tiny random SD 1.5 pipeline (2 steps, 32 x
32): a PNG per prompt named by its line or id, `genfast imagine`'s image for the item's seed; a
re-run skips what is there; bad items are named and the rest drawn; a killed run leaves whole
PNGs only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

from genfast import cli

SMOKE = ["--model", "tiny-sd15", "--random-weights", "--size", "32x32", "--denoising-steps", "2"]


def imagine_file(prompts: Path, outdir: Path, *extra: str) -> int:
    return cli.main(["imagine", "--prompts", str(prompts), "-o", str(outdir), *SMOKE, *extra])


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img)


def test_a_png_per_line_with_genfast_imagines_image_for_its_seed(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\na blue circle\na green line\n")
    assert imagine_file(prompts, tmp_path / "out", "--seed", "10", "--batch-size", "2") == 0
    err = capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["00001.png", "00002.png", "00003.png"]
    assert "images 3/3 (" in err and "done 3, skipped 0 (already in the output), failed 0" in err
    with Image.open(tmp_path / "out" / "00002.png") as img:
        assert img.text["genfast:prompt"] == "a blue circle" and img.text["genfast:seed"] == "11"
    assert cli.main(["imagine", "a green line", *SMOKE, "--seed", "12", "-o", str(tmp_path / "one.png")]) == 0
    # Line 3 was drawn alone (the last of batches of 2): exactly the single-prompt image.
    assert np.array_equal(pixels(tmp_path / "out" / "00003.png"), pixels(tmp_path / "one.png"))


def test_a_rerun_skips_what_is_done_and_draws_what_is_missing_alike(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    records = [{"id": "cat", "prompt": "a cat"}, {"id": 7, "prompt": "a dog", "seed": 99}, {"id": "c", "prompt": "x"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    assert imagine_file(prompts, out) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(first) == ["7.png", "c.png", "cat.png"]
    with Image.open(out / "7.png") as img:
        assert img.text["genfast:seed"] == "99"
    with Image.open(out / "c.png") as img:
        assert img.text["genfast:seed"] == "2"  # no seed of its own: --seed's 0 plus its line less one
    capsys.readouterr()
    (out / "7.png").unlink()
    stamp = (out / "cat.png").stat().st_mtime_ns
    assert imagine_file(prompts, out) == 0
    assert "done 1, skipped 2" in capsys.readouterr().err
    assert (out / "cat.png").stat().st_mtime_ns == stamp
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first  # the same image again
    assert imagine_file(prompts, out) == 0
    assert "done 0, skipped 3" in capsys.readouterr().err


def test_bad_items_are_named_and_the_rest_drawn(tmp_path, capsys):
    lines = [
        json.dumps({"id": "ok", "prompt": "a cat"}),
        '{"id": "broken", "prompt": "a cat"',  # not JSON
        json.dumps({"id": "empty", "prompt": "   "}),
        json.dumps({"id": "negative-seed", "prompt": "a cat", "seed": -1}),
        json.dumps({"id": "text-seed", "prompt": "a cat", "seed": "7"}),
        json.dumps({"id": "../escape", "prompt": "a cat"}),
        json.dumps({"id": ".hidden", "prompt": "a cat"}),
        json.dumps({"id": "OK", "prompt": "a dog"}),  # ok.png on a case-insensitive disk
        json.dumps({"id": "size", "prompt": "a cat", "steps": 3}),
        json.dumps({"id": "long", "prompt": "stripes " * 20}),
        json.dumps({"id": "none"}),
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    assert imagine_file(prompts, tmp_path / "out") == 1
    err = capsys.readouterr().err
    for message in (
        "line 2: not JSON (Expecting ',' delimiter",
        "line 3: id 'empty': the prompt is empty: nothing to draw",
        "line 4: id 'negative-seed': the seed must be a whole number from 0",
        "line 5: id 'text-seed': the seed must be a whole number",
        "line 6: id '../escape' cannot name a file",
        "line 7: id '.hidden' cannot name a file",
        "line 8: id 'OK' repeats line 1's",
        "line 9: unknown fields steps",
        "warning: line 10: id 'long': the prompt is 142 tokens, of which the text encoder reads 77",
        "line 11: id 'none': no prompt",
        "done 2, skipped 0 (already in the output), failed 9",
    ):
        assert message in err, message
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["long.png", "ok.png"]


def test_an_empty_line_of_a_text_file_is_a_bad_item(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n\na dog\n")
    assert imagine_file(prompts, tmp_path / "out") == 1
    assert "line 2: id '00002': the prompt is empty" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["00001.png", "00003.png"]


def test_flags_that_do_not_go_with_a_prompts_file(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    (tmp_path / "file").write_text("")
    as_json = tmp_path / "p.json"
    as_json.write_text('{"id": 1, "prompt": "a cat"}\n')
    for argv, message in (
        (["a dog", "--prompts", str(prompts), "-o", str(tmp_path)], "drop the prompt argument"),
        (["--prompts", str(prompts)], "needs -o OUTDIR"),
        (["--prompts", str(tmp_path / "none.txt"), "-o", str(tmp_path)], "prompts file not found"),
        (["--prompts", str(prompts), "-o", str(tmp_path / "file")], "exists and is not a folder"),
        (["--prompts", str(as_json), "-o", str(tmp_path)], "or .jsonl (an object a line): rename it"),
        (["--ray", "-o", str(tmp_path / "x.png"), "a dog"], "--ray draws a file of prompts"),
    ):
        assert cli.main(["imagine", *argv, *SMOKE]) == 2
        assert message in capsys.readouterr().err


def test_a_killed_run_leaves_whole_pngs_and_a_rerun_finishes(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(40)))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "genfast", "imagine", "--prompts", str(prompts), "-o", str(out), *SMOKE]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not out.is_dir() or len(list(out.glob("*.png"))) < 2:
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "no image within two minutes"
            time.sleep(0.01)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    written = sorted(out.glob("*.png"))
    assert 2 <= len(written) < 40
    for path in written:
        with Image.open(path) as img:
            img.load()  # a cut file would not decode
            assert img.size == (32, 32)
    # What a kill during a write leaves (the moment is too short to hit reliably), beside a file of
    # the user's that looks alike and must stay.
    (out / ".00040.png.k3_x9abz.tmp").write_bytes(b"\x89PNG cut")
    (out / ".00040.png.notes.tmp").write_text("mine")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"done {40 - len(written)}, skipped {len(written)}" in done.stderr
    assert sorted(p.name for p in out.iterdir()) == [".00040.png.notes.tmp"] + [f"{i:05d}.png" for i in range(1, 41)]
