"""Attention of one query per sequence over the KV cache (decode), by a native CPU kernel.

`torch.ops.genfast.decode_attention` (genfast/kernels/decode_attention.h) splits the cache into
chunks per KV head so that every thread streams its share once, dots each key with all the queries
of its group, and combines the chunks' softmaxes. Inductor's fused multiply-sums (the compiled
fallback, `Attention._decode_attention`) parallelize only over the KV heads and sum horizontally
per key: ~4 GB/s, a fifth of SmolLM2's decode step at 512 cached tokens on a 2-core Xeon;
SDPA's flash kernel (the eager fallback) is tiled for long queries (docs/performance.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from genfast.kernels import DECODE_ATTENTION

# The variants' vector widths (8 and 16 fp32 lanes) both divide the head sizes this accepts.
HEAD_DIM_MULTIPLE = 16

torch.library.define("genfast::decode_attention", "(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor")


@torch.library.register_fake("genfast::decode_attention")
def _decode_attention_fake(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    return q.new_empty(q.shape)


@torch.compiler.assume_constant_result  # run (and build the kernel) while tracing, not traced
def kernel_available() -> bool:
    return DECODE_ATTENTION.unavailable_reason() is None


def build_for(head_dim: int) -> None:
    """Build the kernel now (first use on this machine) where a model with heads of `head_dim` will
    call it: a load does this, so that the build does not land between the first streamed words."""
    if head_dim % HEAD_DIM_MULTIPLE == 0:
        kernel_available()


def applies(q: Tensor, keys: Tensor, mask: Tensor) -> bool:
    """Whether the kernel takes this call: one query per sequence on a CPU with a variant, fp32 or
    bf16 (q and the cache each), the head size a multiple of 16, a boolean mask of one row."""
    return (
        q.device.type == "cpu"
        and q.shape[2] == 1
        and mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[1] == mask.shape[2] == 1
        and q.shape[-1] % HEAD_DIM_MULTIPLE == 0
        and q.dtype in (torch.float32, torch.bfloat16)
        and keys.dtype in (torch.float32, torch.bfloat16)
        and kernel_available()
    )


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(scale * q k^T masked) v for q [B, H, 1, D] over keys and values [B, KV, L, D]
    (grouped heads: H a multiple of KV) and a boolean mask [B or 1, 1, 1, L]: [B, H, 1, D] in q's
    dtype, computed in fp32. Call it where `applies` says so (which also loads the kernel)."""
    return torch.ops.genfast.decode_attention(q, keys, values, mask, scale)
