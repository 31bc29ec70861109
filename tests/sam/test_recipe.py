"""Each step of the SAM recipe against the fp32 model (math attention, which equals the original
package: tests/sam/test_modeling.py), within the budget recipe.py states."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genfast.errors import UserError
from genfast.platform import hardware
from genfast.quant.linear import QuantLinear, narrower_than
from genfast.quant.sparse import prune_2_4_, sparse_2_4_unavailable
from genfast.recipe import Target
from genfast.sam.build import build_random_sam
from genfast.sam.config import SamConfig
from genfast.sam.predictor import SamPredictor
from genfast.sam.recipe import INT8_MIN_FEATURES, RECIPE, SamSettings, apply_recipe
from tests.cpus import ZEN3, ZEN4, pretend_cpu

CPU_BF16 = Target(torch.device("cpu"), "bfloat16")


def settings_for(step: str, dtype: str = "bfloat16") -> SamSettings:
    return RECIPE.plan(step, Target(torch.device("cpu"), dtype)).settings


# Encoder width 256 (head dim 64): every encoder linear passes the int8 filter, as in vit_b.
SMALL = SamConfig(
    256,
    2,
    4,
    (1,),
    image_size=128,
    patch_size=16,
    window_size=3,
    prompt_embed_dim=32,
    mask_in_chans=8,
    decoder_mlp_dim=64,
    decoder_num_heads=2,
    iou_head_hidden_dim=32,
)
BUDGETS = {  # step: (max relative error of the low-res logits, min mask IoU)
    "bf16": (0.05, 0.95),
    "sdpa": (0.05, 0.95),
    "fused-attention": (0.05, 0.95),
    "batched-prompts": (0.05, 0.95),
    "dynamic-int8": (0.10, 0.95),
}


def _images() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:96, 0:80]
    smooth = np.stack([x * 3, y * 2, (x + y) * 1.5], axis=2)
    return [(smooth + rng.integers(0, 40, smooth.shape) * k).clip(0, 255).astype(np.uint8) for k in (1, 2, 3)]


def _prompts(images):
    return [
        {"point_coords": np.array([[20.0 + 10 * i, 30.0]]), "point_labels": np.array([1])} for i, _ in enumerate(images)
    ]


def _run(step: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Masks and low-res logits of every image, through the predictor as the bench calls it; the
    steps after compile run eagerly here (compile is tested on its own below)."""
    recipe = SamSettings(**{**settings_for(step).__dict__, "compile": False})
    model = apply_recipe(build_random_sam(SMALL), recipe)
    if recipe.dynamic_int8:
        linears = [m for m in model.image_encoder.modules() if isinstance(m, QuantLinear)]
        assert len(linears) == 4 * SMALL.encoder_depth  # qkv, proj, two MLP layers per block
    predictor = SamPredictor(model)
    images = _images()
    predictor.set_images(images)
    if recipe.batched_prompts:
        results = predictor.predict_batch(_prompts(images), multimask_output=False)
    else:
        results = [
            predictor.predict(**p, multimask_output=False, image_index=i) for i, p in enumerate(_prompts(images))
        ]
    return [(masks[0], low_res[0]) for masks, _, low_res in results]


@pytest.fixture(scope="module")
def baseline():
    return _run("baseline")


def test_steps_are_cumulative(monkeypatch):
    assert settings_for("baseline") == SamSettings()
    full = settings_for("dynamic-int8")
    assert (full.dtype, full.attention, full.compile, full.batched_prompts, full.dynamic_int8) == (
        "bfloat16",
        "fused",
        True,
        True,
        True,
    )
    monkeypatch.setattr("genfast.quant.sparse.sparse_2_4_unavailable", lambda device: None)  # as on a GPU
    sparse = RECIPE.plan("sparse-2:4", CPU_BF16)
    assert sparse.settings.sparse_2_4 and not sparse.settings.dynamic_int8  # no kernel does both
    assert "dynamic-int8" not in sparse.applied and "batched-prompts" in sparse.applied
    with pytest.raises(UserError, match="unknown step 'fast' of the sam recipe"):
        settings_for("fast")
    assert RECIPE.names[0] == "baseline" and RECIPE.baseline == "baseline"


def test_the_bf16_step_can_be_left_out(monkeypatch):
    """Where bf16 is emulated, --dtype auto keeps fp32 and takes every other step, saying why;
    --dtype float32 leaves the step out as asked; naming the step where it cannot run is an error."""
    pretend_cpu(monkeypatch, ZEN3)
    plan = RECIPE.plan("dynamic-int8", Target(torch.device("cpu"), "auto"))
    full = plan.settings
    assert (full.dtype, full.attention, full.compile, full.batched_prompts, full.dynamic_int8) == (
        "float32",
        "fused",
        True,
        True,
        True,
    )
    assert [name for name, _ in plan.skipped] == ["bf16"] and "no native bf16" in plan.skipped[0][1]
    declined = RECIPE.plan("dynamic-int8", Target(torch.device("cpu"), "float32"))
    assert declined.settings == full and not declined.skipped and declined.declined[0][0] == "bf16"
    with pytest.raises(UserError, match="step bf16 cannot run here: this CPU has no native bf16"):
        RECIPE.plan("bf16", Target(torch.device("cpu"), "auto"))
    with pytest.raises(UserError, match="--dtype float32"):
        RECIPE.plan("bf16", Target(torch.device("cpu"), "float32"))
    pretend_cpu(monkeypatch, ZEN4)
    assert RECIPE.plan("dynamic-int8", Target(torch.device("cpu"), "auto")).settings.dtype == "bfloat16"


def error_and_iou(logits: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """Relative error of low-res logits, and the IoU of both thresholded at the reference's median:
    random weights put most logits on one side of 0, so half-full masks test the whole field."""
    error = np.linalg.norm(logits - reference) / np.linalg.norm(reference)
    threshold = np.median(reference)
    mask, base = logits > threshold, reference > threshold
    return float(error), float(np.logical_and(mask, base).sum() / np.logical_or(mask, base).sum())


@pytest.mark.parametrize("step", list(BUDGETS))
def test_step_stays_within_its_budget(step, baseline):
    max_err, min_iou = BUDGETS[step]
    outputs = _run(step)
    for (_, logits), (_, base_logits) in zip(outputs, baseline):
        err, iou = error_and_iou(logits, base_logits)
        assert err <= max_err and iou >= min_iou, (err, iou)


def test_compiled_encoder_matches_eager_without_recompiling():
    """fullgraph (a graph break fails), static batches of 2: one compile serves 1, 2 and 3 images."""
    recipe = SamSettings(dtype="bfloat16", attention="fused", compile=True)
    eager_model = apply_recipe(build_random_sam(SMALL), SamSettings(dtype="bfloat16", attention="fused"))
    compiled_model = apply_recipe(build_random_sam(SMALL), recipe)
    images = _images()
    eager, compiled = SamPredictor(eager_model), SamPredictor(compiled_model, encoder_batch_size=2)
    torch._dynamo.utils.counters.clear()
    for count in (1, 2, 3):
        eager.set_images(images[:count])
        compiled.set_images(images[:count])
        expected, actual = eager.get_image_embedding().float(), compiled.get_image_embedding().float()
        assert (actual - expected).abs().max() <= 0.05 * expected.abs().max()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_prune_2_4_keeps_the_two_largest_of_every_four():
    linear = torch.nn.Linear(8, 3)
    original = linear.weight.detach().clone()
    prune_2_4_(linear)
    groups, before = linear.weight.view(3, 2, 4), original.view(3, 2, 4)
    assert ((groups != 0).sum(-1) == 2).all()
    kept = before.abs().topk(2, dim=-1).indices
    torch.testing.assert_close(groups.gather(-1, kept), before.gather(-1, kept))
    with pytest.raises(ValueError, match="divisible by 4"):
        prune_2_4_(torch.nn.Linear(6, 2))


def test_sparse_step_says_why_it_cannot_run_on_cpu():
    assert "CUDA only" in sparse_2_4_unavailable(torch.device("cpu"))
    with pytest.raises(UserError, match="step sparse-2:4 cannot run here: torch has no 2:4"):
        RECIPE.plan("sparse-2:4", CPU_BF16)
    with pytest.raises(UserError, match="the sam step sparse-2:4 cannot run here"):
        apply_recipe(build_random_sam(SMALL), SamSettings(sparse_2_4=True))


def test_fused_attention_says_when_it_falls_back(monkeypatch):
    """On a CPU whose kernel variant takes no fp32 inputs the step runs as SDPA, and says so; on
    one with AMX it runs by SDPA in part, and says so too."""
    from genfast.kernels.rel_pos_attention import ops as fused_attention

    monkeypatch.setattr(fused_attention, "loaded_isa", lambda: "avx512")
    monkeypatch.setattr(fused_attention, "unavailable_reason", lambda: None)
    monkeypatch.setattr(fused_attention, "takes", lambda dtype: dtype == torch.bfloat16)
    monkeypatch.setattr(hardware, "has_amx_bf16", lambda: False)
    plan = RECIPE.plan("fused-attention", Target(torch.device("cpu"), "float32"))
    assert plan.notes == (("fused-attention", "the avx512 kernel takes no float32: SDPA"),)
    assert not RECIPE.plan("fused-attention", CPU_BF16).notes
    monkeypatch.setattr(hardware, "has_amx_bf16", lambda: True)  # SDPA on AMX's tiles for many keys
    amx = "AMX: attention without a bias over more than 16 keys by SDPA (on AMX's tiles)"
    assert RECIPE.plan("fused-attention", CPU_BF16).notes == (("fused-attention", amx),)


def test_int8_filter_is_a_function_of_shapes():
    keep = narrower_than(INT8_MIN_FEATURES)
    assert keep("x", torch.nn.Linear(64, 1024))
    assert not keep("x", torch.nn.Linear(768, 2304))
