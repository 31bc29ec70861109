"""Each step of the SAM recipe applied to SAM 2 (genfast/sam/recipe.py), against the fp32 baseline
(which equals the official package: test_modeling.py, test_predictor.py), within the budget the
recipe states: bf16 and the steps after it 5% of the low-res logits and mask IoU 0.95; dynamic int8
10% and 0.9.

Two models: the tiny test config, and one as tiny but 32 wide with two heads, whose head dim (16)
the native attention kernel takes and whose last stage (256 wide) the int8 filter quantizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genfast.compilation.saved import SavedForward
from genfast.platform import hardware
from genfast.quant.linear import QuantLinear
from genfast.recipe import Target
from genfast.sam.recipe import RECIPE, SamSettings, apply_recipe
from genfast.sam.sam2.build import build_random_sam2
from genfast.sam.sam2.config import Sam2Config, tiny_sam2_config
from genfast.sam.sam2.predictor import SAM2ImagePredictor
from tests.cpus import XEON_WITHOUT_AMX, ZEN4, pretend_cpu

CONFIGS = {
    "tiny": tiny_sam2_config(),
    "tiny-wide": tiny_sam2_config(embed_dim=32, num_heads=2, name="tiny-wide"),
}
BUDGETS = {  # step: (max relative error of the low-res logits, min mask IoU), as RECIPE states
    "bf16": (0.05, 0.95),
    "sdpa": (0.05, 0.95),
    "fused-attention": (0.05, 0.95),
    "batched-prompts": (0.05, 0.95),
    "dynamic-int8": (0.10, 0.95),
}


def settings_for(step: str, compile: bool = False) -> SamSettings:
    """The recipe's settings at `step` on a CPU with native bf16 (the steps after compile run
    eagerly unless asked: compiling is tested once, below)."""
    settings = RECIPE.plan(step, Target(torch.device("cpu"), "bfloat16")).settings
    return SamSettings(**{**settings.__dict__, "compile": compile and settings.compile})


def _images() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:96, 0:80]
    smooth = np.stack([x * 3, y * 2, (x + y) * 1.5], axis=2)
    return [(smooth + rng.integers(0, 40, smooth.shape) * k).clip(0, 255).astype(np.uint8) for k in (1, 2, 3)]


def _prompt(i: int) -> dict[str, np.ndarray]:
    return {"point_coords": np.array([[20.0 + 10 * i, 30.0]]), "point_labels": np.array([1])}


def _run(config: Sam2Config, settings: SamSettings) -> list[np.ndarray]:
    return _predict(apply_recipe(build_random_sam2(config), settings), settings.batched_prompts)


def _predict(model: torch.nn.Module, batched: bool = False) -> list[np.ndarray]:
    """The low-res logits of one point prompt on each image, through the predictor as the bench
    calls it (batched prompts: one set_image_batch and predict_batch)."""
    predictor = SAM2ImagePredictor(model)
    images = _images()
    if batched:
        predictor.set_image_batch(images)
        prompts = [_prompt(i) for i in range(len(images))]
        _, _, low_res = predictor.predict_batch(
            [p["point_coords"] for p in prompts], [p["point_labels"] for p in prompts], multimask_output=False
        )
        return [logits[0] for logits in low_res]
    outputs = []
    for i, image in enumerate(images):
        predictor.set_image(image)
        outputs.append(predictor.predict(**_prompt(i), multimask_output=False)[2][0])
    return outputs


def error_and_iou(logits: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """Relative error of low-res logits, and the IoU of both thresholded at the reference's median:
    random weights put most logits on one side of 0, so half-full masks test the whole field."""
    error = np.linalg.norm(logits - reference) / np.linalg.norm(reference)
    threshold = np.median(reference)
    mask, base = logits > threshold, reference > threshold
    return float(error), float(np.logical_and(mask, base).sum() / np.logical_or(mask, base).sum())


@pytest.fixture(scope="module")
def baselines() -> dict[str, list[np.ndarray]]:
    return {name: _run(config, settings_for("baseline")) for name, config in CONFIGS.items()}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("step", list(BUDGETS))
def test_step_stays_within_its_budget(step: str, config: str, baselines) -> None:
    max_err, min_iou = BUDGETS[step]
    for logits, reference in zip(_run(CONFIGS[config], settings_for(step)), baselines[config]):
        err, iou = error_and_iou(logits, reference)
        assert err <= max_err and iou >= min_iou, (err, iou)


def test_dynamic_int8_quantizes_the_wide_stage() -> None:
    """The int8 filter (min(in, out) >= 192) takes the tiny-wide model's last stage (one block,
    256 wide) but its qkv, which reads the 128-wide stream before the block pools it."""
    model = apply_recipe(build_random_sam2(CONFIGS["tiny-wide"]), settings_for("dynamic-int8"))
    names = [name for name, m in model.image_encoder.named_modules() if isinstance(m, QuantLinear)]
    assert names == ["trunk.blocks.5.attn.proj", "trunk.blocks.5.mlp.layers.0", "trunk.blocks.5.mlp.layers.1"]


@pytest.mark.parametrize("fast_bf16", [True, False])
def test_dynamic_int8_attention_in_the_global_blocks_only(monkeypatch, fast_bf16) -> None:
    """The step asks the attention kernel for both products on int8 codes in Hiera's global blocks
    (the tiny-wide model's block 4: one [1, heads, 64, 16] call per image) and nowhere else (the
    windowed blocks' calls have one entry per window), where the kernel has them (AVX-512); in the
    windows too where its bf16 products are slower than fp32 ones (`hardware.fast_bf16_dot_products`:
    Intel). The logits stay within the step's budget (test_step_stays_within_its_budget and
    test_steps_stay_within_their_budgets_where_bf16_products_are_slow). A CPU without AMX: with
    it, SDPA computes these attentions (test_encoder_parts.py)."""
    from genfast.kernels.rel_pos_attention import ops as kernel

    if kernel.unavailable_reason() is not None or not kernel.has_int8_products():
        pytest.skip("no int8 products in this CPU's attention kernel (AVX-512 VNNI)")
    cpu = (ZEN4, "AuthenticAMD") if fast_bf16 else (XEON_WITHOUT_AMX, "GenuineIntel")
    pretend_cpu(monkeypatch, cpu[0], hardware.isa_override(), cpu[1])
    model = apply_recipe(build_random_sam2(CONFIGS["tiny-wide"]), settings_for("dynamic-int8"))
    calls = []  # (q's batch: 1 for a global block, the window count for a windowed one; int8 scores, values asked)
    attention = kernel.attention

    def spy(*args):
        calls.append((args[0].shape[0], args[4], args[5]))
        return attention(*args)

    monkeypatch.setattr(kernel, "attention", spy)
    predictor = SAM2ImagePredictor(model)
    predictor.set_image(_images()[0])
    windows = not fast_bf16
    assert sorted(set(calls)) == [(1, True, True), (4, windows, windows), (16, windows, windows)], calls


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("step", ["bf16", "fused-attention", "dynamic-int8"])
def test_steps_stay_within_their_budgets_where_bf16_products_are_slow(step, config, baselines, monkeypatch) -> None:
    """On a CPU whose bf16 products are slower than its fp32 ones (an Intel Xeon without AMX), the
    encoder's floating-point linears multiply in fp32, the attention kernel too, and dynamic int8
    takes the windows' attention to int8: each step within the budget it has elsewhere."""
    pretend_cpu(monkeypatch, XEON_WITHOUT_AMX, hardware.isa_override(), "GenuineIntel")
    max_err, min_iou = BUDGETS[step]
    for logits, reference in zip(_run(CONFIGS[config], settings_for(step)), baselines[config]):
        err, iou = error_and_iou(logits, reference)
        assert err <= max_err and iou >= min_iou, (err, iou)


def test_compile_step_rewrites_the_model_before_compiling() -> None:
    """The compile step folds the decoder's fine-level projections into the neck and makes the
    trunk's position embedding once (both checked against the official model in test_modeling.py);
    without it neither happens. Nothing is compiled here: that waits for the first call."""
    config = CONFIGS["tiny"]
    rewritten = apply_recipe(build_random_sam2(config), settings_for("compile", compile=True))
    plain = apply_recipe(build_random_sam2(config), settings_for("compile"))
    for model, applied in ((rewritten, True), (plain, False)):
        decoder, trunk = model.sam_mask_decoder, model.image_encoder.trunk
        assert isinstance(decoder.conv_s0, torch.nn.Identity) is applied
        assert isinstance(decoder.conv_s1, torch.nn.Identity) is applied
        assert (trunk.precomputed_position is not None) is applied


@pytest.mark.slow
def test_compile_step_matches_eager_without_recompiling() -> None:
    """The compile step (fullgraph: a graph break fails) on the tiny-wide model: within the bf16
    budget of the baseline, as close to the eager bf16 encoder as bf16 allows, and one graph for
    repeated images of one size. (~40 s on two cores.)"""
    config = CONFIGS["tiny-wide"]
    settings = settings_for("compile", compile=True)
    compiled = apply_recipe(build_random_sam2(config), settings)
    assert isinstance(vars(compiled.image_encoder)["forward"], SavedForward)
    eager = apply_recipe(build_random_sam2(config), settings_for("compile"))
    images = torch.randn(2, 3, config.image_size, config.image_size, generator=torch.Generator().manual_seed(0))
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        for image in images:
            batch = image[None].bfloat16()
            expected, _ = eager.forward_image(batch)
            actual, _ = compiled.forward_image(batch)
            for a, e in zip(actual, expected):
                assert (a.float() - e.float()).abs().max() <= 0.05 * e.float().abs().max()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    max_err, min_iou = BUDGETS["bf16"]
    baseline = _run(config, settings_for("baseline"))
    for logits, reference in zip(_predict(compiled), baseline):
        err, iou = error_and_iou(logits, reference)
        assert err <= max_err and iou >= min_iou, (err, iou)
