"""genfast.ImageGenerator on the tiny random SD 1.5 pipeline (2 steps, 32 x 32): the images are
`genfast imagine`'s, it pickles as its arguments, and as a Ray Data callable class a bad row
carries its reason without failing the batch."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from PIL import Image

import genfast
from genfast import cli
from genfast.diffusion.generator import ImageGenerator
from genfast.errors import UserError

SETTINGS = dict(random_weights=True, size="32x32", steps=2)
SMOKE = ["--model", "tiny-sd15", "--random-weights", "--size", "32x32", "--denoising-steps", "2"]


@pytest.fixture(scope="module")
def generator() -> ImageGenerator:
    return ImageGenerator("tiny-sd15", **SETTINGS)


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def test_the_images_are_those_of_genfast_imagine(generator, tmp_path):
    prompts = ["a red square", "a blue circle"]
    images = generator.generate(prompts, seed=3)  # prompt i gets seed 3 + i
    shaded = generator.generate(prompts[0], seed=3, negative="green")
    for index, prompt in enumerate(prompts):
        out = tmp_path / f"{index}.png"
        assert cli.main(["imagine", prompt, *SMOKE, "--seed", str(3 + index), "-o", str(out)]) == 0
        with Image.open(out) as img:
            assert np.array_equal(pixels(img), pixels(images[index]))
    assert (
        cli.main(["imagine", prompts[0], *SMOKE, "--seed", "3", "--negative", "green", "-o", str(tmp_path / "n.png")])
        == 0
    )
    with Image.open(tmp_path / "n.png") as img:
        assert np.array_equal(pixels(img), pixels(shaded[0])) and img.text["genfast:negative"] == "green"
    assert not np.array_equal(pixels(images[0]), pixels(shaded[0]))  # the negative prompt was used


def test_batched_prompts_are_the_single_prompt_images_up_to_rounding(generator):
    prompts = ["a red square", "a blue circle", "a green line"]
    batched = ImageGenerator("tiny-sd15", **SETTINGS, batch_size=3).generate(prompts, seed=[7, 8, 9])
    alone = generator.generate(prompts, seed=[7, 8, 9])
    for a, b in zip(alone, batched, strict=True):
        assert np.abs(pixels(a) - pixels(b)).max() <= 2
    assert not np.array_equal(pixels(alone[0]), pixels(alone[1]))  # each prompt its own image


def test_it_pickles_as_its_arguments_and_is_rebuilt_where_unpickled(generator):
    data = pickle.dumps(generator)
    assert len(data) < 1000  # the arguments, not the pipeline's weights
    copy = pickle.loads(data)
    assert copy.pipe is not generator.pipe
    [a], [b] = generator.generate("x", seed=1), copy.generate("x", seed=1)
    assert np.array_equal(pixels(a), pixels(b))


def test_it_is_exported_lazily_as_genfast_image_generator():
    assert genfast.ImageGenerator is ImageGenerator


def test_a_bad_prompt_is_refused_by_its_index_before_any_runs(generator):
    with pytest.raises(UserError, match="prompt 1: the prompt is empty"):
        generator.generate(["fine", "  "], seed=0)
    with pytest.raises(UserError, match="prompt 0: the seed must be a whole number"):
        generator.generate(["fine"], seed=[-1])


def test_a_long_prompt_is_cut_where_the_text_encoder_stops_and_said_so(generator):
    """The tiny tokenizer takes a token a byte (spaces split words) and CLIP reads 77 tokens, its
    start and end among them: two prompts that differ only past that draw the same image."""
    long = "stripes " * 20
    assert generator.truncation("a cat") is None
    assert "145 tokens, of which the text encoder reads 77" in generator.truncation(long + "cat")
    cat, dog = generator.generate([long + "cat", long + "dog"], seed=[4, 4])
    assert np.array_equal(pixels(cat), pixels(dog))


def test_as_a_ray_data_callable_a_bad_row_carries_its_reason(generator):
    batch = {
        "prompt": np.array(["a red square", "", "a blue circle", "x"], dtype=object),
        "seed": np.array([3, 1, np.nan, -2]),  # NaN: a row without a seed (a column with gaps is float)
        "negative_prompt": np.array([None, None, "green", None], dtype=object),
        "id": np.array(["a", "b", "c", "d"]),
    }
    out = generator(batch)
    assert list(out["id"]) == ["a", "b", "c", "d"]  # other columns pass through
    assert out["image"].shape == (4, 32, 32, 3) and out["image"].dtype == np.uint8
    assert out["error"][0] is None and out["error"][2] is None
    assert out["error"][1] == "row 1: the prompt is empty: nothing to draw"
    assert out["error"][3].startswith("row 3: the seed must be a whole number")
    assert not out["image"][1].any() and not out["image"][3].any()  # black where there is no image
    [first] = generator.generate("a red square", seed=3)
    assert np.array_equal(out["image"][0], pixels(first))
    random_seed = int(out["seed"][2])  # drawn, and reported
    [third] = generator.generate("a blue circle", seed=random_seed, negative="green")
    assert np.array_equal(out["image"][2], pixels(third))
    assert '"genfast:negative": "green"' in out["settings"][2] and out["warning"][0] is None
