"""The attention implementations SAM's modules choose from (`set_attention`):

- "math": an explicit softmax over materialized scores, as the original segment-anything computes
  it (the baseline of the recipe);
- "sdpa": `F.scaled_dot_product_attention`, with the encoder's relative-position bias passed as
  a materialized float mask;
- "fused": for the encoder, the bias added inside the attention kernel, never materialized: on
  CPU the native kernel (genfast/kernels/rel_pos_attention/) where it applies (bf16 on AVX512-BF16,
  fp32 or bf16 on AVX2; head dim a multiple of 16), on CUDA "folded"; SDPA everywhere else. The
  mask decoder's attention (no bias), SAM 2's encoder (Hiera) and its memory attention take the
  same native kernel without a bias where it beats SDPA (`attention_or_sdpa`): PyTorch's CPU
  flash attention was 2-3x slower on Hiera's global blocks (bf16, 4096 keys, head dim 96), and
  slower on the decoder's cross-attentions of a batch of point prompts too (4096 image tokens, 8
  prompt tokens, head dim 16; docs/notes.md). There the decoder's attention first absorbs its
  projections into the few prompt tokens' side where that takes fewer FLOPs (transformer.py's
  `Attention`): the image tokens then need no projection of their own;
- "folded": for the encoder, one SDPA call with the bias folded into the scores' own product as
  extra dimensions (`folded_rel_pos_attention`): nothing of size N x N is materialized, and no
  score reads the bias tables on its own;
- "flex": for the encoder, FlexAttention with the bias as a score_mod that reads the two tables
  per score (Triton; the library's masking makes every sequence length correct). It was CUDA's
  "fused" until the folded product timed faster inside the compiled encoder: flex reads the
  tables per score, where the folded product is a tensor-core matmul;
- "auto" (the default): "fused".
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import flex_attention

from genfast.kernels.rel_pos_attention import ops as rel_pos_kernel

ATTENTION_IMPLS = ("auto", "math", "sdpa", "fused", "folded", "flex")


def check_attention_impl(impl: str) -> str:
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention implementation {impl!r}; choose one of {', '.join(ATTENTION_IMPLS)}")
    return impl


def attention(q: Tensor, k: Tensor, v: Tensor, impl: str) -> Tensor:
    """softmax(q k^T / sqrt(C)) v for [B, heads, N, C] inputs (the mask decoder's), where a batch
    of 1 broadcasts (one image for a batch of prompts): "fused" and "auto" on the native CPU
    kernel where it takes q and beats SDPA (`attention_or_sdpa`)."""
    if impl == "math":
        return ((q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)).softmax(dim=-1) @ v
    if impl in ("auto", "fused"):
        batch = max(q.shape[0], k.shape[0])
        # The kernel reads its inputs through their strides: a broadcast batch is a view, not a copy.
        q, k, v = (t.expand(batch, *t.shape[1:]) for t in (q, k, v))
        return rel_pos_kernel.attention_or_sdpa(q, k, v)
    return F.scaled_dot_product_attention(q, k, v)


def sam2_attention(q: Tensor, k: Tensor, v: Tensor, impl: str, int8: bool = False) -> Tensor:
    """SAM 2's attentions (Hiera's, and the memory attention's over a frame's memories):
    softmax(q k^T / sqrt(C)) v for q [B, heads, Nq, C], k [B, heads, Nk, C] and v [B, heads, Nk,
    Cv] (Cv other than C only where `runs_on_kernel`: SDPA's CPU flash kernel needs them equal).
    "fused"/"auto": the native kernel where it takes q (CPU) and beats SDPA (the AVX2 variant on
    Hiera's global blocks only), else SDPA; "math" the explicit softmax; the rest SDPA.
    int8: both of the kernel's products (q k^T, P v) on int8 codes where it has them
    (rel_pos_kernel.has_int8_products)."""
    if impl in ("auto", "fused"):
        return rel_pos_kernel.attention_or_sdpa(q, k, v, int8_scores=int8, int8_values=int8)
    return attention(q, k, v, impl)


def runs_on_kernel(q: Tensor, keys: int, value_dim: int, impl: str) -> bool:
    """Whether `sam2_attention` with `impl` runs q [B, heads, Nq, C] over `keys` keys, with values
    of value_dim channels, on the native kernel."""
    return impl in ("auto", "fused") and rel_pos_kernel.runs_on_kernel(q, keys, value_dim)


def rel_pos_attention(q: Tensor, k: Tensor, v: Tensor, rel_h: Tensor, rel_w: Tensor, impl: str) -> Tensor:
    """Attention over an H x W key grid with the decomposed relative-position bias: query i and
    key (r, c) get rel_h[..., i, r] + rel_w[..., i, c] added to their scaled score.

    q, k, v: [B, heads, N, C] with N = H * W; rel_h: [B, heads, N, H]; rel_w: [B, heads, N, W].
    """
    scale = q.shape[-1] ** -0.5
    if impl in ("auto", "fused") and rel_pos_kernel.supports(q):
        return rel_pos_kernel.rel_pos_attention(q, k, v, rel_h, rel_w, scale)
    if impl == "folded" or (impl in ("auto", "fused") and q.is_cuda):
        return folded_rel_pos_attention(q, k, v, rel_h, rel_w)
    if impl == "flex":
        return flex_rel_pos_attention(q, k, v, rel_h, rel_w)
    if impl == "math":
        bias = rel_pos_kernel.materialized_bias(rel_h, rel_w)
        return ((q * scale) @ k.transpose(-2, -1) + bias).softmax(dim=-1) @ v
    return rel_pos_kernel.portable(q, k, v, rel_h, rel_w, scale)


def flex_rel_pos_attention(q: Tensor, k: Tensor, v: Tensor, rel_h: Tensor, rel_w: Tensor) -> Tensor:
    """rel_pos_attention through FlexAttention: the bias is a score_mod reading the two tables."""
    grid_w = rel_w.shape[-1]

    def add_rel_pos(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + rel_h[b, h, q_idx, kv_idx // grid_w] + rel_w[b, h, q_idx, kv_idx % grid_w]

    # Outside torch.compile, flex_attention runs an unfused reference; compile it on its own.
    fn = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
    return fn(q, k, v, score_mod=add_rel_pos)


def folded_rel_pos_attention(q: Tensor, k: Tensor, v: Tensor, rel_h: Tensor, rel_w: Tensor) -> Tensor:
    """rel_pos_attention as one SDPA call whose query-key product carries the bias: each query row
    gains its rel_h and rel_w terms, each key (r, c) a one-hot of r and of c, so that

        [q * scale, rel_h[i], rel_w[i]] . [k, onehot(r), onehot(c)] = scale * q.k + rel_h[i, r] + rel_w[i, c]

    exactly (the extra terms are products with one and zero, summed in the kernel's accumulator).
    The scores' product grows from C to C + H + W dimensions (64 -> 192 for ViT's global blocks:
    the attention's FLOPs x2), against a bias of N x N values per head materialized ("sdpa") or
    gathered per score (FlexAttention's score_mod). The widths are padded to a multiple of 8,
    which SDPA's fused CUDA kernels need."""
    b, n_heads, n, c = q.shape
    grid_h, grid_w = rel_h.shape[-1], rel_w.shape[-1]
    extra = grid_h + grid_w
    pad = -(c + extra) % 8
    # Compared, not scattered: elementwise ops that compile into one kernel and never synchronize.
    keys = torch.arange(n, device=q.device)[:, None]
    slots = torch.arange(extra + pad, device=q.device)[None, :]
    one_hot = ((slots == keys // grid_w) | (slots == grid_h + keys % grid_w)).to(k.dtype)
    queries = torch.cat([q * c**-0.5, rel_h.to(q.dtype), rel_w.to(q.dtype), q.new_zeros(b, n_heads, n, pad)], dim=-1)
    keys_folded = torch.cat([k, one_hot.expand(b, n_heads, n, extra + pad)], dim=-1)
    return F.scaled_dot_product_attention(queries, keys_folded, v, scale=1.0)


@cache
def _compiled_flex_attention():
    # Static shapes: SAM has two (windows, global grid). With automatic dynamic shapes, the second
    # shape's compiled CPU kernel returned NaN on torch 2.13 (tests/sam/test_attention.py).
    return torch.compile(flex_attention, fullgraph=True, dynamic=False)


def set_attention(model: nn.Module, impl: str) -> None:
    """Make every SAM attention module in `model` use `impl`."""
    check_attention_impl(impl)
    for module in model.modules():
        if hasattr(module, "attention_impl"):
            module.attention_impl = impl
