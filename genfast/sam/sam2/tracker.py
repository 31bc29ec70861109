"""SAM 2's video tracking step: segment the objects of one frame from their prompts (if any) and
the memory of earlier frames, then encode the result into a memory for the frames that follow.

The official SAM2Base.track_step with the settings every official video model runs with
(build_sam2_video_predictor's): prompt masks are taken as the answer, the first prompted frame
gets the "no memory" embedding instead of memory attention, the memory holds every conditioning
(prompted) frame plus the num_maskmem - 1 frames before the current one (after it, in reverse),
and object pointers come from past frames only, up to max_obj_ptrs_in_encoder of them. Masks
decoded from clicks are binarized before they are remembered.

A frame's output is a dict with the official keys (pred_masks, pred_masks_high_res, obj_ptr,
object_score_logits, maskmem_features, maskmem_pos_enc, point_inputs, mask_inputs); the frames
seen so far are `output_dict = {"cond_frame_outputs": {frame: out}, "non_cond_frame_outputs":
{frame: out}}`, as the official video predictor keeps them, so its bookkeeping ports as it is.
Every tensor is batched over B objects of the same frame.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

from genfast.sam.sam2.modeling.model import Sam2
from genfast.sam.sam2.modeling.position import get_1d_sine_pe

FrameOutput = dict[str, Any]
# The logits a mask is turned into before the memory encoder: sigmoid(logits) * 20 - 10.
MASK_FOR_MEMORY_SCALE, MASK_FOR_MEMORY_BIAS = 20.0, -10.0
# Several candidate masks are decoded (the best kept) when a frame has at most one click.
MULTIMASK_MAX_POINTS = 1


def select_closest_cond_frames(
    frame_idx: int, cond_outputs: dict[int, FrameOutput], max_cond_frames: int
) -> tuple[dict[int, FrameOutput], dict[int, FrameOutput]]:
    """(selected, unselected) conditioning frames: all of them when max_cond_frames is -1 or not
    exceeded; else the closest before frame_idx, the closest at or after it, and the temporally
    closest others up to max_cond_frames."""
    if max_cond_frames == -1 or len(cond_outputs) <= max_cond_frames:
        return cond_outputs, {}
    if max_cond_frames < 2:
        raise ValueError(f"max_cond_frames must be -1 or at least 2, got {max_cond_frames}")
    chosen = []
    before = [t for t in cond_outputs if t < frame_idx]
    after = [t for t in cond_outputs if t >= frame_idx]
    if before:
        chosen.append(max(before))
    if after:
        chosen.append(min(after))
    rest = sorted((t for t in cond_outputs if t not in chosen), key=lambda t: abs(t - frame_idx))
    chosen += rest[: max_cond_frames - len(chosen)]
    selected = {t: cond_outputs[t] for t in chosen}
    return selected, {t: out for t, out in cond_outputs.items() if t not in selected}


def apply_non_overlapping_constraints(masks: Tensor) -> Tensor:
    """Masks [B, 1, H, W] of B objects of one frame: where an object is not the highest-scoring
    one, its logit is clamped to at most -10, so no pixel belongs to two objects."""
    if masks.shape[0] == 1:
        return masks
    winner = masks.argmax(dim=0, keepdim=True)
    objects = torch.arange(masks.shape[0], device=masks.device)[:, None, None, None]
    return torch.where(winner == objects, masks, masks.clamp(max=-10.0))


class Sam2Tracker:
    """The tracking step on a Sam2 model. The options are the official SAM2Base's evaluation
    settings of the same names; their defaults are those of the official video predictor."""

    def __init__(
        self,
        model: Sam2,
        max_cond_frames_in_attn: int = -1,
        memory_temporal_stride: int = 1,
        non_overlap_masks_for_mem_enc: bool = False,
        binarize_mask_from_pts_for_mem_enc: bool = True,
    ) -> None:
        self.model = model
        self.max_cond_frames_in_attn = max_cond_frames_in_attn
        self.memory_temporal_stride = memory_temporal_stride
        self.non_overlap_masks_for_mem_enc = non_overlap_masks_for_mem_enc
        self.binarize_mask_from_pts_for_mem_enc = binarize_mask_from_pts_for_mem_enc

    @property
    def num_maskmem(self) -> int:
        return self.model.config.num_maskmem

    def track_step(
        self,
        frame_idx: int,
        is_init_cond_frame: bool,
        features: list[Tensor],
        position: Tensor,
        point_inputs: tuple[Tensor, Tensor] | None,
        mask_inputs: Tensor | None,
        output_dict: dict[str, dict[int, FrameOutput]],
        num_frames: int,
        track_in_reverse: bool = False,
        run_mem_encoder: bool = True,
        prev_sam_mask_logits: Tensor | None = None,
    ) -> FrameOutput:
        """One frame's output (see the module's docstring).

        features, position: the frame's three levels and the 1/16 level's positional encoding as
            Sam2.forward_image returns them, [B, C, h, w] each, repeated (or expanded) over the B
            objects;
        point_inputs: (coords [B, N, 2] in input pixels, labels [B, N]) or None; mask_inputs:
            [B, 1, S, S] binary masks (then taken as the output) or None;
        is_init_cond_frame: the first prompted frame, which attends to no memory;
        prev_sam_mask_logits: low-res logits of an earlier answer on this frame, given to the
            decoder with new clicks.
        """
        model = self.model
        out: FrameOutput = {"point_inputs": point_inputs, "mask_inputs": mask_inputs}
        high_res = (features[0], features[1])
        if mask_inputs is not None:
            sam = model.use_mask_as_output(features[2], high_res, mask_inputs)
        else:
            pix_feat = self.memory_conditioned_features(
                frame_idx, is_init_cond_frame, features[2], position, output_dict, num_frames, track_in_reverse
            )
            if prev_sam_mask_logits is not None:
                if point_inputs is None:
                    raise ValueError("prev_sam_mask_logits come with new clicks (point_inputs)")
                mask_inputs = prev_sam_mask_logits
            sam = model.forward_sam_heads(
                pix_feat, point_inputs, mask_inputs, high_res, self.use_multimask(is_init_cond_frame, point_inputs)
            )
        out["pred_masks"] = sam["masks"]
        out["pred_masks_high_res"] = sam["masks_high_res"]
        out["obj_ptr"] = sam["obj_ptr"]
        out["object_score_logits"] = sam["object_score_logits"]
        if run_mem_encoder and self.num_maskmem > 0:
            out["maskmem_features"], out["maskmem_pos_enc"] = self.encode_new_memory(
                features[2], sam["masks_high_res"], sam["object_score_logits"], point_inputs is not None
            )
        else:
            out["maskmem_features"] = out["maskmem_pos_enc"] = None
        return out

    def use_multimask(self, is_init_cond_frame: bool, point_inputs: tuple[Tensor, Tensor] | None) -> bool:
        """Several candidate masks with no click or one: one click is ambiguous. (Official video
        models decode candidates on tracked frames too, so is_init_cond_frame does not matter.)"""
        num_points = 0 if point_inputs is None else point_inputs[1].shape[1]
        return num_points <= MULTIMASK_MAX_POINTS

    def track_objects(
        self,
        frame_idx: int,
        features: list[Tensor],
        position: Tensor,
        output_dicts: list[dict[str, dict[int, FrameOutput]]],
        num_frames: int,
        track_in_reverse: bool = False,
    ) -> list[FrameOutput]:
        """Several objects tracked on a frame without prompts, each from its own memory
        (output_dicts: one per object, batch of one): what track_step returns for each object on
        its own, computed as one batch through the decoder and the memory encoder, and one batch
        through memory attention per group of objects whose memories are equally long. (The
        objects' memories differ, so batching saves no arithmetic; it saves calls, and lets the
        small operations of one object fill both cores.)

        features, position: the frame's three levels and the 1/16 level's positional encoding,
        batch of one (shared by the objects).
        """
        model, count = self.model, len(output_dicts)
        if self.num_maskmem == 0:
            raise ValueError("tracking without prompts needs a memory (num_maskmem > 0)")
        feat = features[2].expand(count, -1, -1, -1)
        banks = [self.memory_bank(frame_idx, d, num_frames, track_in_reverse, features[2]) for d in output_dicts]
        pix_feat = self.attend_to_memories(feat, position.expand(count, -1, -1, -1), banks)
        high_res = tuple(f.expand(count, -1, -1, -1) for f in features[:2])
        sam = model.forward_sam_heads(pix_feat, None, None, high_res, self.use_multimask(False, None))
        memory, memory_pos = self.encode_new_memory(
            feat, sam["masks_high_res"], sam["object_score_logits"], is_mask_from_pts=False
        )
        outs = []
        for i in range(count):
            # Copies: a view would keep the whole batch alive as long as any one object's output.
            outs.append(
                {
                    "point_inputs": None,
                    "mask_inputs": None,
                    "pred_masks": sam["masks"][i : i + 1].clone(),
                    "pred_masks_high_res": sam["masks_high_res"][i : i + 1],
                    "obj_ptr": sam["obj_ptr"][i : i + 1].clone(),
                    "object_score_logits": sam["object_score_logits"][i : i + 1].clone(),
                    "maskmem_features": memory[i : i + 1].clone(),
                    "maskmem_pos_enc": [p[i : i + 1] for p in memory_pos],
                }
            )
        return outs

    def memory_conditioned_features(
        self,
        frame_idx: int,
        is_init_cond_frame: bool,
        feat: Tensor,
        pos: Tensor,
        output_dict: dict[str, dict[int, FrameOutput]],
        num_frames: int,
        track_in_reverse: bool = False,
    ) -> Tensor:
        """The frame's lowest-resolution features [B, C, h, w] (and positions) conditioned on the
        remembered frames and object pointers, [B, C, h, w]."""
        if self.num_maskmem == 0:
            return feat
        if is_init_cond_frame:  # nothing remembered yet: a learned embedding says so
            return feat + self.model.no_mem_embed.view(1, -1, 1, 1)
        bank = self.memory_bank(frame_idx, output_dict, num_frames, track_in_reverse, feat)
        return self.attend_to_memories(feat, pos, [bank])

    def memory_bank(
        self,
        frame_idx: int,
        output_dict: dict[str, dict[int, FrameOutput]],
        num_frames: int,
        track_in_reverse: bool,
        feat: Tensor,
    ) -> tuple[Tensor, Tensor, int]:
        """What the objects of output_dict (a batch of B) remember for this frame, as memory
        attention reads it: (memory [M, B, mem_dim], its positions [M, B, mem_dim], how many of
        the M tokens are object pointers, last). feat: the frame's features [B, C, h, w]."""
        model = self.model
        sign = -1 if track_in_reverse else 1
        cond_outputs = output_dict["cond_frame_outputs"]
        if not cond_outputs:
            raise ValueError(f"frame {frame_idx} is tracked before any frame was prompted")
        selected, unselected = select_closest_cond_frames(frame_idx, cond_outputs, self.max_cond_frames_in_attn)
        # Spatial memories: the conditioning frames (temporal position 0), then the last
        # num_maskmem - 1 frames, the earliest at position 1 and the previous frame at num_maskmem - 1.
        remembered = [(0, out) for out in selected.values()]
        for t_pos in range(1, self.num_maskmem):
            remembered.append((t_pos, self._memory_frame(frame_idx, t_pos, output_dict, unselected, sign)))
        memories, memory_positions = [], []
        for t_pos, prev in remembered:
            if prev is None:
                continue
            memories.append(prev["maskmem_features"].to(feat.device, feat.dtype).flatten(2).permute(2, 0, 1))
            spatial = prev["maskmem_pos_enc"][-1].to(feat.device, feat.dtype).flatten(2).permute(2, 0, 1)
            memory_positions.append(spatial + model.maskmem_tpos_enc[self.num_maskmem - t_pos - 1])

        pointers, pointer_positions = self._object_pointers(
            frame_idx, selected, unselected, output_dict, num_frames, track_in_reverse, feat.shape[0], feat
        )
        num_pointer_tokens = pointers[0].shape[0] if pointers else 0
        return (
            torch.cat(memories + pointers, dim=0),
            torch.cat(memory_positions + pointer_positions, dim=0),
            num_pointer_tokens,
        )

    def attend_to_memories(self, feat: Tensor, pos: Tensor, banks: list[tuple[Tensor, Tensor, int]]) -> Tensor:
        """Memory attention of the frame's features [B, C, h, w] (and positions) to the banks'
        memories (memory_bank's, batches that add up to B, in feat's order) -> [B, C, h, w].
        Banks of equal length (and pointer count) go through one call."""
        b, c, h, w = feat.shape
        sizes = [memory.shape[1] for memory, _, _ in banks]
        starts = list(itertools.accumulate(sizes, initial=0))
        if starts[-1] != b:
            raise ValueError(f"the memories are of {starts[-1]} objects, the features of {b}")
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (memory, _, num_pointers) in enumerate(banks):
            groups.setdefault((memory.shape[0], num_pointers), []).append(i)
        curr, curr_pos = feat.flatten(2).permute(2, 0, 1), pos.flatten(2).permute(2, 0, 1)  # [hw, B, C]
        conditioned: list[Tensor] = [curr] * len(banks)
        for (_, num_pointers), members in groups.items():
            group_curr, group_pos = curr, curr_pos
            if len(members) < len(banks):
                rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in members]).to(feat.device)
                group_curr, group_pos = curr.index_select(1, rows), curr_pos.index_select(1, rows)
            out = self.model.memory_attention(
                curr=group_curr,
                curr_pos=group_pos,
                memory=torch.cat([banks[i][0] for i in members], dim=1),
                memory_pos=torch.cat([banks[i][1] for i in members], dim=1),
                num_obj_ptr_tokens=num_pointers,
            )
            for i, part in zip(members, out.split([sizes[i] for i in members], dim=1)):
                conditioned[i] = part
        joined = conditioned[0] if len(conditioned) == 1 else torch.cat(conditioned, dim=1)
        return joined.permute(1, 2, 0).reshape(b, c, h, w)

    def _memory_frame(
        self,
        frame_idx: int,
        t_pos: int,
        output_dict: dict[str, dict[int, FrameOutput]],
        unselected: dict[int, FrameOutput],
        sign: int,
    ) -> FrameOutput | None:
        """The non-conditioning frame remembered at temporal position t_pos (None: not tracked).
        With a stride r > 1, the frames before the last one are taken every r-th frame."""
        t_rel = self.num_maskmem - t_pos  # frames before the current one
        r = self.memory_temporal_stride
        if t_rel == 1:
            prev = frame_idx - sign
        elif sign > 0:
            prev = ((frame_idx - 2) // r) * r - (t_rel - 2) * r
        else:
            prev = -(-(frame_idx + 2) // r) * r + (t_rel - 2) * r
        out = output_dict["non_cond_frame_outputs"].get(prev)
        # An unselected conditioning frame among the recent ones counts as a tracked frame.
        return out if out is not None else unselected.get(prev)

    def _object_pointers(
        self,
        frame_idx: int,
        selected: dict[int, FrameOutput],
        unselected: dict[int, FrameOutput],
        output_dict: dict[str, dict[int, FrameOutput]],
        num_frames: int,
        track_in_reverse: bool,
        batch: int,
        feat: Tensor,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """The past frames' object pointers as memory tokens [P * C/mem_dim, B, mem_dim] and their
        temporal positions (empty lists when there are none)."""
        model, config = self.model, self.model.config
        c, mem_dim = config.d_model, config.mem_dim
        max_pointers = min(num_frames, config.max_obj_ptrs_in_encoder)
        sign = -1 if track_in_reverse else 1
        # Conditioning frames' pointers, from the past only (never from frames still to come).
        offsets_and_pointers = [
            ((frame_idx - t) * sign if config.use_signed_tpos_enc_to_obj_ptrs else abs(frame_idx - t), out["obj_ptr"])
            for t, out in selected.items()
            if (t >= frame_idx if track_in_reverse else t <= frame_idx)
        ]
        # Then up to max_pointers - 1 frames before this one.
        for t_diff in range(1, max_pointers):
            t = frame_idx - sign * t_diff
            if t < 0 or t >= num_frames:
                break
            out = output_dict["non_cond_frame_outputs"].get(t, unselected.get(t))
            if out is not None:
                offsets_and_pointers.append((t_diff, out["obj_ptr"]))
        if not offsets_and_pointers:
            return [], []

        offsets, pointer_list = zip(*offsets_and_pointers)
        pointers = torch.stack(pointer_list).to(feat.device, feat.dtype)  # [P, B, C]
        if config.add_tpos_enc_to_obj_ptrs:
            # How far each pointer is from this frame, as a fraction of the farthest possible.
            t = torch.tensor(offsets, dtype=torch.float32, device=feat.device) / (max_pointers - 1)
            tpos = get_1d_sine_pe(t, c if config.proj_tpos_enc_in_obj_ptrs else mem_dim).to(feat.dtype)
            pointer_pos = model.obj_ptr_tpos_proj(tpos)[:, None, :].expand(-1, batch, mem_dim)
        else:
            pointer_pos = pointers.new_zeros(len(offsets), batch, mem_dim)
        if mem_dim < c:
            # A pointer is split into C / mem_dim memory tokens, one after another.
            split = c // mem_dim
            pointers = pointers.reshape(-1, batch, split, mem_dim).permute(0, 2, 1, 3).flatten(0, 1)
            pointer_pos = pointer_pos.repeat_interleave(split, dim=0)
        return [pointers], [pointer_pos]

    def encode_new_memory(
        self, feat: Tensor, masks_high_res: Tensor, object_score_logits: Tensor, is_mask_from_pts: bool
    ) -> tuple[Tensor, list[Tensor]]:
        """The frame's memory from its (raw) lowest-resolution features [B, C, h, w] and predicted
        mask logits [B, 1, S, S]: ([B, mem_dim, h, w], [its positions])."""
        model = self.model
        if self.non_overlap_masks_for_mem_enc:
            masks_high_res = apply_non_overlapping_constraints(masks_high_res)
        if self.binarize_mask_from_pts_for_mem_enc and is_mask_from_pts:
            # A mask from clicks is remembered as the user sees it, without its soft edges.
            mask = (masks_high_res > 0).float()
        else:
            mask = masks_high_res.sigmoid()
        mask = mask * MASK_FOR_MEMORY_SCALE + MASK_FOR_MEMORY_BIAS
        encoded = model.memory_encoder(feat, mask.to(feat.dtype), skip_mask_sigmoid=True)
        memory = encoded["vision_features"]
        if model.no_obj_embed_spatial is not None:
            # Frames where the object is absent (occluded) say so in their memory (2.1).
            absent = (object_score_logits <= 0).to(memory.dtype)[..., None, None]  # [B, 1, 1, 1]
            memory = memory + absent * model.no_obj_embed_spatial[..., None, None]
        return memory, encoded["vision_pos_enc"]
