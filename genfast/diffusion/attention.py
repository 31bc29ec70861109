"""Attention implementations and fused QKV projections of diffusers models.

diffusers computes attention in one of two ways, and genfast's "math" (explicit softmax: the
baseline) and "sdpa" (`F.scaled_dot_product_attention`: flash / memory-efficient kernels) steps
choose within each without changing anything else:
- Processor objects on classic `Attention` modules (UNets, PixArt, VAEs, SD3): `AttnProcessor`
  computes softmax(QK^T)V by hand, `AttnProcessor2_0` calls SDPA and `FusedAttnProcessor2_0` does
  so from one fused QKV (self-attention) or KV (cross-attention) projection. SD3's joint attention
  has only an SDPA processor (`JointAttnProcessor2_0`; fused: genfast's `JointAttention`, see
  `fuse_qkv`): its math form is that processor with SDPA restricted to its math backend.
- Attention backends of the newer `AttentionModuleMixin` modules (Flux): the module's processor
  calls diffusers' `dispatch_attention_fn` with the backend the processor holds; "_native_math"
  is SDPA's math backend, "native" plain SDPA. Each module's processor is set, never the model's
  `set_attention_backend`, which also changes diffusers' process-wide default backend.
SDPA's math backend is ATen's reference implementation: matmul, softmax, matmul.

The transformers' attention can also run on genfast's native CPU kernel (`use_attention_kernel`,
the recipe's fused-attention step): FLUX.1's modules and SD3's get processors of genfast's own
(`FluxAttention`, `JointAttention`) that make the same projections, norms and rotations as
diffusers' and call the kernel instead of SDPA where it takes the inputs.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ATTENTIONS = ("math", "sdpa")
BACKENDS = {"math": "_native_math", "sdpa": "native"}  # diffusers' attention backend names
# The denoisers whose attention `use_attention_kernel` moves to genfast's kernel.
KERNEL_DENOISERS = ("FluxTransformer2DModel", "SD3Transformer2DModel")


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
    itself and keeps its backend. SD3's gets genfast's `JointAttention` instead of diffusers'
    FusedJointAttnProcessor2_0, which skips the q/k RMS norms of SD 3.5 and fails on its
    dual-attention layers' image-only attention. The separate projections stay (unfusing uses them)."""
    from diffusers.models.attention_processor import FusedJointAttnProcessor2_0

    if not hasattr(model, "fuse_qkv_projections"):
        raise ValueError(f"{type(model).__name__} has no fuse_qkv_projections(): fused QKV does not apply")
    model.fuse_qkv_projections()
    if any(isinstance(p, FusedJointAttnProcessor2_0) for p in model.attn_processors.values()):
        model.set_attn_processor(JointAttention())


def use_attention_kernel(model: nn.Module) -> int:
    """Make FLUX.1's and SD3's attention call genfast's native kernel (SDPA where the kernel does
    not take the inputs: another device or dtype, a head dimension it has no code for): each Flux
    module gets `FluxAttention`, each SD3 module `JointAttention(kernel=True)`, fused projections
    or not. Returns how many modules changed: 0 for a model with neither (UNets, PixArt, VAEs). A
    module of those kinds with another processor (IP-adapter, ...) raises ValueError."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0
    from diffusers.models.transformers.transformer_flux import FluxAttention as DiffusersFluxAttention
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    changed = 0
    for module in _attention_modules(model):
        processor = getattr(module, "processor", None)
        if isinstance(module, DiffusersFluxAttention):
            replacement: Any = FluxAttention()
            accepted: tuple[type, ...] = (FluxAttnProcessor, FluxAttention)
        elif isinstance(processor, (JointAttnProcessor2_0, JointAttention)):
            replacement, accepted = JointAttention(kernel=True), (JointAttnProcessor2_0, JointAttention)
        else:
            continue
        if type(processor) not in accepted:
            raise ValueError(
                f"{type(module).__name__} uses {type(processor).__name__}: genfast's attention kernel replaces "
                f"{', '.join(k.__name__ for k in accepted)}"
            )
        if isinstance(processor, FluxAttnProcessor) and processor._attention_backend not in (None, "native"):
            raise ValueError(
                f"{type(module).__name__} computes with diffusers' {processor._attention_backend!r} backend: "
                "the attention kernel replaces SDPA ('native')"
            )
        module.set_processor(replacement)
        changed += 1
    return changed


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, tokens, heads * head_dim) as (batch, heads, tokens, head_dim)."""
    return x.view(x.shape[0], -1, heads, x.shape[-1] // heads).transpose(1, 2)


# Each stream's projections in diffusers' joint-attention modules: fused, and separate.
_IMAGE_PROJECTIONS = ("to_qkv", ("to_q", "to_k", "to_v"))
_TEXT_PROJECTIONS = ("to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj"))


def _projections(attn: Any, x: torch.Tensor, text: bool = False) -> list[torch.Tensor]:
    """q, k and v of one stream (the image's, or with `text` the added text stream's) as (batch,
    heads, tokens, head_dim): from its fused linear where the module's projections are fused."""
    fused, separate = _TEXT_PROJECTIONS if text else _IMAGE_PROJECTIONS
    if getattr(attn, "fused_projections", False):
        return [_heads(t, attn.heads) for t in getattr(attn, fused)(x).chunk(3, dim=-1)]
    return [_heads(getattr(attn, name)(x), attn.heads) for name in separate]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from genfast.kernels.rel_pos_attention.ops import attention_or_sdpa

    return attention_or_sdpa(q, k, v)


class JointAttention:
    """diffusers' JointAttnProcessor2_0 (SD3's attention), the same operations in the same order,
    with each stream's q, k and v from one fused linear (`to_qkv`, `to_added_qkv`) where the
    module's projections are fused, and the attention itself by SDPA or (`kernel`) genfast's
    native kernel (`attention_or_sdpa`). diffusers' fused processor for it,
    FusedJointAttnProcessor2_0, skips SD 3.5's q/k RMS norms (see `fuse_qkv`)."""

    def __init__(self, kernel: bool = False) -> None:
        self.kernel = kernel

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
        query, key, value = _projections(attn, hidden_states)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if encoder_hidden_states is not None:
            added_query, added_key, added_value = _projections(attn, encoder_hidden_states, text=True)
            if attn.norm_added_q is not None:
                added_query = attn.norm_added_q(added_query)
            if attn.norm_added_k is not None:
                added_key = attn.norm_added_k(added_key)
            query = torch.cat([query, added_query], dim=2)
            key = torch.cat([key, added_key], dim=2)
            value = torch.cat([value, added_value], dim=2)
        out = (_kernel if self.kernel else _sdpa)(query, key, value)
        out = out.transpose(1, 2).reshape(out.shape[0], -1, out.shape[1] * out.shape[3]).to(query.dtype)
        if encoder_hidden_states is not None:
            out, encoder_out = out[:, :tokens], out[:, tokens:]
            if not attn.context_pre_only:
                encoder_out = attn.to_add_out(encoder_out)
        out = attn.to_out[1](attn.to_out[0](out))  # projection, dropout
        return out if encoder_hidden_states is None else (out, encoder_out)


class FluxAttention:
    """diffusers' FluxAttnProcessor (FLUX.1's double- and single-stream attention), the same
    projections (fused or not), q/k RMS norms, text-then-image concatenation and rotary embedding,
    with the attention itself by genfast's native kernel (`attention_or_sdpa`) instead of
    diffusers' dispatcher."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> Any:
        from diffusers.models.embeddings import apply_rotary_emb

        if attention_mask is not None:
            raise ValueError("genfast's FLUX.1 attention takes no attention mask (FLUX.1 pipelines pass none)")
        joint = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        # (batch, heads, tokens, head_dim) throughout: the kernel's layout, and the rotary
        # embedding's default (diffusers' processor rotates (batch, tokens, heads, head_dim)).
        query, key, value = _projections(attn, hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        if joint:
            added_query, added_key, added_value = _projections(attn, encoder_hidden_states, text=True)
            added_query, added_key = attn.norm_added_q(added_query), attn.norm_added_k(added_key)
            query = torch.cat([added_query, query], dim=2)
            key = torch.cat([added_key, key], dim=2)
            value = torch.cat([added_value, value], dim=2)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=2)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=2)
        out = _kernel(query, key, value).transpose(1, 2).flatten(2, 3).to(query.dtype)
        if not joint:
            return out
        text_tokens = encoder_hidden_states.shape[1]
        encoder_out, out = out[:, :text_tokens], out[:, text_tokens:]
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))  # projection, dropout
        return out, attn.to_add_out(encoder_out.contiguous())


def unfuse_qkv(model: nn.Module) -> None:
    """Undo `fuse_qkv` exactly: the original processors come back (diffusers' unfuse) and the fused
    linears are removed (diffusers leaves them on classic modules), so the state dict is the original one."""
    model.unfuse_qkv_projections()
    for attention in _attention_modules(model):
        for name in ("to_qkv", "to_kv", "to_added_qkv"):
            if hasattr(attention, name):
                delattr(attention, name)
        attention.fused_projections = False
