"""genfast.ray.diffusion on a two-node Ray cluster: `genfast imagine --prompts --ray` writes the
PNGs the single-process run writes (the same names, pixels and metadata), skips those already
there, names bad items, and loses no image when a worker is killed midway (its rows are drawn again).

Pixel for pixel, not byte for byte: the PNG's compressed bytes are zlib's, which may differ from
node to node, and the image is what the run promises. One prompt a pipeline call (--batch-size 1)
on both sides: a batched matrix product adds in another order, and Ray Data groups rows into
batches its own way, so larger batches agree only up to rounding (tests/diffusion/test_generator.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from genfast import cli
from genfast.diffusion.generator import ImageGenerator
from tests.ray.workers import run_killing_a_worker

SMOKE = ["--model", "tiny-sd15", "--random-weights", "--size", "32x32", "--denoising-steps", "2", "--seed", "5"]


def contents(folder: Path) -> dict[str, tuple[np.ndarray, dict]]:
    found = {}
    for path in sorted(folder.iterdir()):
        with Image.open(path) as img:
            found[path.name] = (np.asarray(img), dict(img.text))
    return found


def test_the_pngs_are_the_single_process_runs(ray_cluster, tmp_path, capsys):
    records = [{"id": f"p{i}", "prompt": f"a shape number {i}"} for i in range(6)]
    records[2]["seed"] = 123
    records[3]["negative"] = "green"
    records[4]["prompt"] = ""  # a bad item, named
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    alone, on_ray = tmp_path / "alone", tmp_path / "ray"
    assert cli.main(["imagine", "--prompts", str(source), "-o", str(alone), *SMOKE]) == 1
    capsys.readouterr()
    on_ray.mkdir()
    (on_ray / "p5.png").write_bytes((alone / "p5.png").read_bytes())  # done before: skipped
    command = [sys.executable, "-m", "genfast", "imagine", "--prompts", str(source), "-o", str(on_ray), *SMOKE,
               "--ray", ray_cluster, "--actors", "2"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # the bad item
    assert "line 5: id 'p4': the prompt is empty" in done.stderr
    assert "done 4, skipped 1 (already in the output), failed 1 on Ray" in done.stderr
    got, want = contents(on_ray), contents(alone)
    assert sorted(got) == ["p0.png", "p1.png", "p2.png", "p3.png", "p5.png"] == sorted(want)
    for name, (image, text) in want.items():
        assert np.array_equal(got[name][0], image), name
        assert got[name][1] == text, name
    assert got["p2.png"][1]["genfast:seed"] == "123" and got["p3.png"][1]["genfast:negative"] == "green"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds Ray's worker processes in /proc")
def test_a_killed_worker_loses_no_image(ray_cluster, tmp_path):
    n = 24
    source = tmp_path / "prompts.txt"
    source.write_text("".join(f"shape {i}\n" for i in range(n)))
    outdir = tmp_path / "ray"
    slow = [*SMOKE[:-4], "--denoising-steps", "12", "--seed", "5"]  # each image long enough to kill midway
    command = [sys.executable, "-m", "genfast", "imagine", "--prompts", str(source), "-o", str(outdir), *slow,
               "--ray", ray_cluster, "--actors", "2"]  # fmt: skip
    pngs = lambda: list(outdir.glob("*.png"))  # noqa: E731
    status, err, written_before = run_killing_a_worker(
        command, "ImageGenerator", lambda: bool(pngs()), lambda: len(pngs())
    )
    assert status == 0, err
    assert written_before < n  # the kill came before the end
    assert f"done {n}, skipped 0" in err
    assert sorted(p.name for p in outdir.iterdir()) == [f"{i:05d}.png" for i in range(1, n + 1)]  # no temporaries
    generator = ImageGenerator("tiny-sd15", random_weights=True, size="32x32", steps=12, threads=1)
    for i in (0, n // 2, n - 1):
        [want] = generator.generate(f"shape {i}", seed=5 + i)
        with Image.open(outdir / f"{i + 1:05d}.png") as got:
            assert np.array_equal(np.asarray(got), np.asarray(want)), i
