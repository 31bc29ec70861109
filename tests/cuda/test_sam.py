"""Segment Anything on a CUDA GPU: every recipe step within its budget against fp32 on the GPU
(the folded bias for the fused step, dynamic int8 through torch._int_mm, 2:4 sparse kernels), fp32
against the CPU, the compiled encoder against eager, the bias inside attention (folded, FlexAttention)
against the explicit softmax, and no host syncs in the encoder or the prompt path (CUDA's
sync-debug mode)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from genfast.recipe import Target
from genfast.sam.build import build_random_sam
from genfast.sam.predictor import SamPredictor
from genfast.sam.recipe import RECIPE, SamSettings, apply_recipe
from tests.cuda.syncs import host_syncs, needs_cuda
from tests.sam.test_recipe import BUDGETS, SMALL, _images, _prompts, error_and_iou

pytestmark = needs_cuda

GPU = Target(torch.device("cuda"), "bfloat16")


def predictor(step: str, device: str = "cuda", compile: bool = False, max_autotune: bool = False) -> SamPredictor:
    """`max_autotune` off unless asked: it adds minutes of compile and changes only which GEMM kernels run."""
    changes = {"compile": compile, "max_autotune": max_autotune}
    settings = SamSettings(**{**RECIPE.plan(step, GPU).settings.__dict__, **changes})
    return SamPredictor(apply_recipe(build_random_sam(SMALL).to(device), settings))


def low_res_logits(step: str, device: str = "cuda") -> list[np.ndarray]:
    pred = predictor(step, device)
    images = _images()
    pred.set_images(images)
    if RECIPE.plan(step, GPU).settings.batched_prompts:
        results = pred.predict_batch(_prompts(images), multimask_output=False)
    else:
        results = [pred.predict(**p, multimask_output=False, image_index=i) for i, p in enumerate(_prompts(images))]
    return [low_res[0] for _, _, low_res in results]


@pytest.fixture(scope="module")
def baseline() -> list[np.ndarray]:
    return low_res_logits("baseline")


def test_fp32_on_the_gpu_matches_the_cpu(baseline):
    """cuDNN may run the patch embedding's convolution in TF32: within 1%."""
    for logits, reference in zip(baseline, low_res_logits("baseline", "cpu")):
        error, iou = error_and_iou(logits, reference)
        assert error < 1e-2 and iou > 0.99, (error, iou)


@pytest.mark.parametrize("step", list(BUDGETS))
def test_step_stays_within_its_budget_on_the_gpu(step, baseline):
    max_error, min_iou = BUDGETS[step]
    for logits, reference in zip(low_res_logits(step), baseline):
        error, iou = error_and_iou(logits, reference)
        assert error <= max_error and iou >= min_iou, (step, error, iou)


@pytest.mark.parametrize("impl", ["folded", "flex"])
@pytest.mark.parametrize("b, h, w", [(1, 64, 64), (25, 14, 14), (2, 5, 7)])  # global, windows, ragged
def test_the_bias_inside_attention_matches_math_on_the_gpu(impl, b, h, w):
    """bf16 on the GPU within the native CPU kernel's bound (1e-2 on unit-variance values) of the
    fp32 explicit softmax: SDPA's CUDA kernels take the folded product's wider queries and keys."""
    from genfast.sam.modeling.attention import rel_pos_attention
    from tests.sam.test_attention import _inputs

    inputs = [t.cuda().bfloat16() for t in _inputs(b, h, w, 64)]
    expected = rel_pos_attention(*(t.float() for t in inputs), "math")
    actual = rel_pos_attention(*inputs, impl)
    assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
    assert (actual.float() - expected).abs().max().item() < 1e-2


def test_sparse_2_4_runs_on_semi_structured_weights():
    """Pruning changes the model, so the step has no budget: it must run, on sparse weights."""
    from torch.sparse import SparseSemiStructuredTensor

    pred = predictor("sparse-2:4")
    encoder_weights = [m.weight for m in pred.model.image_encoder.modules() if isinstance(m, torch.nn.Linear)]
    assert any(isinstance(w, SparseSemiStructuredTensor) for w in encoder_weights)
    images = _images()
    pred.set_images(images)
    masks, _, low_res = pred.predict(**_prompts(images)[0], multimask_output=False, image_index=0)
    assert np.isfinite(low_res).all() and masks.shape == (1, *images[0].shape[:2])


def test_compiled_encoder_matches_eager():
    """As the recipe compiles it on CUDA: with max-autotune (segment-anything-fast's setting)."""
    eager, compiled = predictor("fused-attention"), predictor("fused-attention", compile=True, max_autotune=True)
    images = _images()[:1]
    eager.set_images(images)
    compiled.set_images(images)
    expected, actual = eager.get_image_embedding().float(), compiled.get_image_embedding().float()
    assert (actual - expected).abs().max() <= 0.05 * expected.abs().max()


@pytest.mark.parametrize("step", ["fused-attention", "dynamic-int8"])
def test_the_encoder_and_the_prompt_path_do_not_synchronize(step):
    pred = predictor(step, compile=True)
    image = _images()[0]
    transformed = pred.transform.apply_image_torch(torch.from_numpy(image).permute(2, 0, 1)[None].float().cuda())
    coords = pred.transform.apply_coords_torch(torch.tensor([[[20.0, 30.0], [40.0, 50.0]]]), image.shape[:2]).cuda()
    labels = torch.tensor([[1, 0]], dtype=torch.int32, device="cuda")
    boxes = pred.transform.apply_boxes_torch(torch.tensor([[10.0, 10.0, 60.0, 70.0]]), image.shape[:2]).cuda()
    for _ in range(2):  # compile first
        pred.set_torch_image(transformed, image.shape[:2])
        want = pred.predict_torch(coords, labels, boxes)
    with host_syncs() as syncs:
        pred.set_torch_image(transformed, image.shape[:2])
        got = pred.predict_torch(coords, labels, boxes)
    assert syncs == [], f"{len(syncs)} host syncs: {syncs[:3]}"
    assert torch.equal(got[0], want[0])


def test_the_benchmarks_original_row_runs_on_the_gpu():
    """`genfast bench sam --device cuda` compares with the original package on the same GPU (its
    first H200 run built the original on the CPU: 0.32 images/s against genfast's 22 on the GPU)."""
    from torch.profiler import ProfilerActivity, profile

    from genfast.sam.bench import _run_original

    model = build_random_sam(SMALL).cuda()
    images = _images()[:1]
    run = _run_original(SMALL, model, images, _prompts(images)[:1])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        [(masks, _)] = run()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) > 50, f"{len(kernels)} GPU kernels: the original model did not run on the GPU"
    assert masks.shape == images[0].shape[:2]
