"""genfast's SAM 2 tracking step against the official SAM2Base.track_step: the same random
weights, the same frames and prompts, two objects at once, frame after frame (fp32)."""

from __future__ import annotations

import pytest
import torch

from genfast.sam.sam2.config import tiny_sam2_config
from genfast.sam.sam2.modeling.model import NO_OBJECT_SCORE, Sam2
from genfast.sam.sam2.official import import_sam2
from genfast.sam.sam2.tracker import Sam2Tracker, apply_non_overlapping_constraints, select_closest_cond_frames
from tests.sam.sam2.oracle import twin_models

NUM_FRAMES = 8
OBJECTS = 2
COMPARED = ("pred_masks", "pred_masks_high_res", "obj_ptr", "object_score_logits", "maskmem_features")
BACKBONE = ("backbone_fpn", "vision_pos_enc")


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, rel: float = 1e-5) -> None:
    """Max abs error below rel * (1 + max |expected|), the absent objects' constant masks aside
    (they must match exactly)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    absent = expected == NO_OBJECT_SCORE
    assert torch.equal(actual == NO_OBJECT_SCORE, absent), f"{what}: not the same pixels absent"
    err = (actual - expected)[~absent].abs().max().item() if (~absent).any() else 0.0
    scale = expected[~absent].abs().max().item() if (~absent).any() else 0.0
    assert err <= rel * (1 + scale), f"{what}: max abs error {err:.3g} (magnitude {scale:.3g})"


# Random weights whose objects the decoder finds on every frame, and ones whose it never does
# (then masks are NO_OBJECT_SCORE, pointers the learned "no object" one, and 2.1's memories say so).
WEIGHTS = {"2.1-found": ("2.1", 2), "2.1-lost": ("2.1", 8), "2.0-found": ("2.0", 5), "2.0-lost": ("2.0", 3)}


@pytest.fixture(scope="module", params=list(WEIGHTS))
def twins(request):
    release, seed = WEIGHTS[request.param]
    torch.manual_seed(0)  # the official modules' initialization, before twin_models perturbs it
    ours, official = twin_models(tiny_sam2_config(release), video=True, seed=seed)
    frames = torch.randn(NUM_FRAMES, 3, 128, 128, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        # Each frame encoded once and shared by the objects, as the video predictors do.
        ours_features = [ours.forward_image(frames[i : i + 1]) for i in range(NUM_FRAMES)]
        official_features = [official.forward_image(frames[i : i + 1]) for i in range(NUM_FRAMES)]
    return ours, official, ours_features, official_features, request.param.endswith("found")


def _prompt(kind: str | None, frame: int) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(10 + frame)
    if kind == "click":  # one click per object: several candidate masks decoded
        return (torch.rand(OBJECTS, 1, 2, generator=gen) * 128, torch.ones(OBJECTS, 1, dtype=torch.int32)), None
    if kind == "clicks":  # three, one of them negative
        labels = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.int32)
        return (torch.rand(OBJECTS, 3, 2, generator=gen) * 128, labels), None
    if kind == "mask":  # the second object absent from its mask
        mask = torch.zeros(OBJECTS, 1, 128, 128)
        mask[0, :, 30:90, 20:70] = 1
        return None, mask
    return None, None


def _no_frames() -> dict:
    return {"cond_frame_outputs": {}, "non_cond_frame_outputs": {}}


def _trackers(ours, official, **options) -> Sam2Tracker:
    """genfast's tracker with these options, and the official model set to the same."""
    official.max_cond_frames_in_attn = options.get("max_cond_frames_in_attn", -1)
    official.memory_temporal_stride_for_eval = options.get("memory_temporal_stride", 1)
    official.non_overlap_masks_for_mem_enc = options.get("non_overlap_masks_for_mem_enc", False)
    return Sam2Tracker(ours, **options)


def _step(twins, tracker: Sam2Tracker, dicts: tuple[dict, dict], frame: int, is_init: bool, **inputs) -> bool:
    """One frame with both models, compared, and remembered where the video predictors keep it;
    returns whether its objects were all found.

    The official encodes the frame's memory from genfast's predicted masks (equal to its own
    within 1e-6, checked first): the memory thresholds its masks (clicks' masks at 0, the
    non-overlap constraint at the best object), which turns a 1e-8 difference in a logit next to
    the threshold into a different memory pixel; that is not what is tested here.
    """
    _, official, ours_features, official_features, _ = twins
    points, mask = inputs.get("point_inputs"), inputs.get("mask_inputs")
    features, position = ours_features[frame]
    features, position = [x.expand(OBJECTS, -1, -1, -1) for x in features], position.expand(OBJECTS, -1, -1, -1)
    backbone = {k: [x.expand(OBJECTS, -1, -1, -1) for x in official_features[frame][k]] for k in BACKBONE}
    _, feats, pos, sizes = official._prepare_backbone_features(backbone)
    official_points = None if points is None else {"point_coords": points[0], "point_labels": points[1]}
    common = dict(
        num_frames=NUM_FRAMES,
        track_in_reverse=inputs.get("track_in_reverse", False),
        prev_sam_mask_logits=inputs.get("prev_sam_mask_logits"),
    )
    ours_dict, official_dict = dicts
    with torch.no_grad():
        # The features conditioned on the memory first: the masks depend on them only weakly.
        _close(
            tracker.memory_conditioned_features(
                frame, is_init, features[2], position, ours_dict, NUM_FRAMES, common["track_in_reverse"]
            ),
            official._prepare_memory_conditioned_features(
                frame, is_init, feats[-1:], pos[-1:], sizes[-1:], official_dict, NUM_FRAMES, common["track_in_reverse"]
            ),
            f"frame {frame} features with memory",
        )
        got = tracker.track_step(frame, is_init, features, position, points, mask, ours_dict, **common)
        expected = official.track_step(
            frame, is_init, feats, pos, sizes, official_points, mask, official_dict, run_mem_encoder=False, **common
        )
        for name in COMPARED[:-1]:
            _close(got[name], expected[name], f"frame {frame} {name}")
        expected["maskmem_features"], expected["maskmem_pos_enc"] = official._encode_new_memory(
            feats, sizes, got["pred_masks_high_res"], expected["object_score_logits"], points is not None
        )
    _close(got["maskmem_features"], expected["maskmem_features"], f"frame {frame} maskmem_features")
    _close(got["maskmem_pos_enc"][0], expected["maskmem_pos_enc"][0], f"frame {frame} maskmem_pos_enc")
    key = "cond_frame_outputs" if points is not None or mask is not None else "non_cond_frame_outputs"
    ours_dict[key][frame], official_dict[key][frame] = got, expected
    return bool((expected["object_score_logits"] > 0).all())


def _run(twins, schedule: list[tuple[int, str | None]], reverse: bool = False, **options) -> list[bool]:
    """Track through (frame, prompt kind or None) in order with both models, comparing every
    frame's output; returns whether each frame's objects were all found."""
    tracker = _trackers(twins[0], twins[1], **options)
    dicts = (_no_frames(), _no_frames())
    found = []
    for step, (frame, kind) in enumerate(schedule):
        points, mask = _prompt(kind, frame)
        found.append(
            _step(
                twins, tracker, dicts, frame, step == 0, point_inputs=points, mask_inputs=mask, track_in_reverse=reverse
            )
        )
    return found


def test_tracks_forward_from_clicks(twins) -> None:
    found = _run(twins, [(0, "click")] + [(t, None) for t in range(1, NUM_FRAMES)])
    assert found == [twins[-1]] * NUM_FRAMES  # the weights do what they are chosen for


def test_tracks_in_reverse(twins) -> None:
    last = NUM_FRAMES - 1
    _run(twins, [(last, "clicks")] + [(t, None) for t in reversed(range(last))], reverse=True)


def test_tracks_with_several_prompted_frames(twins) -> None:
    """A mask prompt (one object absent from it), clicks on later frames (conditioning frames in
    the future of some tracked ones), more conditioning frames than attended to, a memory stride
    and the non-overlap constraint."""
    schedule = [(2, "mask"), (3, None), (5, "clicks"), (4, None), (0, "click"), (1, None), (6, None), (7, None)]
    found = _run(
        twins, schedule, max_cond_frames_in_attn=2, memory_temporal_stride=2, non_overlap_masks_for_mem_enc=True
    )
    assert not found[0]


def test_correction_clicks_with_previous_logits(twins) -> None:
    """New clicks decoded together with the frame's earlier low-res logits (as the video predictor
    does when clicks are added to a frame it already answered)."""
    tracker = _trackers(twins[0], twins[1])
    dicts = (_no_frames(), _no_frames())
    points, _ = _prompt("clicks", 0)
    previous = torch.randn(OBJECTS, 1, 32, 32, generator=torch.Generator().manual_seed(5))
    for frame in (0, 1):
        _step(twins, tracker, dicts, frame, frame == 0, point_inputs=points, prev_sam_mask_logits=previous)


def test_select_closest_cond_frames() -> None:
    import_sam2()
    from sam2.modeling.sam2_utils import select_closest_cond_frames as official

    frames = {t: t for t in (0, 3, 8, 9, 20)}
    assert select_closest_cond_frames(10, frames, -1) == (frames, {})
    selected, unselected = select_closest_cond_frames(10, frames, 3)
    assert sorted(selected) == [8, 9, 20] and sorted(unselected) == [0, 3]
    for frame in (-1, 0, 4, 9, 10, 25):
        for limit in (-1, 2, 3, 4, 5):
            assert select_closest_cond_frames(frame, frames, limit) == official(frame, frames, limit)


def test_non_overlapping_constraints() -> None:
    masks = torch.tensor([[3.0, -1.0, 0.5], [2.0, 4.0, -20.0]])[:, None, None, :]
    out = apply_non_overlapping_constraints(masks)
    assert out[:, 0, 0].tolist() == [[3.0, -10.0, 0.5], [-10.0, 4.0, -20.0]]
    assert torch.equal(apply_non_overlapping_constraints(masks[:1]), masks[:1])


def test_tracks_in_bf16() -> None:
    """A bf16 model tracks (memories and pointers in bf16, masks in fp32 as the official's), within
    bf16's error of the fp32 model."""
    torch.manual_seed(0)
    ours, _ = twin_models(tiny_sam2_config(), video=True, seed=2)
    half = Sam2(ours.config).eval().to(torch.bfloat16)
    half.load_state_dict(ours.state_dict())
    frames = torch.randn(4, 3, 128, 128, generator=torch.Generator().manual_seed(4))
    points, _ = _prompt("click", 0)
    outputs = {}
    for model in (ours, half):
        tracker, memory, outputs[model.dtype] = Sam2Tracker(model), _no_frames(), []
        for t in range(len(frames)):
            with torch.no_grad():
                features, position = model.forward_image(frames[t : t + 1].to(model.dtype))
                out = tracker.track_step(
                    t,
                    t == 0,
                    [x.expand(OBJECTS, -1, -1, -1) for x in features],
                    position.expand(OBJECTS, -1, -1, -1),
                    points if t == 0 else None,
                    None,
                    memory,
                    len(frames),
                )
            memory["cond_frame_outputs" if t == 0 else "non_cond_frame_outputs"][t] = out
            outputs[model.dtype].append(out)
    for full, low in zip(outputs[torch.float32], outputs[torch.bfloat16]):
        assert low["maskmem_features"].dtype == low["obj_ptr"].dtype == torch.bfloat16
        assert low["pred_masks"].dtype == torch.float32
        for name in ("pred_masks", "obj_ptr", "object_score_logits"):
            _close(low[name].float(), full[name], name, rel=0.05)
