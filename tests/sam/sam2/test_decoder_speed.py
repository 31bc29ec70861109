"""The automatic mask generator's fast decoding (tiny config, random weights): one image shared
by a batch of prompts gives what an image per prompt gives, and the recipe's compile step, whose
generator decodes through one compiled module (bf16, padded batches), stays within bf16's budget
(mask-logit error <= 5% of the logit range, mask IoU >= 0.95) of the fp32 baseline."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from genfast.recipe import Target
from genfast.sam.recipe import RECIPE, apply_recipe
from genfast.sam.sam2.automatic import SAM2AutomaticMaskGenerator
from genfast.sam.sam2.build import build_random_sam2
from genfast.sam.sam2.config import tiny_sam2_config
from genfast.sam.sam2.predictor import SAM2ImagePredictor
from tests.sam.test_automatic import _image


def _candidates(generator: SAM2AutomaticMaskGenerator, image: np.ndarray, count: int) -> tuple[torch.Tensor, ...]:
    """Low-res logits and IoUs of the first `count` grid points, decoded as one batch (in the
    generator's pieces)."""
    predictor = generator.predictor
    predictor.set_image(image)
    size = image.shape[:2]
    points = generator.point_grids[0][:count] * torch.tensor(size[::-1], dtype=torch.float64)
    prompts = predictor.input_frame(points, size)[:, None]
    return generator._decode_batch(prompts)


def test_one_image_for_all_prompts_matches_an_image_per_prompt() -> None:
    model = build_random_sam2(tiny_sam2_config(), seed=1).eval()
    decoder, prompt_encoder = model.sam_mask_decoder, model.sam_prompt_encoder
    rng = torch.Generator().manual_seed(0)  # the global one is left alone: other tests' models draw from it
    image = torch.randn(1, 32, 8, 8, generator=rng)  # d_model 32, an 8x8 embedding
    feat_s0, feat_s1 = torch.randn(1, 4, 32, 32, generator=rng), torch.randn(1, 8, 16, 16, generator=rng)
    coords = torch.rand(5, 1, 2, generator=rng) * model.image_size
    sparse, dense = prompt_encoder((coords, torch.ones(5, 1, dtype=torch.int32)), None, None)
    assert dense.stride(0) == 0  # the "no mask" embedding, expanded: the shared path
    with torch.no_grad():
        shared = decoder(image, prompt_encoder.get_dense_pe(), sparse, dense, True, (feat_s0, feat_s1))
        each = decoder(
            image.expand(5, -1, -1, -1).contiguous(),
            prompt_encoder.get_dense_pe(),
            sparse,
            dense.contiguous(),
            True,
            (feat_s0, feat_s1),
        )
    for a, b in zip(shared, each):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compiled_generator_within_bf16_budget() -> None:
    image = _image()
    target = Target(torch.device("cpu"), "bfloat16")
    baseline = SAM2AutomaticMaskGenerator(
        apply_recipe(build_random_sam2(tiny_sam2_config(), seed=3), RECIPE.settings("baseline", target)),
        points_per_side=10,
        points_per_batch=16,
    )
    compiled_model = apply_recipe(build_random_sam2(tiny_sam2_config(), seed=3), RECIPE.settings("compile", target))
    compiled = SAM2AutomaticMaskGenerator(compiled_model, points_per_side=10, points_per_batch=16)
    assert compiled._grid_decoder is not None
    compiled.points_per_decode = 6  # as a real-size model's: batches decoded in pieces
    with torch.inference_mode():
        # A full batch (pieces 6, 6, 4) and a short one (6, 5): the short pieces padded to the
        # compiled shape.
        for count in (16, 11):
            expected_logits, expected_iou = _candidates(baseline, image, count)
            logits, iou = _candidates(compiled, image, count)
            assert logits.shape == expected_logits.shape and logits.dtype == torch.float32
            span = expected_logits.max() - expected_logits.min()
            assert (logits - expected_logits).abs().max() <= 0.05 * span
            assert (iou - expected_iou).abs().max() <= 0.05
            inter = ((logits > 0) & (expected_logits > 0)).flatten(2).sum(-1)
            union = ((logits > 0) | (expected_logits > 0)).flatten(2).sum(-1)
            assert (inter / union.clamp(min=1)).mean() >= 0.95
        records = compiled.generate(image)  # the whole generator runs through the compiled decoder
    assert all(r["segmentation"].shape == image.shape[:2] for r in records)


class _LargestOutput(TorchDispatchMode):
    """The largest tensor any operation produces, in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.nbytes)
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sam", ["sam", "sam2"])
def test_decoder_bytes_per_prompt_is_its_largest_intermediate(sam: str, dtype: torch.dtype) -> None:
    """What the automatic generators size their pieces by (genfast/sam/automatic.py): the largest
    tensor the mask decoder makes for a batch of prompts, per prompt. (SAM 2's tiny test config
    widened to 64 channels at a 512-pixel input: at 128 pixels its tokens' MLP is larger than
    its 8x8 embedding's upscaling, and at 32 channels its fp32 mask logits are, unlike any real
    model's.)"""
    if sam == "sam":
        from genfast.sam.build import build_sam
        from genfast.sam.predictor import SamPredictor
        from tests.sam.test_modeling import TINY

        predictor = SamPredictor(build_sam(TINY).to(dtype).eval())
    else:
        model = build_random_sam2(tiny_sam2_config(image_size=512, d_model=64), seed=1)
        predictor = SAM2ImagePredictor(model.to(dtype).eval())
    predictor.set_image(_image())
    prompts = 7
    points = torch.rand(prompts, 1, 2) * 20
    labels = torch.ones(prompts, 1, dtype=torch.int32)
    with torch.inference_mode(), _LargestOutput() as largest:
        predictor.predict_low_res_torch(points, labels, multimask_output=True)
    assert largest.nbytes == prompts * predictor.decoder_bytes_per_prompt()


def test_a_real_size_generator_decodes_in_pieces_below_the_mapping_threshold() -> None:
    """sam2.1-hiera-tiny's decoder makes 4 MiB a point in bf16 (8 in fp32): the default 64
    points decode in pieces of 4 (2), 16 MiB a piece, below glibc's 32 MiB mapping threshold."""
    model = build_random_sam2("sam2.1-hiera-tiny").eval()
    assert SAM2AutomaticMaskGenerator(model).points_per_decode == 2
    assert SAM2AutomaticMaskGenerator(model.to(torch.bfloat16)).points_per_decode == 4
    assert SAM2AutomaticMaskGenerator(model, points_per_batch=3).points_per_decode == 3


def test_a_gpu_generator_decodes_whole_batches(monkeypatch) -> None:
    """Pieces are for malloc: elsewhere (a GPU's caching allocator) the batch stays whole."""
    model = build_random_sam2("sam2.1-hiera-tiny").eval()
    monkeypatch.setattr(SAM2ImagePredictor, "device", property(lambda self: torch.device("cuda")))
    assert SAM2AutomaticMaskGenerator(model).points_per_decode == 64
