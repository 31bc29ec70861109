"""SAM2VideoPredictor: the official package's video predictor (same calls, arguments and results),
so code written for `sam2.sam2_video_predictor` runs by changing the import.

    predictor = SAM2VideoPredictor.from_pretrained("sam2.1-hiera-tiny")
    state = predictor.init_state("video.mp4")  # or a folder of .jpg/.png frames
    predictor.add_new_points_or_box(state, frame_idx=0, obj_id=1, points=[[210, 350]], labels=[1])
    for frame_idx, obj_ids, video_res_masks in predictor.propagate_in_video(state):
        ...  # video_res_masks: [num_objects, 1, H, W] float32 logits (> 0 inside)

As in the official 1.1.0, each object is tracked on its own, with its own memory: its own
conditioning (prompted) frames, its own recent frames and object pointers; clicks on a frame that
was already tracked correct it (a non-conditioning output unless add_all_frames_to_correct_as_cond);
new clicks are decoded with the frame's earlier answer; the memories of prompted frames are encoded
when propagation starts.

Where genfast differs:
- Frames are streamed. The official decodes the whole video into memory at init_state (a
  300-frame video is 3.8 GB as 1024-pixel float32 frames); here a frame is read (through
  genfast.sam.video_io, whose cache is bounded in bytes) and preprocessed when it is needed, and
  only the current frame's image features are kept. The preprocessing is the official loader's:
  resized with PIL (bicubic) to the model's square, scaled to [0, 1] in float64, normalized in
  float32. Video files are read with PyAV (the official reads them with decord and resizes in
  FFmpeg, so masks from a video file differ slightly from the official's); JPEG frames have their
  EXIF orientation applied (the official ignores it).
- The tracking state is bounded: it does not grow with the video's length. Per object it keeps
  every conditioning frame's output, and of the other tracked frames only what the tracker can
  still read: the memories (maskmem_features) and low-res masks of frames within num_maskmem of
  the last frame tracked or of a conditioning frame (where a pass forwards or backwards starts),
  and the object pointers (small) of frames within max_obj_ptrs_in_encoder of them. What a user
  loses: a correction on a frame, or a propagation started at a frame (start_frame_idx), whose
  nearby memories were dropped first re-tracks that object from its nearest conditioning frame
  behind it (frames are read and encoded again: time, not accuracy; the result equals the
  official's unless prompts changed since those frames were tracked); masks returned by the
  interactive calls (add_new_points_or_box, add_new_mask, clear_all_prompts_in_frame,
  remove_object) show other objects whose output on that frame was dropped as absent
  (NO_OBJECT_SCORE, as the official shows an object without output there).
- The objects tracked on a frame can go through the model together (objects_per_batch at a time,
  memory attention once per group of objects whose memories are equally long): the same masks as
  tracking each on its own, as the official does (the default, measured faster on a CPU), in fewer
  and larger calls.
- Small holes are filled (fill_hole_area, default 8 as build_sam2_video_predictor sets it) on
  every device; the official does it only with its CUDA extension and silently skips it otherwise.
- Mistakes raise genfast.errors.UserError with one sentence saying what to fix: a frame index
  out of range, a point outside the frame, an unknown object id, propagating without prompts.
- offload_video_to_cpu and async_loading_frames are accepted and ignored: no decoded video is held,
  and frames are read on demand anyway. offload_state_to_cpu keeps memories and masks on the CPU.

The model may be bf16: the tracker runs in the model's dtype, masks are returned in float32.
Memories are kept in bf16 whatever the model's dtype, as the official keeps them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from genfast.errors import UserError
from genfast.sam.masks import connected_components
from genfast.sam.sam2.modeling.model import NO_OBJECT_SCORE, PIXEL_MEAN, PIXEL_STD, Sam2
from genfast.sam.sam2.tracker import FrameOutput, Sam2Tracker, apply_non_overlapping_constraints
from genfast.sam.video_io import VideoFrames, open_video

InferenceState = dict[str, Any]
MEMORY_DTYPE = torch.bfloat16  # memories are stored in bf16, as the official stores them
PREV_LOGITS_BOUND = 32.0  # an earlier answer's logits are clamped so before being decoded again
HOLE_FILL_LOGIT = 0.1  # a filled hole becomes (barely) foreground, as the official fills it
DEFAULT_FILL_HOLE_AREA = 8  # build_sam2_video_predictor's
# Objects tracked together on a frame. Each adds its memories' keys and values (~60 MB in bf16 at
# 1024 pixels with seven memories) to what one batch holds. One at a time by default: batching saves
# no arithmetic (each object attends to its own memories) and on a quiet 2-core Zen 4 it was slower
# (sam2.1-hiera-tiny, two objects, 8 frames, fused-attention: 0.545 and 0.560 frames/s batched
# against 0.614 and 0.614 one at a time, alternating runs; docs/notes.md).
DEFAULT_OBJECTS_PER_BATCH = 1


def preprocess_frame(frame: np.ndarray, image_size: int) -> Tensor:
    """An HxWx3 uint8 RGB frame -> the model's float32 input [3, S, S], as the official video
    loader makes it: PIL's bicubic resize, /255 in float64, then normalized in float32."""
    resized = np.asarray(Image.fromarray(frame).resize((image_size, image_size), Image.Resampling.BICUBIC))
    x = torch.from_numpy(resized / 255.0).permute(2, 0, 1).float()
    mean = torch.tensor(PIXEL_MEAN, dtype=torch.float32)[:, None, None]
    std = torch.tensor(PIXEL_STD, dtype=torch.float32)[:, None, None]
    return (x - mean) / std


def fill_holes(masks: Tensor, max_area: int) -> Tensor:
    """Mask logits [B, 1, h, w] with every background region (logit <= 0, 8-connected) of at
    most max_area pixels turned to foreground (HOLE_FILL_LOGIT)."""
    filled = []
    for mask in masks[:, 0]:
        labels, sizes = connected_components((mask <= 0).cpu(), connectivity=8)
        small = torch.cat([torch.zeros(1, dtype=torch.bool), sizes <= max_area])[labels]
        filled.append(torch.where(small.to(mask.device), HOLE_FILL_LOGIT, mask))
    return torch.stack(filled)[:, None]


class StreamedFrames:
    """inference_state["images"]: the video's frames, each read and preprocessed when indexed
    (len() and [i] as the official's tensor of frames offers; nothing is kept here)."""

    def __init__(self, video: VideoFrames, image_size: int, device: torch.device) -> None:
        self.video = video
        self.image_size = image_size
        self.device = device

    def __len__(self) -> int:
        return self.video.num_frames

    def __getitem__(self, index: int) -> Tensor:
        return preprocess_frame(self.video.frame(index), self.image_size).to(self.device)


class FrameLog:
    """Per object and frame, one byte: whether (and in which direction) the frame was tracked, as
    the official's frames_tracked_per_obj says, and whether the official would hold a
    non-conditioning output for it (which genfast may have dropped: then it is re-tracked when
    needed). Fixed size, so the state does not grow as frames are tracked."""

    FORWARD, REVERSE, OUTPUT = 1, 2, 4

    def __init__(self, num_frames: int) -> None:
        self.flags = bytearray(num_frames)

    def is_tracked(self, frame: int) -> bool:
        return bool(self.flags[frame] & (self.FORWARD | self.REVERSE))

    def is_reverse(self, frame: int) -> bool:
        return bool(self.flags[frame] & self.REVERSE)

    def set_tracked(self, frame: int, reverse: bool) -> None:
        self.flags[frame] = (self.flags[frame] & self.OUTPUT) | (self.REVERSE if reverse else self.FORWARD)

    def untrack(self, frame: int) -> None:
        self.flags[frame] &= self.OUTPUT

    def has_output(self, frame: int) -> bool:
        return bool(self.flags[frame] & self.OUTPUT)

    def set_output(self, frame: int, held: bool) -> None:
        self.flags[frame] = (self.flags[frame] | self.OUTPUT) if held else (self.flags[frame] & ~self.OUTPUT)


class _StreamingTracker(Sam2Tracker):
    """The tracker, skipping (as untracked) a recent frame whose memory was dropped: it happens
    only where no conditioning frame is left to re-track from; its object pointer is still used."""

    def _memory_frame(self, *args: Any, **kwargs: Any) -> FrameOutput | None:
        out = super()._memory_frame(*args, **kwargs)
        return out if out is not None and out["maskmem_features"] is not None else None


def _cpu_tensor(values: Sequence | np.ndarray | Tensor, dtype: torch.dtype) -> Tensor:
    """A prompt's numbers (list, array or tensor on any device) as a CPU tensor of dtype."""
    if isinstance(values, Tensor):
        return values.detach().to("cpu", dtype)
    return torch.as_tensor(np.asarray(values)).to(dtype)


def _no_outputs() -> dict[str, dict[int, FrameOutput]]:
    return {"cond_frame_outputs": {}, "non_cond_frame_outputs": {}}


class SAM2VideoPredictor:
    """The official video predictor's API on a genfast Sam2 model. The options are the official
    predictor's, with the defaults build_sam2_video_predictor gives them, and objects_per_batch:
    how many objects are tracked through one batch of the model on a frame (1: each on its own,
    as the official; more take more memory at once, the memory attention's keys of each)."""

    def __init__(
        self,
        model: Sam2,
        fill_hole_area: int = DEFAULT_FILL_HOLE_AREA,
        non_overlap_masks: bool = False,
        clear_non_cond_mem_around_input: bool = False,
        add_all_frames_to_correct_as_cond: bool = False,
        objects_per_batch: int = DEFAULT_OBJECTS_PER_BATCH,
    ) -> None:
        if objects_per_batch < 1:
            raise UserError(f"objects_per_batch must be at least 1, got {objects_per_batch}")
        self.model = model
        self.objects_per_batch = objects_per_batch
        self.tracker = _StreamingTracker(model)
        self.fill_hole_area = fill_hole_area
        self.non_overlap_masks = non_overlap_masks
        self.clear_non_cond_mem_around_input = clear_non_cond_mem_around_input
        self.add_all_frames_to_correct_as_cond = add_all_frames_to_correct_as_cond

    @classmethod
    def from_pretrained(cls, model_id: str, **kwargs: Any) -> SAM2VideoPredictor:
        """A predictor for a named model ('sam2.1-hiera-tiny', or the hub's
        'facebook/sam2.1-hiera-tiny'), from genfast's cache (`genfast pull NAME` fills it)."""
        from genfast.sam.sam2.build import load_sam2

        return cls(load_sam2(model_id), **kwargs)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def image_size(self) -> int:
        return self.model.image_size

    @property
    def num_maskmem(self) -> int:
        return self.model.config.num_maskmem

    # ---- the session -----------------------------------------------------------------------------

    @torch.inference_mode()
    def init_state(
        self,
        video_path: str | Path | VideoFrames,
        offload_video_to_cpu: bool = False,
        offload_state_to_cpu: bool = False,
        async_loading_frames: bool = False,
    ) -> InferenceState:
        """A tracking session on a video file or a folder of frames (or an open VideoFrames).
        offload_video_to_cpu and async_loading_frames do not apply (frames are streamed, none is
        kept on the device); offload_state_to_cpu keeps memories and masks in CPU memory."""
        video = video_path if isinstance(video_path, VideoFrames) else open_video(video_path)
        device = self.device
        state: InferenceState = {
            "images": StreamedFrames(video, self.image_size, device),
            "video": video,
            "num_frames": video.num_frames,
            "video_height": video.height,
            "video_width": video.width,
            "device": device,
            "storage_device": torch.device("cpu") if offload_state_to_cpu else device,
            "offload_state_to_cpu": offload_state_to_cpu,
            "point_inputs_per_obj": {},
            "mask_inputs_per_obj": {},
            "cached_features": {},  # the current frame's only
            "constants": {},
            "obj_id_to_idx": OrderedDict(),
            "obj_idx_to_id": OrderedDict(),
            "obj_ids": [],
            "output_dict_per_obj": {},
            "temp_output_dict_per_obj": {},
            "frame_log_per_obj": {},
            "last_tracked_per_obj": {},
        }
        self._frame_features(state, 0)  # the frame most clicked first, encoded while the user looks
        return state

    def _obj_id_to_idx(self, state: InferenceState, obj_id: Any) -> int:
        """The object's index, a new one for a new id (objects may be added at any time)."""
        obj_idx = state["obj_id_to_idx"].get(obj_id)
        if obj_idx is not None:
            return obj_idx
        obj_idx = len(state["obj_id_to_idx"])
        state["obj_id_to_idx"][obj_id] = obj_idx
        state["obj_idx_to_id"][obj_idx] = obj_id
        state["obj_ids"] = list(state["obj_id_to_idx"])
        state["point_inputs_per_obj"][obj_idx] = {}
        state["mask_inputs_per_obj"][obj_idx] = {}
        state["output_dict_per_obj"][obj_idx] = _no_outputs()
        state["temp_output_dict_per_obj"][obj_idx] = _no_outputs()
        state["frame_log_per_obj"][obj_idx] = FrameLog(state["num_frames"])
        return obj_idx

    def _known_obj_idx(self, state: InferenceState, obj_id: Any) -> int:
        obj_idx = state["obj_id_to_idx"].get(obj_id)
        if obj_idx is None:
            raise UserError(f"there is no object with id {obj_id!r}; the objects are {state['obj_ids']}")
        return obj_idx

    @staticmethod
    def _check_frame(state: InferenceState, frame_idx: int) -> int:
        n = state["num_frames"]
        if isinstance(frame_idx, bool) or not isinstance(frame_idx, (int, np.integer)) or not 0 <= frame_idx < n:
            raise UserError(f"frame_idx {frame_idx!r} is out of range: the video has {n} frames, numbered 0 to {n - 1}")
        return int(frame_idx)

    # ---- prompts ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def add_new_points_or_box(
        self,
        inference_state: InferenceState,
        frame_idx: int,
        obj_id: Any,
        points: Sequence | np.ndarray | Tensor | None = None,
        labels: Sequence | np.ndarray | Tensor | None = None,
        clear_old_points: bool = True,
        normalize_coords: bool = True,
        box: Sequence | np.ndarray | Tensor | None = None,
    ) -> tuple[int, list, Tensor]:
        """Clicks (points [N, 2] as (x, y) with labels [N]: 1 foreground, 0 background) and/or a
        box (x0, y0, x1, y1) for one object on one frame, in the video's pixels (in [0, 1] with
        normalize_coords=False). With clear_old_points=False the clicks add to the frame's earlier
        ones. Returns (frame_idx, obj_ids, video_res_masks [num_objects, 1, H, W]): every object's
        mask logits on this frame."""
        state = inference_state
        frame_idx = self._check_frame(state, frame_idx)
        points, labels = self._prompt_points(state, frame_idx, points, labels, normalize_coords, box, clear_old_points)
        obj_idx = self._obj_id_to_idx(state, obj_id)
        point_inputs_per_frame = state["point_inputs_per_obj"][obj_idx]
        old = None if clear_old_points else point_inputs_per_frame.get(frame_idx)
        if old is not None:
            points = torch.cat([old["point_coords"], points], dim=1)
            labels = torch.cat([old["point_labels"], labels], dim=1)
        point_inputs = {"point_coords": points, "point_labels": labels}
        point_inputs_per_frame[frame_idx] = point_inputs
        state["mask_inputs_per_obj"][obj_idx].pop(frame_idx, None)
        return self._answer_prompt(state, obj_idx, frame_idx, point_inputs=point_inputs)

    def add_new_points(self, *args: Any, **kwargs: Any) -> tuple[int, list, Tensor]:
        """add_new_points_or_box under its older name (the official keeps it, deprecated)."""
        return self.add_new_points_or_box(*args, **kwargs)

    @torch.inference_mode()
    def add_new_mask(
        self, inference_state: InferenceState, frame_idx: int, obj_id: Any, mask: np.ndarray | Tensor
    ) -> tuple[int, list, Tensor]:
        """A mask [H, W] (bool or 0/1; any size, resized to the model's square) for one object on
        one frame, taken as the answer there. Returns what add_new_points_or_box returns."""
        state = inference_state
        frame_idx = self._check_frame(state, frame_idx)
        # As the official: a tensor is taken as it is, anything else as a boolean mask.
        mask = mask if isinstance(mask, Tensor) else torch.as_tensor(np.asarray(mask)).bool()
        if mask.dim() != 2:
            raise UserError(f"mask must be [H, W] (one object's mask on one frame), got shape {list(mask.shape)}")
        mask = mask.to(state["device"], torch.float32)[None, None]
        size = self.image_size
        if mask.shape[-2:] != (size, size):
            mask = F.interpolate(mask, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
            mask = (mask >= 0.5).float()
        obj_idx = self._obj_id_to_idx(state, obj_id)
        state["mask_inputs_per_obj"][obj_idx][frame_idx] = mask
        state["point_inputs_per_obj"][obj_idx].pop(frame_idx, None)
        return self._answer_prompt(state, obj_idx, frame_idx, mask_inputs=mask)

    def _prompt_points(
        self,
        state: InferenceState,
        frame_idx: int,
        points: Any,
        labels: Any,
        normalize_coords: bool,
        box: Any,
        clear_old_points: bool,
    ) -> tuple[Tensor, Tensor]:
        """Clicks and box as the decoder takes them: coords [1, N, 2] in the model's input pixels
        (the box first, as corners labelled 2 and 3), labels [1, N] int32, on the model's device."""
        if (points is None) != (labels is None):
            raise UserError("points and labels must be given together (one label per point)")
        if points is None and box is None:
            raise UserError("give points (with labels) or a box")
        coords = torch.zeros(1, 0, 2) if points is None else _cpu_tensor(points, torch.float32)
        tags = torch.zeros(1, 0, dtype=torch.int32) if labels is None else _cpu_tensor(labels, torch.int32)
        if coords.dim() == 2:
            coords = coords[None]
        if tags.dim() == 1:
            tags = tags[None]
        if coords.dim() != 3 or coords.shape[0] != 1 or coords.shape[2] != 2 or tuple(tags.shape) != coords.shape[:2]:
            raise UserError(
                f"points must be [N, 2] (x, y) with labels [N]; got shapes {list(coords.shape)} and {list(tags.shape)}"
            )
        w, h = (state["video_width"], state["video_height"]) if normalize_coords else (1, 1)
        outside = (coords < 0).any(-1) | (coords[..., 0] > w) | (coords[..., 1] > h)
        if outside.any():
            x, y = coords[outside][0].tolist()
            frame = f"the frame ({w}x{h} pixels)" if normalize_coords else "[0, 1] (normalize_coords=False)"
            raise UserError(f"point ({x:g}, {y:g}) on frame {frame_idx} is outside {frame}")
        if box is not None:
            if not clear_old_points:
                raise UserError("a box must come before any click: add it with clear_old_points=True")
            corners = _cpu_tensor(box, torch.float32)
            if corners.numel() != 4:
                raise UserError(f"box must be (x0, y0, x1, y1), got shape {list(corners.shape)}")
            coords = torch.cat([corners.reshape(1, 2, 2), coords], dim=1)
            tags = torch.cat([torch.tensor([[2, 3]], dtype=torch.int32), tags], dim=1)
        # Official arithmetic: divided by the video size, then scaled to the model's input.
        if normalize_coords:
            coords = coords / torch.tensor([state["video_width"], state["video_height"]])
        coords = coords * self.image_size
        return coords.to(state["device"]), tags.to(state["device"])

    def _answer_prompt(
        self,
        state: InferenceState,
        obj_idx: int,
        frame_idx: int,
        point_inputs: dict[str, Tensor] | None = None,
        mask_inputs: Tensor | None = None,
    ) -> tuple[int, list, Tensor]:
        """Decode the object's prompt on the frame (not yet remembered: memories are encoded when
        propagation starts), keep it as a temporary output, and return all objects' masks."""
        log = state["frame_log_per_obj"][obj_idx]
        # A frame not tracked yet is an initial conditioning frame (decoded without memory, as an
        # image); on a tracked frame the prompt corrects its answer, read with its memory.
        is_init_cond_frame = not log.is_tracked(frame_idx)
        reverse = False if is_init_cond_frame else log.is_reverse(frame_idx)
        is_cond = is_init_cond_frame or self.add_all_frames_to_correct_as_cond
        storage_key = "cond_frame_outputs" if is_cond else "non_cond_frame_outputs"
        output_dict = state["output_dict_per_obj"][obj_idx]
        temp_dict = state["temp_output_dict_per_obj"][obj_idx]

        prev_logits = None
        if point_inputs is not None:
            prev_out = self._previous_output(state, obj_idx, frame_idx, storage_key)
            if not is_init_cond_frame:
                held = prev_out is not None and prev_out["pred_masks"] is not None
                self._restore(state, [obj_idx], frame_idx, reverse, include_frame=not held)
                prev_out = self._previous_output(state, obj_idx, frame_idx, storage_key)
            if prev_out is not None and prev_out["pred_masks"] is not None:
                prev_logits = prev_out["pred_masks"].to(state["device"]).clamp(-PREV_LOGITS_BOUND, PREV_LOGITS_BOUND)
        out, _ = self._run_frame(
            state,
            output_dict,
            frame_idx,
            is_init_cond_frame,
            point_inputs,
            mask_inputs,
            reverse,
            run_mem_encoder=False,  # encoded when propagation starts, once the prompts are final
            prev_sam_mask_logits=prev_logits,
        )
        temp_dict[storage_key][frame_idx] = out
        masks = self._consolidate(state, frame_idx, is_cond)
        return frame_idx, list(state["obj_ids"]), self._video_res(state, masks)

    @staticmethod
    def _previous_output(state: InferenceState, obj_idx: int, frame_idx: int, storage_key: str) -> FrameOutput | None:
        """The object's latest answer on the frame: a temporary one first, then a remembered one."""
        out = state["temp_output_dict_per_obj"][obj_idx][storage_key].get(frame_idx)
        output_dict = state["output_dict_per_obj"][obj_idx]
        if out is None:
            out = output_dict["cond_frame_outputs"].get(frame_idx)
        if out is None:
            out = output_dict["non_cond_frame_outputs"].get(frame_idx)
        return out

    # ---- propagation -----------------------------------------------------------------------------

    @torch.inference_mode()
    def propagate_in_video_preflight(self, inference_state: InferenceState) -> None:
        """Encode the memories of the frames prompted since the last propagation, and make them
        the objects' conditioning (or corrected) frames."""
        state = inference_state
        if not state["obj_ids"]:
            raise UserError(
                "no object has prompts: add points, a box or a mask (add_new_points_or_box, add_new_mask) "
                "before propagating"
            )
        for obj_idx in range(len(state["obj_ids"])):
            output_dict = state["output_dict_per_obj"][obj_idx]
            temp_dict = state["temp_output_dict_per_obj"][obj_idx]
            log = state["frame_log_per_obj"][obj_idx]
            for storage_key in ("non_cond_frame_outputs", "cond_frame_outputs"):
                for frame_idx, out in temp_dict[storage_key].items():
                    if out["maskmem_features"] is None:
                        # The memory of the mask the user saw: the low-res answer (holes filled)
                        # brought back to the input size, binarized like a mask from clicks.
                        masks_high_res = F.interpolate(
                            out["pred_masks"].to(state["device"]),
                            size=(self.image_size, self.image_size),
                            mode="bilinear",
                            align_corners=False,
                        )
                        features, _ = self._frame_features(state, frame_idx)
                        memory, positions = self.tracker.encode_new_memory(
                            features[2], masks_high_res, out["object_score_logits"], is_mask_from_pts=True
                        )
                        out["maskmem_features"] = memory.to(MEMORY_DTYPE).to(state["storage_device"])
                        out["maskmem_pos_enc"] = self._shared_positions(state, positions)
                    output_dict[storage_key][frame_idx] = out
                    if storage_key == "non_cond_frame_outputs":
                        log.set_output(frame_idx, True)
                    if self.clear_non_cond_mem_around_input:
                        self._clear_non_cond_mem_around_input(state, obj_idx, frame_idx)
                temp_dict[storage_key].clear()
            if not output_dict["cond_frame_outputs"]:
                obj_id = state["obj_idx_to_id"][obj_idx]
                raise UserError(
                    f"object {obj_id!r} has no prompt left on any frame: add points, a box or a mask for it, "
                    "or remove it (remove_object)"
                )
            # A frame that became a conditioning frame is no longer a tracked one.
            for frame_idx in output_dict["cond_frame_outputs"]:
                output_dict["non_cond_frame_outputs"].pop(frame_idx, None)
                log.set_output(frame_idx, False)

    @torch.inference_mode()
    def propagate_in_video(
        self,
        inference_state: InferenceState,
        start_frame_idx: int | None = None,
        max_frame_num_to_track: int | None = None,
        reverse: bool = False,
    ) -> Iterator[tuple[int, list, Tensor]]:
        """Track every object through the video, from start_frame_idx (default: the earliest
        prompted frame) forwards, or backwards with reverse, over max_frame_num_to_track frames
        after the start (default: to the end). Yields (frame_idx, obj_ids, video_res_masks
        [num_objects, 1, H, W]) frame after frame."""
        state = inference_state
        self.propagate_in_video_preflight(state)
        num_frames, num_objects = state["num_frames"], len(state["obj_ids"])
        obj_ids = list(state["obj_ids"])
        outputs = [state["output_dict_per_obj"][i] for i in range(num_objects)]
        if start_frame_idx is None:
            start_frame_idx = min(t for out in outputs for t in out["cond_frame_outputs"])
        start_frame_idx = self._check_frame(state, start_frame_idx)
        if max_frame_num_to_track is None:
            max_frame_num_to_track = num_frames
        # The official's range: the start plus max_frame_num_to_track frames; backwards, nothing
        # when starting at frame 0.
        if reverse:
            end = max(start_frame_idx - max_frame_num_to_track, 0)
            order = range(start_frame_idx, end - 1, -1) if start_frame_idx > 0 else range(0)
        else:
            end = min(start_frame_idx + max_frame_num_to_track, num_frames - 1)
            order = range(start_frame_idx, end + 1)
        if len(order):
            tracked = [i for i in range(num_objects) if start_frame_idx not in outputs[i]["cond_frame_outputs"]]
            self._restore(state, tracked, start_frame_idx, reverse, include_frame=False)

        for frame_idx in order:
            masks: dict[int, Tensor] = {}
            for obj_idx in range(num_objects):
                cond_out = outputs[obj_idx]["cond_frame_outputs"].get(frame_idx)
                if cond_out is not None:
                    masks[obj_idx] = cond_out["pred_masks"].to(state["device"])
                    if self.clear_non_cond_mem_around_input:
                        self._clear_non_cond_mem_around_input(state, obj_idx, frame_idx)
                    state["last_tracked_per_obj"][obj_idx] = frame_idx
            tracked = [i for i in range(num_objects) if i not in masks]
            masks.update(zip(tracked, self._track_frames(state, tracked, frame_idx, reverse)))
            for obj_idx in range(num_objects):
                state["frame_log_per_obj"][obj_idx].set_tracked(frame_idx, reverse)
                self._retain(state, obj_idx)
            yield frame_idx, obj_ids, self._video_res(state, torch.cat([masks[i] for i in range(num_objects)]))

    def _track_frames(
        self, state: InferenceState, obj_indices: list[int], frame_idx: int, reverse: bool
    ) -> list[Tensor]:
        """Track objects on a frame from their memories (objects_per_batch at a time) and
        remember them (non-conditioning outputs); returns their low-res mask logits on the device."""
        if not obj_indices:  # every object prompted on this frame: its features may never be needed
            return []
        masks = []
        features, position = self._frame_features(state, frame_idx)
        for first in range(0, len(obj_indices), self.objects_per_batch):
            batch = obj_indices[first : first + self.objects_per_batch]
            output_dicts = [state["output_dict_per_obj"][i] for i in batch]
            outs = self.tracker.track_objects(
                frame_idx, features, position, output_dicts, state["num_frames"], track_in_reverse=reverse
            )
            for obj_idx, output_dict, out in zip(batch, output_dicts, outs):
                kept, pred_masks = self._kept_output(state, out)
                output_dict["non_cond_frame_outputs"][frame_idx] = kept
                state["frame_log_per_obj"][obj_idx].set_output(frame_idx, True)
                state["last_tracked_per_obj"][obj_idx] = frame_idx
                masks.append(pred_masks)
        return masks

    def _run_frame(
        self,
        state: InferenceState,
        output_dict: dict[str, dict[int, FrameOutput]],
        frame_idx: int,
        is_init_cond_frame: bool,
        point_inputs: dict[str, Tensor] | None,
        mask_inputs: Tensor | None,
        reverse: bool,
        run_mem_encoder: bool,
        prev_sam_mask_logits: Tensor | None = None,
    ) -> tuple[FrameOutput, Tensor]:
        """One object's tracking step on a frame: (what is kept of its output, its low-res mask
        logits on the device, holes filled)."""
        features, position = self._frame_features(state, frame_idx)
        points = None if point_inputs is None else (point_inputs["point_coords"], point_inputs["point_labels"])
        out = self.tracker.track_step(
            frame_idx,
            is_init_cond_frame,
            features,
            position,
            points,
            mask_inputs,
            output_dict,
            state["num_frames"],
            track_in_reverse=reverse,
            run_mem_encoder=run_mem_encoder,
            prev_sam_mask_logits=prev_sam_mask_logits,
        )
        return self._kept_output(state, out)

    def _kept_output(self, state: InferenceState, out: FrameOutput) -> tuple[FrameOutput, Tensor]:
        """What is kept of a tracking step's output, and its low-res mask logits on the device,
        holes filled."""
        pred_masks = out["pred_masks"]
        if self.fill_hole_area > 0:
            pred_masks = fill_holes(pred_masks, self.fill_hole_area)
        storage = state["storage_device"]
        memory = out["maskmem_features"]
        kept = {
            "maskmem_features": None if memory is None else memory.to(MEMORY_DTYPE).to(storage),
            "maskmem_pos_enc": None if memory is None else self._shared_positions(state, out["maskmem_pos_enc"]),
            "pred_masks": pred_masks.to(storage),
            "obj_ptr": out["obj_ptr"],
            "object_score_logits": out["object_score_logits"],
        }
        return kept, pred_masks

    @staticmethod
    def _shared_positions(state: InferenceState, positions: list[Tensor]) -> list[Tensor]:
        """The memory's positional encoding, the same for every frame and object: one copy kept."""
        constants = state["constants"]
        if "maskmem_pos_enc" not in constants:
            constants["maskmem_pos_enc"] = [p[:1].clone() for p in positions]
        return [p.expand(positions[0].shape[0], -1, -1, -1) for p in constants["maskmem_pos_enc"]]

    def _frame_features(self, state: InferenceState, frame_idx: int) -> tuple[list[Tensor], Tensor]:
        """The frame's image features (batch of one), computed when first needed; only the
        current frame's are kept."""
        cached = state["cached_features"].get(frame_idx)
        if cached is None:
            image = state["images"][frame_idx].to(self.model.dtype)[None]
            cached = self.model.forward_image(image)
            state["cached_features"] = {frame_idx: cached}
        return cached

    # ---- what is kept ----------------------------------------------------------------------------

    def _windows(self, state: InferenceState) -> tuple[int, int]:
        """(frames whose memories the tracker reads, frames whose object pointers it reads)."""
        pointers = min(state["num_frames"], self.model.config.max_obj_ptrs_in_encoder)
        return self.num_maskmem, pointers

    def _retain(self, state: InferenceState, obj_idx: int) -> None:
        """Drop the object's tracked outputs the tracker can no longer read (see the module's
        docstring): memories and masks beyond num_maskmem frames of the last tracked frame and of
        every conditioning frame; whole outputs beyond max_obj_ptrs_in_encoder frames."""
        output_dict = state["output_dict_per_obj"][obj_idx]
        anchors = list(output_dict["cond_frame_outputs"])
        last = state["last_tracked_per_obj"].get(obj_idx)
        if last is not None:
            anchors.append(last)
        memory_window, pointer_window = self._windows(state)
        non_cond = output_dict["non_cond_frame_outputs"]
        for frame_idx in list(non_cond):
            distance = min((abs(frame_idx - a) for a in anchors), default=state["num_frames"])
            if distance >= max(memory_window, pointer_window):
                del non_cond[frame_idx]
            elif distance >= memory_window and non_cond[frame_idx]["maskmem_features"] is not None:
                non_cond[frame_idx] = {
                    **non_cond[frame_idx],
                    "maskmem_features": None,
                    "maskmem_pos_enc": None,
                    "pred_masks": None,
                }

    def _is_missing(self, state: InferenceState, obj_idx: int, frame_idx: int, step: int, include_frame: bool) -> bool:
        """Whether the tracker, tracking the object on frame_idx in direction step (+1 or -1),
        would read an output the official holds but genfast dropped."""
        output_dict = state["output_dict_per_obj"][obj_idx]
        non_cond = output_dict["non_cond_frame_outputs"]
        log = state["frame_log_per_obj"][obj_idx]
        memory_window, pointer_window = self._windows(state)
        if include_frame and log.has_output(frame_idx):
            out = non_cond.get(frame_idx)
            if out is None or out["pred_masks"] is None:
                return True
        for distance in range(1, max(memory_window, pointer_window)):
            t = frame_idx - step * distance
            if not 0 <= t < state["num_frames"]:
                break
            if not log.has_output(t) or t in output_dict["cond_frame_outputs"]:
                continue
            out = non_cond.get(t)
            if out is None or (distance < memory_window and out["maskmem_features"] is None):
                return True
        return False

    def _restore(
        self, state: InferenceState, obj_indices: list[int], frame_idx: int, reverse: bool, include_frame: bool
    ) -> None:
        """Re-track the objects whose outputs near frame_idx (behind it in the direction of
        tracking; and on it, with include_frame) were dropped, from each one's nearest
        conditioning frame behind it, so the tracker reads there what the official would."""
        step = -1 if reverse else 1
        starts = {}
        for obj_idx in obj_indices:
            if not self._is_missing(state, obj_idx, frame_idx, step, include_frame):
                continue
            behind = [
                t for t in state["output_dict_per_obj"][obj_idx]["cond_frame_outputs"] if (t - frame_idx) * step < 0
            ]
            if behind:  # else nothing to re-track from: the tracker goes on with what is held
                starts[obj_idx] = max(behind, key=lambda t: t * step)
        if not starts:
            return
        first = min(starts.values(), key=lambda t: t * step)
        stop = frame_idx + step if include_frame else frame_idx
        for t in range(first + step, stop, step):
            due = [
                obj_idx
                for obj_idx, start in starts.items()
                if (t - start) * step > 0
                and t not in state["output_dict_per_obj"][obj_idx]["cond_frame_outputs"]
                and state["frame_log_per_obj"][obj_idx].has_output(t)
            ]
            self._track_frames(state, due, t, reverse)
            for obj_idx in due:
                self._retain(state, obj_idx)

    def _clear_non_cond_mem_around_input(self, state: InferenceState, obj_idx: int, frame_idx: int) -> None:
        """Forget the object's tracked frames around a prompted one, not the prompted frame itself
        (their memories may contradict the new prompt). The official calls this per-object variant
        but lacks it (1.1.0: the option fails there)."""
        non_cond = state["output_dict_per_obj"][obj_idx]["non_cond_frame_outputs"]
        log = state["frame_log_per_obj"][obj_idx]
        first, last = max(0, frame_idx - self.num_maskmem), min(state["num_frames"] - 1, frame_idx + self.num_maskmem)
        for t in range(first, last + 1):
            if t != frame_idx:
                non_cond.pop(t, None)
                log.set_output(t, False)

    # ---- masks for the user ----------------------------------------------------------------------

    def _consolidate(self, state: InferenceState, frame_idx: int, is_cond: bool) -> Tensor:
        """Every object's latest mask logits on the frame at the video's size, [num_objects, 1, H,
        W]: temporary (just prompted) outputs first, then remembered ones; NO_OBJECT_SCORE for
        an object without one."""
        storage_key = "cond_frame_outputs" if is_cond else "non_cond_frame_outputs"
        h, w = state["video_height"], state["video_width"]
        masks = torch.full(
            (len(state["obj_ids"]), 1, h, w), NO_OBJECT_SCORE, dtype=torch.float32, device=state["device"]
        )
        for obj_idx in range(len(state["obj_ids"])):
            out = self._previous_output(state, obj_idx, frame_idx, storage_key)
            if out is None or out["pred_masks"] is None:
                continue
            low_res = out["pred_masks"].to(state["device"])
            masks[obj_idx : obj_idx + 1] = F.interpolate(low_res, size=(h, w), mode="bilinear", align_corners=False)
        return masks

    def _video_res(self, state: InferenceState, masks: Tensor) -> Tensor:
        """Mask logits [B, 1, h, w] at the video's size (float32), with the non-overlap constraint
        when asked for."""
        size = (state["video_height"], state["video_width"])
        masks = masks.to(state["device"], torch.float32)
        if masks.shape[-2:] != size:
            masks = F.interpolate(masks, size=size, mode="bilinear", align_corners=False)
        return apply_non_overlapping_constraints(masks) if self.non_overlap_masks else masks

    # ---- removing prompts and objects ------------------------------------------------------------

    @torch.inference_mode()
    def clear_all_prompts_in_frame(
        self, inference_state: InferenceState, frame_idx: int, obj_id: Any, need_output: bool = True
    ) -> tuple[int, list, Tensor] | None:
        """Remove the object's prompts on a frame; a conditioning frame becomes a tracked one.
        Returns what add_new_points_or_box returns (nothing with need_output=False)."""
        state = inference_state
        frame_idx = self._check_frame(state, frame_idx)
        obj_idx = self._known_obj_idx(state, obj_id)
        state["point_inputs_per_obj"][obj_idx].pop(frame_idx, None)
        state["mask_inputs_per_obj"][obj_idx].pop(frame_idx, None)
        temp_dicts = state["temp_output_dict_per_obj"]
        temp_dicts[obj_idx]["cond_frame_outputs"].pop(frame_idx, None)
        temp_dicts[obj_idx]["non_cond_frame_outputs"].pop(frame_idx, None)
        output_dict = state["output_dict_per_obj"][obj_idx]
        out = output_dict["cond_frame_outputs"].pop(frame_idx, None)
        if out is not None:
            output_dict["non_cond_frame_outputs"][frame_idx] = out
            log = state["frame_log_per_obj"][obj_idx]
            log.set_output(frame_idx, True)
            log.untrack(frame_idx)
        if not need_output:
            return None
        is_cond = any(frame_idx in temp["cond_frame_outputs"] for temp in temp_dicts.values())
        masks = self._consolidate(state, frame_idx, is_cond)
        return frame_idx, list(state["obj_ids"]), self._video_res(state, masks)

    @torch.inference_mode()
    def reset_state(self, inference_state: InferenceState) -> None:
        """Remove every object and prompt (the video stays open)."""
        state = inference_state
        for key in (
            "obj_id_to_idx",
            "obj_idx_to_id",
            "point_inputs_per_obj",
            "mask_inputs_per_obj",
            "output_dict_per_obj",
            "temp_output_dict_per_obj",
            "frame_log_per_obj",
            "last_tracked_per_obj",
        ):
            state[key].clear()
        state["obj_ids"] = []

    @torch.inference_mode()
    def remove_object(
        self, inference_state: InferenceState, obj_id: Any, strict: bool = False, need_output: bool = True
    ) -> tuple[list, list[tuple[int, Tensor]]]:
        """Remove an object (an unknown id is ignored, or an error with strict). Returns the
        remaining object ids and, for each frame the object had prompts on, (frame_idx,
        video_res_masks) of the remaining objects there."""
        state = inference_state
        if obj_id not in state["obj_id_to_idx"]:
            if strict:
                self._known_obj_idx(state, obj_id)
            return list(state["obj_ids"]), []
        if len(state["obj_ids"]) == 1:
            self.reset_state(state)
            return [], []
        removed = state["obj_id_to_idx"][obj_id]
        prompted = sorted(set(state["point_inputs_per_obj"][removed]) | set(state["mask_inputs_per_obj"][removed]))
        for frame_idx in prompted:  # may turn conditioning frames into tracked ones, as the official
            self.clear_all_prompts_in_frame(state, frame_idx, obj_id, need_output=False)
        remaining = [i for i in range(len(state["obj_ids"])) if i != removed]
        new_ids = [state["obj_ids"][i] for i in remaining]
        state["obj_id_to_idx"] = OrderedDict((obj, i) for i, obj in enumerate(new_ids))
        state["obj_idx_to_id"] = OrderedDict(enumerate(new_ids))
        state["obj_ids"] = new_ids
        for key in (
            "point_inputs_per_obj",
            "mask_inputs_per_obj",
            "output_dict_per_obj",
            "temp_output_dict_per_obj",
            "frame_log_per_obj",
            "last_tracked_per_obj",
        ):
            old = state[key]
            state[key] = {new: old[i] for new, i in enumerate(remaining) if i in old}
        updated = []
        if need_output:
            temp_dicts = state["temp_output_dict_per_obj"]
            for frame_idx in prompted:
                is_cond = any(frame_idx in temp["cond_frame_outputs"] for temp in temp_dicts.values())
                updated.append((frame_idx, self._video_res(state, self._consolidate(state, frame_idx, is_cond))))
        return list(new_ids), updated
