"""Attention processors and fused QKV projections of diffusers models.

diffusers routes every `Attention` module through a processor object: `AttnProcessor` computes
softmax(QK^T)V explicitly (the seed's baseline), `AttnProcessor2_0` calls
`F.scaled_dot_product_attention` (flash / memory-efficient kernels), `FusedAttnProcessor2_0` does
the same from one fused QKV (self-attention) or KV (cross-attention) projection: one larger matmul
instead of three small ones.
"""

from __future__ import annotations

from torch import nn

ATTENTIONS = ("math", "sdpa")


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    from diffusers.models.attention_processor import Attention

    return [m for m in model.modules() if isinstance(m, Attention)]


def set_attention(model: nn.Module, attention: str) -> None:
    """Give every classic diffusers `Attention` of `model` the "math" (AttnProcessor) or "sdpa"
    (AttnProcessor2_0) processor. Models whose attention uses other processors (added-KV, or the
    newer AttentionModuleMixin models such as Flux) raise ValueError: swapping would change them."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0, FusedAttnProcessor2_0

    if attention not in ATTENTIONS:
        raise ValueError(f"unknown attention {attention!r}; choose one of {', '.join(ATTENTIONS)}")
    processors = getattr(model, "attn_processors", None)
    if not processors:
        return
    known = (AttnProcessor, AttnProcessor2_0, FusedAttnProcessor2_0)
    other = sorted({type(p).__name__ for p in processors.values() if not isinstance(p, known)})
    if other:
        raise ValueError(
            f"{type(model).__name__} uses attention processors {', '.join(other)}: "
            "genfast's math/sdpa steps only replace AttnProcessor / AttnProcessor2_0"
        )
    if any(getattr(m, "fused_projections", False) for m in _attention_modules(model)):
        raise ValueError("set the attention before fusing QKV projections (the fused processor is SDPA)")
    model.set_attn_processor(AttnProcessor() if attention == "math" else AttnProcessor2_0())


def fuse_qkv(model: nn.Module) -> None:
    """diffusers' `fuse_qkv_projections()`: adds `to_qkv` (self-attention) / `to_kv` (cross-attention)
    linears holding the concatenated weights, and switches to FusedAttnProcessor2_0. The separate
    `to_q/to_k/to_v` stay (diffusers' processors and unfusing use them)."""
    if not hasattr(model, "fuse_qkv_projections"):
        raise ValueError(f"{type(model).__name__} has no fuse_qkv_projections(): fused QKV does not apply")
    model.fuse_qkv_projections()


def unfuse_qkv(model: nn.Module) -> None:
    """Undo `fuse_qkv` exactly: the original processors come back (diffusers' unfuse) and the fused
    linears are removed (diffusers leaves them), so the state dict is the original one."""
    model.unfuse_qkv_projections()
    for attention in _attention_modules(model):
        for name in ("to_qkv", "to_kv", "to_added_qkv"):
            if hasattr(attention, name):
                delattr(attention, name)
        attention.fused_projections = False
