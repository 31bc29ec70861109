"""The upsampled-mask kernel against F.interpolate's masks: pixel counts, boxes and column runs of
low-res logits upsampled bilinearly, for upscaling, downscaling and widths that leave a partial
vector of columns. A pixel may differ from ATen's only where its float64 value lies within
rounding of the threshold (the kernel and ATen may fuse their products differently)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genfast.kernels.upsampled_masks import ops
from genfast.sam.masks import column_runs, masks_to_boxes

native = pytest.mark.skipif(ops.unavailable_reason() is not None, reason=str(ops.unavailable_reason()))

NEAR = 1e-4  # float64 distance from a threshold within which fp32 rounding may decide a pixel


def upsampled(logits: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    return F.interpolate(logits[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]


def decode_runs(runs: tuple[torch.Tensor, ...], n: int, size: tuple[int, int]) -> torch.Tensor:
    """Boolean masks [n, H, W] from (mask, column, start, end) runs."""
    masks = torch.zeros(n, size[1], size[0], dtype=torch.bool)  # column-major: [n, W, H]
    for m, c, s, e in zip(*(r.tolist() for r in runs)):
        assert not masks[m, c, s:e].any()  # runs do not overlap
        masks[m, c, s:e] = True
    return masks.transpose(1, 2)


def logits_for(n: int, h: int, w: int, seed: int) -> torch.Tensor:
    """Smooth blobs (real masks' logits) with noise, one all-background and one all-foreground mask."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.randn(n, 1, max(h // 8, 2), max(w // 8, 2), generator=g) * 4
    logits = F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False)[:, 0]
    logits = logits + 0.3 * torch.randn(n, h, w, generator=g)
    logits[0] = -5.0
    logits[-1] = 5.0
    return logits.contiguous()


@native
@pytest.mark.parametrize(
    "low,size",
    [((64, 64), (128, 128)), ((64, 64), (107, 161)), ((32, 48), (40, 23)), ((16, 16), (16, 16)), ((64, 64), (37, 9))],
    ids=["2x", "non-integer-scale", "mixed-scales", "identity", "downscale-narrow"],
)
@pytest.mark.parametrize("threshold,offset", [(0.0, 1.0), (0.7, 0.05)])
def test_counts_boxes_and_runs_match_aten(low, size, threshold, offset):
    n = 6
    logits = logits_for(n, *low, seed=sum(size))
    reference = upsampled(logits.double(), size)
    aten = upsampled(logits, size)

    counts, boxes = ops.stats(logits, size, threshold, offset)
    for column, cut in ((0, threshold + offset), (1, threshold - offset)):
        near = ((reference - cut).abs() < NEAR).flatten(1).sum(1)
        assert ((counts[:, column] - (aten > cut).flatten(1).sum(1)).abs() <= near).all()

    runs = ops.runs(logits, size, threshold)
    masks = decode_runs(runs, n, size)
    flipped = masks != (aten > threshold)
    assert not (flipped & ((reference - threshold).abs() >= NEAR)).any()
    assert torch.equal(boxes, masks_to_boxes(masks))  # the stats' boxes are the runs' masks' boxes
    expected = column_runs(masks)
    assert all(torch.equal(a, b) for a, b in zip(runs, expected))  # sorted by mask, column, start
    assert counts[0].tolist() == [0, 0] and counts[-1].tolist() == [size[0] * size[1]] * 2
    assert boxes[0].tolist() == [0, 0, 0, 0] and boxes[-1].tolist() == [0, 0, size[1] - 1, size[0] - 1]


@native
def test_a_selection_of_masks_and_no_masks():
    logits = logits_for(5, 32, 32, seed=3)
    picked = ops.runs(logits[[3, 1]], (50, 70), 0.0)
    whole = ops.runs(logits, (50, 70), 0.0)
    for index, mask in enumerate((3, 1)):
        mine = [r[picked[0] == index] for r in picked[1:]]
        theirs = [r[whole[0] == mask] for r in whole[1:]]
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    empty = torch.empty(0, 32, 32)
    assert all(r.numel() == 0 for r in ops.runs(empty, (50, 70), 0.0))
    counts, boxes = ops.stats(empty, (50, 70), 0.0, 1.0)
    assert counts.shape == (0, 2) and boxes.shape == (0, 4)


@native
def test_rejects_what_it_does_not_take():
    with pytest.raises(RuntimeError, match="float32"):
        ops.stats(torch.zeros(2, 8, 8, dtype=torch.bfloat16), (16, 16), 0.0, 1.0)
    with pytest.raises(RuntimeError, match="output size"):
        ops.runs(torch.zeros(2, 8, 8), (0, 16), 0.0)
    assert not ops.takes(torch.zeros(2, 8, 8, dtype=torch.bfloat16))
