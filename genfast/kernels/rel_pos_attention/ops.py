"""`torch.ops.genfast.rel_pos_attention`: attention over an H x W key grid with SAM's decomposed
relative-position bias added inside the kernel, never materialized (avx512.h explains it);
`torch.ops.genfast.attention`: the same kernel without a bias, queries and keys of any lengths
(SAM 2's Hiera and memory attention; long key sequences in chunks, with an online softmax), and
on request with either product on int8 codes (the AVX-512 variant only): the scores q . k (a
scale per query row and per key), the output P @ V (P's scale per query row and block of keys,
V's per block of keys and channel). The AVX-512 variant computes on bf16 inputs (`vdpbf16ps`, and
`vpdpbusd` for int8 products), or where bf16 dot products are slower than fp32 FMAs
(`hardware.fast_bf16_dot_products`) on fp32 FMAs of the bf16 operands widened in registers; the
AVX2 one in fp32, on float32 or bfloat16 inputs (CPUs without AVX512-BF16 run SAM in fp32). The
AMX variant is the AVX-512 one with both bf16 products on AMX-BF16's tiles (heads of a multiple of
32 channels; amx.cpp), where SDPA's products run on the tiles too: it matches SDPA on SAM 2's
attentions and beats it on SAM's (the bias) and the DiTs'. Where the AVX-512 variant is loaded on
a CPU with AMX (a GENFAST_ISA cap), SDPA beats it wherever there are more than a few keys
(`attention_pays`). `portable` is the same attention in PyTorch, with the bias materialized for
SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from genfast.kernels.native import Kernel, Variant
from genfast.platform import hardware

KERNEL = Kernel(
    "rel_pos_attention",
    "fused SAM attention kernel",
    (
        Variant("amx", ("avx512_bf16", "avx512_vnni", "amx_bf16"), ("-mavx512bf16", "-mavx512vnni", "-mamx-bf16")),
        Variant("avx512", ("avx512_bf16", "avx512_vnni"), ("-mavx512bf16", "-mavx512vnni")),
        Variant("avx2"),
    ),
    rank=3,
)

MAX_HEAD_DIM = 256  # rel_pos_attention.h
# What each variant computes on.
DTYPES = {"amx": (torch.bfloat16,), "avx512": (torch.bfloat16,), "avx2": (torch.float32, torch.bfloat16)}

torch.library.define(
    "genfast::rel_pos_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor rel_h, Tensor rel_w, float scale, bool fp32_products=False) -> Tensor",
)


torch.library.define(
    "genfast::attention",
    "(Tensor q, Tensor k, Tensor v, float scale, bool int8_scores=False, bool int8_values=False,"
    " bool fp32_products=False) -> Tensor",
)


@torch.library.register_fake("genfast::rel_pos_attention")
def _rel_pos_attention_fake(
    q: Tensor, k: Tensor, v: Tensor, rel_h: Tensor, rel_w: Tensor, scale: float, fp32_products: bool = False
) -> Tensor:
    b, heads, n, c = q.shape
    return q.new_empty(b, n, heads, c)


@torch.library.register_fake("genfast::attention")
def _attention_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    int8_scores: bool = False,
    int8_values: bool = False,
    fp32_products: bool = False,
) -> Tensor:
    b, heads, n, _ = q.shape
    return q.new_empty(b, n, heads, v.shape[-1])


def unavailable_reason() -> str | None:
    """Why the native kernel cannot be used here, or None when it is loaded and ready."""
    return KERNEL.unavailable_reason()


@torch.compiler.assume_constant_result  # torch.compile calls it once instead of tracing the build
def loaded_isa() -> str:
    """The ISA level of the loaded variant, "" when none is loaded."""
    return KERNEL.loaded_isa() or ""


def takes(dtype: torch.dtype) -> bool:
    """Whether the loaded variant computes on inputs of `dtype` (DTYPES); False when none is loaded."""
    return dtype in DTYPES.get(loaded_isa(), ())


def cpu_fallback_note(dtype: torch.dtype) -> str | None:
    """Why attention on CPU inputs of `dtype` runs by SDPA here instead of this kernel (none is
    loaded, or the loaded variant takes no `dtype`), or where it does in part (a CPU with AMX:
    `attention_pays`), for the recipes' notes; None when the kernel runs throughout."""
    reason = unavailable_reason()
    if reason:
        return f"fused kernel unavailable ({reason}): SDPA"
    if not takes(dtype):
        return f"the {loaded_isa()} kernel takes no {str(dtype).removeprefix('torch.')}: SDPA"
    if sdpa_for_many_keys():
        return f"AMX: attention without a bias over more than {AMX_ATTENTION_MAX_KEYS} keys by SDPA (on AMX's tiles)"
    return None


def supports(q: Tensor, value_dim: int | None = None) -> bool:
    """Whether the loaded kernel takes these queries ([..., N, C]), and values of value_dim
    channels (None: C): on a CPU, a dtype its variant computes in, both dims multiples of 16 up to
    MAX_HEAD_DIM."""
    dims = (q.shape[-1], q.shape[-1] if value_dim is None else value_dim)
    return q.device.type == "cpu" and all(not d % 16 and d <= MAX_HEAD_DIM for d in dims) and takes(q.dtype)


# Where the plain attention (`attention`) of the AVX2 variant, which computes in fp32, beats
# PyTorch's SDPA: on Hiera's global blocks (4096 keys, head dim 96), not on its windows (16-196
# keys), nor on the memory attention's one head of 256 channels, at 4096 keys or at 7 frames'
# 28.7K (where it holds all of a task's scores and re-reads K and V per 16 query rows, and SDPA's
# flash kernel streams them in blocks), nor with few queries (the mask decoder's 8 prompt tokens
# against 4096 image tokens, head dim 16, where it re-lays out K and V for a handful of rows).
# Measurements in docs/notes.md (SAM 2).
AVX2_ATTENTION_MIN_KEYS = 1024
AVX2_ATTENTION_MAX_KEYS = 4096
AVX2_ATTENTION_MAX_HEAD_DIM = 128
AVX2_ATTENTION_MIN_QUERIES = 1024


# Where the AVX-512 variant beats SDPA on a CPU with AMX-BF16 (the AMX variant not loaded: a
# GENFAST_ISA cap), whose SDPA computes its bf16 products on AMX's tiles (the variant takes bf16
# only): only with few keys, the mask decoder's image tokens against its few prompt tokens (even
# at 16 keys; SDPA ahead from a few dozen).
# Everywhere else SDPA is faster than the variant's products in fp32 and on int8 codes alike:
# Hiera's blocks, its windows, the memory attention. Measurements in docs/notes.md (AMX).
AMX_ATTENTION_MAX_KEYS = 16
AMX_TILE_CHANNELS = 32  # the AMX variant's tiles take heads of a multiple of this many channels (amx.cpp)


def sdpa_for_many_keys() -> bool:
    """Whether SDPA takes attention over more than AMX_ATTENTION_MAX_KEYS keys from the loaded
    variant: the AVX-512 one on a CPU with AMX-BF16 (above)."""
    return loaded_isa() == "avx512" and hardware.has_amx_bf16()


def attention_pays(queries: int, keys: int, head_dim: int, value_dim: int | None = None) -> bool:
    """Whether `attention` of `queries` query rows over `keys` keys (per batch entry and head) of
    `head_dim` channels, with values of value_dim channels (None: head_dim), beats SDPA in the
    loaded variant on this CPU (see above). The AMX variant computes heads of a multiple of
    AMX_TILE_CHANNELS on its tiles (as fast as SDPA or faster: docs/notes.md, AMX) and others as
    the AVX-512 variant does on a CPU with AMX."""
    if loaded_isa() == "amx":
        on_tiles = not head_dim % AMX_TILE_CHANNELS and not (value_dim or head_dim) % AMX_TILE_CHANNELS
        return on_tiles or keys <= AMX_ATTENTION_MAX_KEYS
    if loaded_isa() == "avx512":
        return not sdpa_for_many_keys() or keys <= AMX_ATTENTION_MAX_KEYS
    if loaded_isa() != "avx2":
        return True
    return (
        queries >= AVX2_ATTENTION_MIN_QUERIES
        and AVX2_ATTENTION_MIN_KEYS <= keys <= AVX2_ATTENTION_MAX_KEYS
        and head_dim <= AVX2_ATTENTION_MAX_HEAD_DIM
    )


def fp32_products() -> bool:
    """Whether the loaded variant's products that are not on int8 codes pay most as fp32 FMAs of
    the widened bf16 operands: in the AVX-512 variant where bf16 dot products (vdpbf16ps) are
    slower than fp32 FMAs (`hardware.fast_bf16_dot_products`: Intel's cores, AMX or not). The AVX2
    variant computes in fp32 anyway."""
    return loaded_isa() == "avx512" and not hardware.fast_bf16_dot_products()


def _readable(t: Tensor) -> Tensor:
    """t, or a contiguous copy where the kernel cannot read it: it reads channel pairs as 32-bit
    words, so it needs unit channel stride and even other strides."""
    if t.stride(-1) == 1 and not any(s % 2 for s in t.stride()[:-1]):
        return t
    return t.contiguous()


def rel_pos_attention(
    q: Tensor, k: Tensor, v: Tensor, rel_h: Tensor, rel_w: Tensor, scale: float, fp32: bool | None = None
) -> Tensor:
    """q, k, v: [B, heads, N, C] (any strides with unit channel stride) in a dtype `supports`; rel_h [B, heads, N, H]
    and rel_w [B, heads, N, W] with H * W = N. Returns [B, heads, N, C], a view of a
    [B, N, heads, C] tensor (see the C++ files). fp32: the products on fp32 FMAs (None: where
    `fp32_products`)."""
    q, k, v = (_readable(t) for t in (q, k, v))
    fp32 = fp32_products() if fp32 is None else fp32
    return torch.ops.genfast.rel_pos_attention(q, k, v, rel_h, rel_w, scale, fp32).transpose(1, 2)


def has_int8_products() -> bool:
    """Whether the loaded variant computes either product on int8 codes (the AVX-512 one:
    AVX512-VNNI; not the AMX one, whose bf16 products on the tiles are faster)."""
    return loaded_isa() == "avx512"


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    int8_scores: bool = False,
    int8_values: bool = False,
    fp32: bool | None = None,
) -> Tensor:
    """softmax(scale * q k^T) v for q [B, heads, Nq, C], k [B, heads, Nk, C] and v [B, heads, Nk,
    Cv] (as rel_pos_attention takes them, without the bias; scale > 0). Returns [B, heads, Nq,
    Cv], a view of a [B, Nq, heads, Cv] tensor. Where `has_int8_products`: int8_scores computes
    q k^T on int8 codes of q and k, each query row and key with its absmax scale; int8_values
    computes P @ V on u8 codes of P (a scale per query row and block of keys) and s8 codes of V (a
    scale per block of keys and channel). fp32: the products not on int8 codes on fp32 FMAs (None:
    where `fp32_products`)."""
    q, k, v = (_readable(t) for t in (q, k, v))
    fp32 = fp32_products() if fp32 is None else fp32
    return torch.ops.genfast.attention(q, k, v, scale, int8_scores, int8_values, fp32).transpose(1, 2)


def runs_on_kernel(q: Tensor, keys: int, value_dim: int) -> bool:
    """Whether `attention_or_sdpa` takes q [B, heads, Nq, C] over `keys` keys with values of
    value_dim channels to the native kernel: where it takes them (`supports`) and beats SDPA in
    the loaded variant (`attention_pays`)."""
    return supports(q, value_dim) and attention_pays(q.shape[-2], keys, q.shape[-1], value_dim)


def attention_or_sdpa(q: Tensor, k: Tensor, v: Tensor, int8_scores: bool = False, int8_values: bool = False) -> Tensor:
    """softmax(q k^T / sqrt(C)) v for q [B, heads, Nq, C], k [B, heads, Nk, C] and v [B, heads,
    Nk, Cv]: the native kernel where `runs_on_kernel`, else `F.scaled_dot_product_attention`.
    Returns [B, heads, Nq, Cv] (from the kernel, a view of a [B, Nq, heads, Cv] tensor).
    int8_scores, int8_values: ask the kernel for those products on int8 codes where it has them
    (`has_int8_products`); elsewhere they are as without."""
    if runs_on_kernel(q, k.shape[-2], v.shape[-1]):
        int8 = has_int8_products()
        return attention(q, k, v, q.shape[-1] ** -0.5, int8_scores and int8, int8_values and int8)
    return F.scaled_dot_product_attention(q, k, v)


def materialized_bias(rel_h: Tensor, rel_w: Tensor) -> Tensor:
    """The bias as one tensor [B, heads, N, H * W]: rel_h[..., i, r] + rel_w[..., i, c] for key (r, c)."""
    b, heads, n, grid_h = rel_h.shape
    return (rel_h[..., :, None] + rel_w[..., None, :]).reshape(b, heads, n, grid_h * rel_w.shape[-1])


def portable(q: Tensor, k: Tensor, v: Tensor, rel_h: Tensor, rel_w: Tensor, scale: float) -> Tensor:
    """The same attention in PyTorch, any device and dtype: SDPA with the bias materialized."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=materialized_bias(rel_h, rel_w), scale=scale)
