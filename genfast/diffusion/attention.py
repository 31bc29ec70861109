"""Attention implementations and fused QKV projections of diffusers models.

diffusers computes attention in one of two ways, and genfast's "math" (explicit softmax: the
baseline) and "sdpa" (`F.scaled_dot_product_attention`: flash / memory-efficient kernels) steps
choose within each without changing anything else:
- Processor objects on classic `Attention` modules (UNets, PixArt, VAEs, SD3): `AttnProcessor`
  computes softmax(QK^T)V by hand, `AttnProcessor2_0` calls SDPA and `FusedAttnProcessor2_0` does
  so from one fused QKV (self-attention) or KV (cross-attention) projection. SD3's joint attention
  has only an SDPA processor (`JointAttnProcessor2_0`; fused: genfast's `FusedJointAttention`, see
  `fuse_qkv`): its math form is that processor with SDPA restricted to its math backend.
- Attention backends of the newer `AttentionModuleMixin` modules (Flux): the module's processor
  calls diffusers' `dispatch_attention_fn` with the backend the processor holds; "_native_math"
  is SDPA's math backend, "native" plain SDPA. Each module's processor is set, never the model's
  `set_attention_backend`, which also changes diffusers' process-wide default backend.
SDPA's math backend is ATen's reference implementation: matmul, softmax, matmul.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ATTENTIONS = ("math", "sdpa")
BACKENDS = {"math": "_native_math", "sdpa": "native"}  # diffusers' attention backend names


@functools.cache  # one class: defined on first use, as diffusers is an optional dependency
def _joint_processor_classes() -> tuple[type, type]:
    """SD3's joint-attention processors: (math, sdpa)."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    class MathJointAttnProcessor(JointAttnProcessor2_0):
        """JointAttnProcessor2_0 with SDPA restricted to its math backend (explicit softmax). The
        signature is the parent's: diffusers passes a processor only the keywords it names."""

        def __call__(
            self,
            attn: Any,
            hidden_states: torch.Tensor,
            encoder_hidden_states: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)

    return MathJointAttnProcessor, JointAttnProcessor2_0


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """Every attention module of `model`: classic `Attention` and `AttentionModuleMixin` ones."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return [m for m in model.modules() if isinstance(m, (Attention, AttentionModuleMixin))]


def _uses_backends(module: nn.Module) -> bool:
    """Whether the module's processor dispatches through diffusers' attention backends (Flux)."""
    from diffusers.models.attention import AttentionModuleMixin

    processor = getattr(module, "processor", None)
    return isinstance(module, AttentionModuleMixin) and hasattr(processor, "_attention_backend")


def set_attention(model: nn.Module, attention: str) -> None:
    """Make every attention module of `model` compute by explicit softmax ("math") or SDPA ("sdpa"),
    each kind in its own way (module docstring). Processors of any other kind (added-KV, IP-adapter,
    a mix of kinds) raise ValueError: swapping them would change the model."""
    if attention not in ATTENTIONS:
        raise ValueError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTIONS)}")
    modules = _attention_modules(model)
    if not modules:
        return
    if any(getattr(m, "fused_projections", False) for m in modules):
        raise ValueError("set the attention before fusing QKV projections (the fused processors are SDPA)")
    if all(_uses_backends(m) for m in modules):
        for module in modules:
            module.set_attention_backend(BACKENDS[attention])
        return
    model.set_attn_processor(_processor(model, attention))


def _processor(model: nn.Module, attention: str) -> Any:
    """The one classic processor that gives all of `model`'s attention modules `attention`."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    math_joint, joint = _joint_processor_classes()
    kinds = {type(p) for p in model.attn_processors.values()}
    if kinds <= {AttnProcessor, AttnProcessor2_0}:
        return AttnProcessor() if attention == "math" else AttnProcessor2_0()
    if kinds <= {math_joint, joint}:
        return math_joint() if attention == "math" else joint()
    names = ", ".join(sorted(k.__name__ for k in kinds))
    raise ValueError(
        f"{type(model).__name__} uses attention processors {names}: genfast's math/sdpa steps replace "
        "AttnProcessor(2_0) and JointAttnProcessor2_0, or set the backend of AttentionModuleMixin modules"
    )


def fuse_qkv(model: nn.Module) -> None:
    """diffusers' `fuse_qkv_projections()`: adds `to_qkv` (self-attention) / `to_kv` (cross-attention)
    and, for joint attention (SD3, Flux), `to_added_qkv` linears holding the concatenated weights.
    Classic models switch to the fused SDPA processor; Flux's processor reads the fused linears
    itself and keeps its backend. SD3's gets `FusedJointAttention` instead of diffusers'
    FusedJointAttnProcessor2_0, which skips the q/k RMS norms of SD 3.5 and fails on its
    dual-attention layers' image-only attention. The separate projections stay (unfusing uses them)."""
    from diffusers.models.attention_processor import FusedJointAttnProcessor2_0

    if not hasattr(model, "fuse_qkv_projections"):
        raise ValueError(f"{type(model).__name__} has no fuse_qkv_projections(): fused QKV does not apply")
    model.fuse_qkv_projections()
    if any(isinstance(p, FusedJointAttnProcessor2_0) for p in model.attn_processors.values()):
        model.set_attn_processor(FusedJointAttention())


def _split_heads(x: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """A fused projection's output (batch, tokens, 3 * inner) as q, k, v of (batch, heads, tokens, head_dim)."""
    batch = x.shape[0]
    return [t.view(batch, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in x.chunk(3, dim=-1)]


class FusedJointAttention:
    """diffusers' JointAttnProcessor2_0 (SD3's attention), the same operations in the same order,
    with each stream's q, k and v from one fused linear (`to_qkv`, `to_added_qkv`)."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        tokens = hidden_states.shape[1]
        query, key, value = _split_heads(attn.to_qkv(hidden_states), attn.heads)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if encoder_hidden_states is not None:
            added_query, added_key, added_value = _split_heads(attn.to_added_qkv(encoder_hidden_states), attn.heads)
            if attn.norm_added_q is not None:
                added_query = attn.norm_added_q(added_query)
            if attn.norm_added_k is not None:
                added_key = attn.norm_added_k(added_key)
            query = torch.cat([query, added_query], dim=2)
            key = torch.cat([key, added_key], dim=2)
            value = torch.cat([value, added_value], dim=2)
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(out.shape[0], -1, out.shape[1] * out.shape[3]).to(query.dtype)
        if encoder_hidden_states is not None:
            out, encoder_out = out[:, :tokens], out[:, tokens:]
            if not attn.context_pre_only:
                encoder_out = attn.to_add_out(encoder_out)
        out = attn.to_out[1](attn.to_out[0](out))  # projection, dropout
        return out if encoder_hidden_states is None else (out, encoder_out)


def unfuse_qkv(model: nn.Module) -> None:
    """Undo `fuse_qkv` exactly: the original processors come back (diffusers' unfuse) and the fused
    linears are removed (diffusers leaves them on classic modules), so the state dict is the original one."""
    model.unfuse_qkv_projections()
    for attention in _attention_modules(model):
        for name in ("to_qkv", "to_kv", "to_added_qkv"):
            if hasattr(attention, name):
                delattr(attention, name)
        attention.fused_projections = False
