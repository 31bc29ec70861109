"""Batch-invariant computation: a token's logits are the same bits however its call was made.

Greedy decoding picks the largest logit, so two ways of computing the same logits that round
differently can pick different tokens where two are nearly tied (common in bf16). A server
computes a prompt's tokens in many ways: the whole prompt at once, in chunks, the rest after a
cached prefix, one token beside up to `max_batch` others, several at once to verify drafts. Each
row count makes GEMM libraries block their sums differently, and each cache length or thread
count makes attention split its keys differently.

Batch-invariant mode runs every linear layer and every attention through genfast's own kernels,
which sum in one order fixed by the shapes of the model alone (the few-row linear kernel for any
row count, a mixture's router included; the attention kernel's key chunks fixed in size and
combined in order), and which
never let one row, query or thread's share change another's sums. Everything else a decoder
computes is per row already (norms, rotary embedding, activations). So the same prompt gets the
same tokens alone, beside other requests, from a prefix cache or chunk by chunk, and under
speculative decoding.

It costs prefill speed where the kernels replace a tuned GEMM (docs/performance.md), and needs
what they take: a CPU with a variant, bf16 linear weights (what `--dtype auto` gives), in-features
a multiple of 32 and head sizes a multiple of 16, and a family whose attention is plain softmax
over the cache (no score soft-capping, no sliding-window ring).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from genfast.errors import UserError
from genfast.kernels.decode_attention import ops as attention_kernel
from genfast.kernels.linear_few_rows import ops as linear_kernel
from genfast.llm.model.layers import Attention
from genfast.llm.model.moe import Router
from genfast.nn import ExpertLinear, Linear
from genfast.quant.linear import QuantExpertLinear, QuantLinear

if TYPE_CHECKING:
    from torch import nn

    from genfast.llm.model.transformer import Transformer


def unavailable_reason(model: Transformer) -> str | None:
    """Why `model` cannot run batch-invariant here, or None when it can."""
    device = model.norm.weight.device
    if not all(isinstance(layer.attention, Attention) for layer in model.layers):
        return f"{model.args.family}'s attention (e.g. DeepSeek's latent attention) has no batch-invariant kernel yet"
    if device.type != "cpu":
        return f"batch-invariant kernels exist for CPUs only, not for {device.type} yet"
    why = linear_kernel.unavailable_reason() or attention_kernel.KERNEL.unavailable_reason()
    if why is not None:
        return why
    if any(isinstance(m, (QuantLinear, QuantExpertLinear)) for m in model.modules()):
        return "quantized (int8/int4) linear layers have no batch-invariant kernel yet; use bf16 weights"
    for module in (m for m in model.modules() if isinstance(m, (Linear, ExpertLinear))):
        if module.weight.dtype != torch.bfloat16:
            return f"linear weights must be bf16 (--dtype auto or bfloat16), not {str(module.weight.dtype)[6:]}"
        if module.in_features % linear_kernel.K_MULTIPLE:
            return f"a linear layer takes {module.in_features} features, not a multiple of {linear_kernel.K_MULTIPLE}"
    for module in model.modules():
        if not isinstance(module, Attention):
            continue
        if type(module).attend is not Attention.attend:
            return f"{model.args.family}'s attention computes its scores its own way (e.g. soft-capping)"
        if module.sliding_window is not None:
            return "sliding-window attention layers are not batch-invariant yet"
        if not attention_kernel.takes_head_dim(module.head_dim):
            return f"head size {module.head_dim} is not a multiple of {attention_kernel.HEAD_DIM_MULTIPLE}"
    return None


def make_batch_invariant(model: Transformer) -> None:
    """Switch every linear layer and attention of `model` to the batch-invariant kernels, in place;
    a UserError says why where it cannot run so."""
    why = unavailable_reason(model)
    if why is not None:
        raise UserError(f"--batch-invariant: {why}")
    for module in model.modules():
        if isinstance(module, (Linear, ExpertLinear, Attention, Router)):
            module.batch_invariant = True


def is_batch_invariant(model: nn.Module) -> bool:
    return any(getattr(m, "batch_invariant", False) for m in model.modules())
