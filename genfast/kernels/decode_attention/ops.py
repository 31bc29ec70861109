"""`torch.ops.genfast.decode_attention`: attention of queries over the KV cache, one per sequence
(decode) or several (prefill, speculative verification).

The variants (decode_attention.h has the math) split the cache into chunks of fixed size per KV
head so that every thread streams its share once, dot each key with all the queries of its group,
and combine the chunks' softmaxes in chunk order. A query's output is bit for bit the same
whatever else shares the call (other sequences, other query positions, extra masked keys at the
end) and whatever the thread count: deterministic serving gets the same logits for a prompt
prefilled whole, in chunks or from a prefix cache. Where no variant runs, compiled decode takes
`portable`, the same math as multiply-sums that inductor fuses into a few loops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from genfast.kernels.native import Kernel, Variant

KERNEL = Kernel("decode_attention", "decode attention kernel", (Variant("avx512"), Variant("avx2")), rank=5)

# The variants' vector widths (8 and 16 fp32 lanes) both divide the head sizes this accepts.
HEAD_DIM_MULTIPLE = 16

torch.library.define("genfast::decode_attention", "(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor")


@torch.library.register_fake("genfast::decode_attention")
def _decode_attention_fake(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    return q.new_empty(q.shape)  # [B, H, S, D]: contiguous whatever q's strides, as the kernel's


@torch.compiler.assume_constant_result  # run (and build the kernel) while tracing, not traced
def kernel_available() -> bool:
    return KERNEL.unavailable_reason() is None


def takes_head_dim(head_dim: int) -> bool:
    return head_dim % HEAD_DIM_MULTIPLE == 0


def build_for(head_dim: int) -> None:
    """Build the kernel now (its first use on this machine) where a model with heads of `head_dim`
    will call it: a model's load does this, so that the build does not land between the first
    streamed words."""
    if takes_head_dim(head_dim):
        kernel_available()


def applies(q: Tensor, keys: Tensor, mask: Tensor) -> bool:
    """Whether the kernel takes this decode step where it is optional: on a CPU with a variant,
    fp32 or bf16 (q and the cache each), the head size a multiple of 16, one query per sequence
    and a boolean mask [B|1, 1, 1, L]. (The batch-invariant path calls the kernel for any number
    of queries, prefill included.)"""
    return (
        q.device.type == "cpu"
        and q.shape[2] == 1
        and mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[0] in (1, q.shape[0])
        and mask.shape[1] == 1
        and mask.shape[2] == 1
        and mask.shape[3] == keys.shape[2]
        and takes_head_dim(q.shape[-1])
        and q.dtype in (torch.float32, torch.bfloat16)
        and keys.dtype in (torch.float32, torch.bfloat16)
        and kernel_available()
    )


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """softmax(scale * q k^T masked) v for q [B, H, S, D] over keys and values [B, KV, L, D]
    (grouped heads: H a multiple of KV) and a boolean mask [B or 1, 1, S or 1, L], a row per query
    position (or one for all): [B, H, S, D] in q's dtype, computed in fp32. A query with no
    visible key gives zeros. Each query's result depends only on its vector, its mask row and the
    keys and values that row admits (bitwise; see the module). Call it where `applies` says so
    (which also loads the kernel)."""
    return torch.ops.genfast.decode_attention(q, keys, values, mask, scale)


def portable(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """The same attention in PyTorch, grouped by KV head (no KV repeat), in fp32, as multiply-sums
    (a sequence with no visible key gives NaN here, zeros in the kernel). For compiled code only,
    where it fuses into a few loops over the valid cache prefix: eagerly it would materialize the
    products. SDPA's CPU flash kernel, the eager path, is tiled for long queries and is slower
    than these loops for one."""
    bsz, heads, _, hd = q.shape
    kv_heads = keys.shape[1]
    qg = q.view(bsz, kv_heads, heads // kv_heads, 1, hd).float()
    scores = (qg * keys[:, :, None].float()).sum(-1) * scale  # [B, KV, G, L]
    scores = scores.masked_fill(~mask, float("-inf"))  # mask: [B|1, 1, 1, L]
    probs = scores.softmax(dim=-1)
    out = (probs[..., None] * values[:, :, None].float()).sum(-2)  # [B, KV, G, D]
    return out.to(q.dtype).view(bsz, heads, 1, hd)
