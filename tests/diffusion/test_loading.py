"""--quant int8: transformers quantized as they are loaded in parts (genfast/diffusion/loading.py)
and the memory check before loading (genfast/diffusion/memory.py), on tiny Flux and SD3
pipelines saved with their transformer in many safetensors shards."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

pytest.importorskip("diffusers")

from genfast import cli
from genfast.diffusion import loading
from genfast.diffusion.generator import ImageGenerator, check_memory, load
from genfast.diffusion.pipelines import initial_latents, tiny_pipeline
from genfast.diffusion.quality import psnr
from genfast.diffusion.recipe import RECIPE, apply_recipe
from genfast.errors import UserError
from genfast.platform import hardware
from genfast.quant.linear import QuantLinear
from genfast.recipe import Target

CPU = torch.device("cpu")
# The transformer's int8 weights are the dynamic-int8 step's, bit for bit; the image differs by the
# text encoders' weight-only int8 alone: measured 65 dB (Flux) and 45 dB (SD3) at 32x32, every linear
# quantized (the dynamic-int8 step against fp32: 62 and 46 dB).
QUANT_PSNR = 40.0
SHARD = "40KB"  # a tiny transformer (~0.5 MB in fp32) in a dozen shards


@pytest.fixture(scope="module", params=["flux", "sd3"])
def saved(request, tmp_path_factory):
    """(arch, directory) of a tiny pipeline saved by diffusers, its transformer in many shards."""
    directory = tmp_path_factory.mktemp(request.param)
    pipe = tiny_pipeline(request.param)
    pipe.save_pretrained(directory)
    pipe.transformer.save_pretrained(directory / "transformer", max_shard_size=SHARD)
    assert len(list((directory / "transformer").glob("*.safetensors"))) > 3
    return request.param, directory


def generate(pipe, steps: int = 3) -> torch.Tensor:
    return pipe(
        "a red cat", num_inference_steps=steps, height=32, width=32, latents=initial_latents(pipe, 32, 32, seed=0),
        generator=torch.Generator().manual_seed(0), output_type="pt",
    ).images.float()  # fmt: skip


def float_block_bytes(model: torch.nn.Module) -> int:
    """Bytes of the floating-point weights allocated in the model's repeated blocks (meta: not yet)."""
    return sum(
        p.numel() * p.element_size()
        for _, blocks in loading.block_lists(model)
        for p in blocks.parameters()
        if not p.is_meta and p.dim() == 2
    )


def largest_block_bytes(model: torch.nn.Module) -> int:
    return max(
        sum(p.numel() * p.element_size() for p in block.parameters() if p.dim() == 2)
        for _, blocks in loading.block_lists(model)
        for block in blocks
    )


def test_int8_load_is_the_dynamic_int8_step_and_its_image(saved):
    arch, directory = saved
    pipe, _ = load(str(directory), False, torch.float32, CPU, "int8", min_features=1)
    settings = replace(RECIPE.plan("dynamic-int8", Target(CPU, "float32")).settings, compile="none",
                       int8_min_features=1, fuse_qkv=False)  # fmt: skip
    reference = apply_recipe(tiny_pipeline(arch), settings)
    ours = {n: m for n, m in pipe.transformer.named_modules() if isinstance(m, QuantLinear)}
    theirs = {n: m for n, m in reference.transformer.named_modules() if isinstance(m, QuantLinear)}
    assert ours.keys() == theirs.keys() and ours  # every linear, as the step quantizes them
    for name, layer in ours.items():
        assert layer.dynamic and torch.equal(layer.packed, theirs[name].packed), name
    assert not any(isinstance(m, torch.nn.Linear) for m in pipe.transformer.modules())
    encoder_linears = [m for m in pipe.text_encoder.modules() if isinstance(m, (torch.nn.Linear, QuantLinear))]
    assert all(isinstance(m, QuantLinear) and not m.dynamic for m in encoder_linears)
    # the recipe's own step then changes nothing
    packed = {n: m.packed.clone() for n, m in ours.items()}
    apply_recipe(pipe, settings)
    assert all(torch.equal(m.packed, packed[n]) for n, m in ours.items())
    assert psnr(generate(pipe), generate(reference)) >= QUANT_PSNR


def float_bytes_spy(model: torch.nn.Module, quantize: bool) -> tuple[list[int], Callable[[str, torch.nn.Module], None]]:
    """A `prepare` hook for load_in_parts that records the model's float block bytes after each
    block is filled (and int8-quantizes the part, as the loader's own hook does, with `quantize`)."""
    seen: list[int] = []
    int8 = loading.int8_prepare(1)

    def spy(prefix: str, part: torch.nn.Module) -> None:
        if prefix:
            seen.append(float_block_bytes(model))
        if quantize:
            int8(prefix, part)

    return seen, spy


@pytest.mark.parametrize("quantize", [True, False])
def test_at_most_one_block_of_float_weights_exists_while_loading(saved, quantize):
    """The check can fail: loaded without quantizing, the float blocks pile up."""
    _, directory = saved
    cls, config = loading.transformer_spec(directory)
    model = loading.empty_model(cls, config, torch.float32)
    seen, spy = float_bytes_spy(model, quantize)
    weights = loading.SafetensorsWeights(directory / "transformer")
    loading.load_in_parts(model, weights.fill, CPU, spy)
    weights.check_all_read()
    one_block = largest_block_bytes(loading.empty_model(cls, config, torch.float32))
    assert len(seen) == sum(len(blocks) for _, blocks in loading.block_lists(model))
    assert (max(seen) <= one_block) == quantize


def test_a_checkpoint_that_disagrees_with_its_config_is_refused(saved, tmp_path):
    _, directory = saved
    cls, config = loading.transformer_spec(directory)
    weights = loading.SafetensorsWeights(directory / "transformer")
    weights.files.pop(next(iter(weights.files)))
    with pytest.raises(UserError, match="lacks tensor"):
        loading.load_in_parts(loading.empty_model(cls, config, torch.float32), weights.fill, CPU)


def test_random_weights_are_drawn_block_by_block_and_quantized_as_drawn(saved):
    _, directory = saved
    cls, config = loading.transformer_spec(directory)
    int8 = loading.int8_prepare(1)
    # random_transformer's own path, with the model held for the spy
    model = loading.empty_model(cls, config, torch.float32)
    seen, spy = float_bytes_spy(model, quantize=True)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        loading.load_in_parts(model, loading.fill_random, CPU, spy)
    assert max(seen) <= largest_block_bytes(loading.empty_model(cls, config, torch.float32))
    again = loading.random_transformer(cls, config, torch.float32, CPU, 3, int8)
    other = loading.random_transformer(cls, config, torch.float32, CPU, 4, int8)
    packed = [{n: m.packed for n, m in t.named_modules() if isinstance(m, QuantLinear)} for t in (model, again, other)]
    assert packed[0].keys() == packed[1].keys() and all(torch.equal(packed[0][n], packed[1][n]) for n in packed[0])
    assert not all(torch.equal(packed[0][n], packed[2][n]) for n in packed[0])  # the seed decides
    assert all(torch.isfinite(t).all() for t in model.state_dict().values() if t.is_floating_point())


def test_too_little_memory_is_refused_before_loading_with_the_number_needed(saved):
    _, directory = saved
    args = (str(directory), False, torch.float32, CPU)
    check_memory(*args, "none", 320, 32 * 32, available=2**40)
    with pytest.raises(UserError, match=r"needs ~\d+\.\d GiB .*GiB available: try --quant int8"):
        check_memory(*args, "none", 320, 32 * 32, available=2**28)
    with pytest.raises(UserError, match=r"in int8.*free memory"):
        check_memory(*args, "int8", 320, 32 * 32, available=2**20)


def test_a_hub_id_is_downloaded_then_checked_and_loaded_in_parts(saved, monkeypatch, capsys):
    """A hub id is fetched first (diffusers' DiffusionPipeline.download, here a saved directory
    standing in for the hub cache); its directory is then checked against memory and loaded in
    parts like a local one, and the pipeline is named by the hub id. Unreachable: one line."""
    import diffusers

    arch, directory = saved
    asked: list[str] = []

    def download(cls, hub_id: str, **kwargs) -> str:
        asked.append(hub_id)
        return str(directory)

    monkeypatch.setattr(diffusers.DiffusionPipeline, "download", classmethod(download))
    in_parts: list[str] = []
    load_transformer = loading.load_transformer
    monkeypatch.setattr(
        loading, "load_transformer", lambda path, *args: in_parts.append(str(path)) or load_transformer(path, *args)
    )
    hub_id = f"someone/tiny-{arch}"
    generator = ImageGenerator(hub_id, quant="int8", dtype="float32", steps=1, size=(32, 32))
    assert asked == [hub_id] and in_parts == [str(directory)] and generator.description == hub_id
    assert generator.generate("a cat", seed=0)[0].size == (32, 32)
    monkeypatch.setattr(hardware, "available_memory_bytes", lambda device: 2**20)
    with pytest.raises(UserError, match=r"in int8.*free memory"):
        ImageGenerator(hub_id, quant="int8", dtype="float32", steps=1)

    def offline(cls, hub_id: str, **kwargs) -> str:
        raise OSError(f"Cannot load model {hub_id}: the model is not fully cached locally\nmore")

    monkeypatch.setattr(diffusers.DiffusionPipeline, "download", classmethod(offline))
    out = directory.parent / f"{arch}-offline.png"
    assert cli.main(["imagine", "x", "--model", hub_id, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"could not download hub id '{hub_id}' (is the hub reachable?): Cannot load model {hub_id}" in err
    assert "more" not in err and "Traceback" not in err and not out.exists()


def test_the_estimate_counts_int8_and_one_block_at_full_size():
    """FLUX.1-schnell's published configs: 11.9 G transformer parameters, ~1 byte each in int8."""
    from genfast.diffusion.memory import GIB, estimate
    from genfast.diffusion.transformer_archs import empty_models

    models = empty_models("flux-schnell")
    whole, int8 = (estimate(models, torch.bfloat16, q, 320, 512 * 512) for q in ("none", "int8"))
    assert int8.transformer < 0.55 * whole.transformer  # int8 codes, the narrow linears and norms in bf16
    assert int8.text_encoders < 0.7 * whole.text_encoders  # T5's wo stays bf16
    assert int8.peak < whole.peak and whole.peak > 2 * GIB


def test_imagine_refuses_with_the_gib_it_needs(saved, tmp_path, monkeypatch, capsys):
    _, directory = saved
    monkeypatch.setattr(hardware, "available_memory_bytes", lambda device: 2**28)
    output = str(tmp_path / "a.png")
    code = cli.main(["imagine", "a cat", "--model", str(directory), "--dtype", "float32", "-o", output])
    assert code != 0 and not (tmp_path / "a.png").exists()
    err = capsys.readouterr().err
    assert "GiB available: try --quant int8" in err and "needs ~" in err


def test_generator_with_int8_leaves_fused_qkv_out_and_draws():
    """Declined (the user's --quant leaves it out): refused by name, left out of a longer recipe."""
    with pytest.raises(UserError, match=r"fused-qkv cannot run here.*--quant int8"):
        ImageGenerator("tiny-flux", random_weights=True, quant="int8", recipe="fused-qkv", steps=1)
    generator = ImageGenerator("tiny-flux", random_weights=True, quant="int8", recipe="conv1x1-linear",
                               dtype="float32", steps=2, size=(32, 32))  # fmt: skip
    assert generator.settings.fuse_qkv is False
    [image] = generator.generate("a cat", seed=0)
    assert image.size == (32, 32)


def test_quant_is_refused_for_unet_pipelines_and_unknown_modes():
    with pytest.raises(UserError, match="UNet"):
        ImageGenerator("tiny-sd15", random_weights=True, quant="int8", steps=1)
    with pytest.raises(UserError, match="unknown --quant"):
        ImageGenerator("tiny-flux", random_weights=True, quant="int4", steps=1)


def test_a_transformer_with_computed_buffers_is_refused(tmp_path):
    """PixArt's position table is computed when the model is built: loading in parts would leave it empty."""
    pipe = tiny_pipeline("pixart")
    pipe.save_pretrained(tmp_path)
    with pytest.raises(UserError, match=r"computes buffers.*without --quant"):
        load(str(tmp_path), False, torch.float32, CPU, "int8")
