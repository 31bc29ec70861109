"""Feature caching across denoising steps (DeepCache, Ma et al. 2023) for UNet2DConditionModel.

Between adjacent denoising steps the UNet's deep features change little. Every `interval` steps
the UNet runs in full and keeps the input of its last (highest-resolution) up block; on the steps
in between only the shallow path runs: conv_in, the first down block (for the skip connections),
the last up block on the cached deep features, and the output head. With interval 2 about half
of the denoiser's work is skipped on alternate steps. Quality cost: images drift from the uncached
ones (measured as PSNR in tests/diffusion; it is not an accuracy-preserving step).

A run starts when the pipeline calls `scheduler.set_timesteps` (DenoisingRuns, shared with the
transformers' block cache, genfast/diffusion/block_cache.py). The first step of every run is full.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from genfast.diffusion.pipelines import DenoiserWrapper

# UNet inputs the cached path does not implement (ControlNet/T2I-adapter residuals, masks, class labels).
_UNSUPPORTED = (
    "class_labels",
    "attention_mask",
    "encoder_attention_mask",
    "down_block_additional_residuals",
    "mid_block_additional_residual",
    "down_intrablock_additional_residuals",
)


class DenoisingRuns:
    """Tells a cache across denoising steps when a new run (a pipeline call) begins: every diffusers
    pipeline calls `scheduler.set_timesteps` once per call, and the scheduler then holds a new
    `timesteps` tensor, noticed by identity (a host-side check that reads no device value)."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler  # not a submodule: only its `timesteps` identity is read
        self._timesteps: Tensor | None = None  # kept alive, so its identity is not reused

    def new_run(self) -> bool:
        """Whether this denoiser call is the first of a new run."""
        timesteps = getattr(self._scheduler, "timesteps", None)
        if timesteps is self._timesteps:
            return False
        self._timesteps = timesteps
        return True


class DeepCacheUNet(DenoiserWrapper):
    """Wraps a UNet2DConditionModel; a pipeline uses it in place of its `unet`."""

    def __init__(self, unet: nn.Module, scheduler: Any, interval: int = 2) -> None:
        super().__init__(unet)
        if interval < 1:
            raise ValueError(f"feature-cache interval must be >= 1, got {interval}")
        if type(unet).__name__ != "UNet2DConditionModel":
            raise ValueError(f"feature caching is implemented for UNet2DConditionModel, not {type(unet).__name__}")
        if unet.config.addition_embed_type == "image_hint" or len(unet.up_blocks) < 2:
            raise ValueError("feature caching needs a UNet with >= 2 up blocks and no image-hint embedding")
        self.interval = interval
        self._runs = DenoisingRuns(scheduler)
        self._calls = 0
        self._deep: Tensor | None = None
        self._deep_key: tuple | None = None  # (input shape, dtype) the cached features belong to

    def _embeddings(
        self,
        sample: Tensor,
        timestep: Tensor,
        encoder_hidden_states: Tensor,
        timestep_cond: Tensor | None,
        added_cond_kwargs: dict | None,
    ) -> tuple[Tensor, Tensor]:
        """The time (+ class, + SDXL text/time-id) embedding and the processed text states, as in
        UNet2DConditionModel.forward."""
        unet = self.denoiser
        emb = unet.time_embedding(unet.get_time_embed(sample=sample, timestep=timestep), timestep_cond)
        class_emb = unet.get_class_embed(sample=sample, class_labels=None)
        if class_emb is not None:
            emb = torch.cat([emb, class_emb], dim=-1) if unet.config.class_embeddings_concat else emb + class_emb
        aug_emb = unet.get_aug_embed(
            emb=emb, encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=added_cond_kwargs
        )
        emb = emb + aug_emb if aug_emb is not None else emb
        if unet.time_embed_act is not None:
            emb = unet.time_embed_act(emb)
        encoder_hidden_states = unet.process_encoder_hidden_states(
            encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=added_cond_kwargs
        )
        return emb, encoder_hidden_states

    @staticmethod
    def _block(block: nn.Module, hidden: Tensor, emb: Tensor, text: Tensor, kwargs: dict | None, **extra: Any) -> Any:
        if getattr(block, "has_cross_attention", False):
            return block(
                hidden_states=hidden, temb=emb, encoder_hidden_states=text, cross_attention_kwargs=kwargs, **extra
            )
        return block(hidden_states=hidden, temb=emb, **extra)

    def forward(
        self,
        sample: Tensor,
        timestep: Tensor | float | int,
        encoder_hidden_states: Tensor,
        timestep_cond: Tensor | None = None,
        cross_attention_kwargs: dict | None = None,
        added_cond_kwargs: dict | None = None,
        return_dict: bool = True,
        **others: Any,
    ) -> Any:
        used = [name for name in _UNSUPPORTED if others.get(name) is not None]
        unknown = sorted(set(others) - set(_UNSUPPORTED))
        if used or unknown:
            raise ValueError(f"feature caching does not support the UNet inputs {', '.join(used + unknown)}")
        if self._runs.new_run():
            self._calls, self._deep = 0, None
        unet = self.denoiser
        up_factor = 2**unet.num_upsamplers
        forward_upsample_size = any(dim % up_factor for dim in sample.shape[-2:])
        if unet.config.center_input_sample:
            sample = 2 * sample - 1.0
        emb, text = self._embeddings(sample, timestep, encoder_hidden_states, timestep_cond, added_cond_kwargs)
        key = (tuple(sample.shape), sample.dtype)
        full = self._calls % self.interval == 0 or self._deep is None or self._deep_key != key
        self._calls += 1

        hidden = unet.conv_in(sample)
        res_samples: tuple[Tensor, ...] = (hidden,)
        for block in unet.down_blocks if full else unet.down_blocks[:1]:
            hidden, res = self._block(block, hidden, emb, text, cross_attention_kwargs)
            res_samples += res
        last = unet.up_blocks[-1]
        if full:
            if unet.mid_block is not None:
                if getattr(unet.mid_block, "has_cross_attention", False):
                    hidden = unet.mid_block(
                        hidden, emb, encoder_hidden_states=text, cross_attention_kwargs=cross_attention_kwargs
                    )
                else:
                    hidden = unet.mid_block(hidden, emb)
            for block in unet.up_blocks[:-1]:
                res = res_samples[-len(block.resnets) :]
                res_samples = res_samples[: -len(block.resnets)]
                upsample_size = res_samples[-1].shape[2:] if forward_upsample_size else None
                hidden = self._block(
                    block,
                    hidden,
                    emb,
                    text,
                    cross_attention_kwargs,
                    res_hidden_states_tuple=res,
                    upsample_size=upsample_size,
                )
            self._deep, self._deep_key = hidden, key
        else:
            hidden = self._deep
            res_samples = res_samples[: len(last.resnets)]
        hidden = self._block(
            last,
            hidden,
            emb,
            text,
            cross_attention_kwargs,
            res_hidden_states_tuple=res_samples[-len(last.resnets) :],
            upsample_size=None,
        )
        if unet.conv_norm_out:
            hidden = unet.conv_act(unet.conv_norm_out(hidden))
        out = unet.conv_out(hidden)
        if not return_dict:
            return (out,)
        from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

        return UNet2DConditionOutput(sample=out)
