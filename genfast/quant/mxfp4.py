"""MXFP4 expert weights kept as 4-bit codes (gpt-oss's experts), with a native decode kernel.

MXFP4 (OCP microscaling): blocks of 32 E2M1 values (4 bits: sign, 2 exponent bits, 1 mantissa bit:
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) sharing one E8M0 scale byte e, 2^(e - 127).
17 bytes per 32 weights (4.25 bits a weight).

Two storage orders of the same numbers come in:
- Hugging Face (gpt-oss's safetensors): `blocks` uint8 [..., N, K/32, 16], byte j holding element
  2j in its low nibble and 2j + 1 in its high one; `scales` uint8 [..., N, K/32].
- GGUF (ggml's block_mxfp4): per block 1 scale byte, then 16 bytes whose low nibbles are elements
  0-15 and high nibbles 16-31.

MXFP4ExpertLinear keeps them as one buffer in the native kernel's layout
(genfast/kernels/mxfp4_linear/ops.py: 17 bytes per 32 weights, as stored), on any device. On a CPU
where the kernel runs (AVX512-VNNI or AVX2) it multiplies from the codes with the activations
quantized to int8 per block of 32; elsewhere each present expert's weight is unpacked and
dequantized when used (the portable path, also the reference in tests).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from genfast.kernels.mxfp4_linear import ops as mxfp4_kernel
from genfast.nn import grouped_by_expert

BLOCK = 32
# E2M1 codes 0-15 (bit 3 the sign). gpt-oss's reference and transformers' converter use this table.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GGUF_BLOCK_BYTES = 1 + BLOCK // 2


def e8m0_to_float(scales: Tensor) -> Tensor:
    """E8M0 bytes -> 2^(e - 127) as fp32, built from the bits: e << 23, and 2^-127 (a denormal)
    for e = 0; e = 255 (NaN in the format) comes out as infinity."""
    e = scales.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    return bits.view(torch.float32)


def _check_hf(blocks: Tensor, scales: Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks must be [..., N, K/32, 16] and scales [..., N, K/32]; got {tuple(blocks.shape)} "
            f"and {tuple(scales.shape)}"
        )


def codes_from_hf(blocks: Tensor) -> Tensor:
    """HF blocks [..., K/32, 16] -> one code a byte [..., K/32, 32], in column order."""
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).reshape(*blocks.shape[:-1], BLOCK)


def hf_from_codes(codes: Tensor) -> Tensor:
    """Inverse of codes_from_hf."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def dequantize_codes(codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """Codes [..., N, K/32, 32] and scales [..., N, K/32] -> weights [..., N, K] in `dtype`
    (each value exact in fp32: a table value times a power of two)."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=codes.device)
    values = table[codes.long()] * e8m0_to_float(scales).unsqueeze(-1)
    return values.reshape(*scales.shape[:-1], -1).to(dtype)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """HF-layout MXFP4 (blocks uint8 [..., N, K/32, 16], low nibble the even element; scales uint8
    [..., N, K/32]) -> weights [..., N, K] in `dtype`."""
    _check_hf(blocks, scales)
    return dequantize_codes(codes_from_hf(blocks), scales, dtype)


def split_gguf(raw: Tensor) -> tuple[Tensor, Tensor]:
    """ggml block_mxfp4 rows [..., N, K/32 * 17] -> codes [..., N, K/32, 32] and scales [..., N, K/32]."""
    if raw.dtype != torch.uint8 or raw.shape[-1] % GGUF_BLOCK_BYTES:
        raise ValueError(f"GGUF MXFP4 data must be uint8 [..., N, K/32 * 17], got {raw.dtype} {tuple(raw.shape)}")
    view = raw.reshape(*raw.shape[:-1], raw.shape[-1] // GGUF_BLOCK_BYTES, GGUF_BLOCK_BYTES)
    scales, qs = view[..., 0], view[..., 1:]
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1), scales.contiguous()


def gguf_from_codes(codes: Tensor, scales: Tensor) -> Tensor:
    """Inverse of split_gguf: ggml's block_mxfp4 bytes [..., N, K/32 * 17]."""
    qs = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)
    return torch.cat([scales.unsqueeze(-1), qs], dim=-1).reshape(*scales.shape[:-1], -1).contiguous()


@torch.library.custom_op("genfast::mxfp4_expert_linear_dequantized", mutates_args=())
def mxfp4_expert_linear_dequantized(x: Tensor, experts: Tensor, packed: Tensor, out_features: int) -> Tensor:
    """The portable path: row r of `x` [R, K] times expert `experts[r]`'s weight (`packed` [E, bytes],
    the kernel's layout), each present expert's weight unpacked and dequantized to x's dtype."""

    def matmul(rows: Tensor, expert: int) -> Tensor:
        codes, scales = mxfp4_kernel.unpack(packed[expert], out_features, x.shape[1])
        return rows @ dequantize_codes(codes, scales, rows.dtype).T

    return grouped_by_expert(x, experts, out_features, matmul)


@mxfp4_expert_linear_dequantized.register_fake
def _mxfp4_expert_linear_dequantized_fake(x: Tensor, experts: Tensor, packed: Tensor, out_features: int) -> Tensor:
    return x.new_empty(x.shape[0], out_features)


class MXFP4ExpertLinear(nn.Module):
    """ExpertLinear over MXFP4 weights kept as codes: the experts' weights [E, out, in] as one
    uint8 buffer `packed` [E, bytes] in the native kernel's layout (no bias: gpt-oss's expert
    biases belong to the layer around it). A row reads only its own expert's codes.

    Not a genfast.nn.ExpertLinear (it has no `weight`): store_linear_weights and the int8/int4
    quantization steps leave it as it is; `dequantize` gives the floating-point weight."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, device: torch.device | str | None = None):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"MXFP4 in_features must be a multiple of {BLOCK}, got {in_features}")
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        bytes_per_expert = mxfp4_kernel.padded_rows(out_features) * in_features // BLOCK * GGUF_BLOCK_BYTES
        self.register_buffer("packed", torch.zeros(n_experts, bytes_per_expert, dtype=torch.uint8, device=device))
        self.register_buffer("bias", None)  # as QuantExpertLinear's, for code that serves both
        # Asked once here: the question builds the kernel (first use) and reads files, which
        # torch.compile cannot trace in forward.
        self.kernel_ready = mxfp4_kernel.available()

    @classmethod
    def from_codes(cls, codes: Tensor, scales: Tensor) -> MXFP4ExpertLinear:
        """From codes [E, N, K/32, 32] (one a byte, column order) and E8M0 scales [E, N, K/32]."""
        n_experts, out_features, blocks, _ = codes.shape
        layer = cls(n_experts, blocks * BLOCK, out_features, device="meta")
        layer.packed = mxfp4_kernel.pack(codes, scales)
        return layer

    @classmethod
    def from_hf(cls, blocks: Tensor, scales: Tensor) -> MXFP4ExpertLinear:
        """From gpt-oss's safetensors tensors: blocks [E, N, K/32, 16], scales [E, N, K/32] (uint8)."""
        _check_hf(blocks, scales)
        if blocks.dim() != 4:
            raise ValueError(f"expert MXFP4 blocks must be [experts, N, K/32, 16], got {tuple(blocks.shape)}")
        return cls.from_codes(codes_from_hf(blocks), scales)

    @classmethod
    def from_gguf(cls, raw: Tensor) -> MXFP4ExpertLinear:
        """From a GGUF MXFP4 expert tensor's bytes as [E, N, K/32 * 17] uint8."""
        if raw.dim() != 3:
            raise ValueError(f"GGUF MXFP4 expert data must be [experts, N, K/32 * 17], got {tuple(raw.shape)}")
        return cls.from_codes(*split_gguf(raw))

    def codes_and_scales(self) -> tuple[Tensor, Tensor]:
        """Codes [E, N, K/32, 32] and scales [E, N, K/32]."""
        return mxfp4_kernel.unpack(self.packed, self.out_features, self.in_features)

    def hf_tensors(self) -> tuple[Tensor, Tensor]:
        """The Hugging Face storage form: blocks [E, N, K/32, 16] and scales [E, N, K/32]."""
        codes, scales = self.codes_and_scales()
        return hf_from_codes(codes), scales.contiguous()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weights [E, out, in] in `dtype`."""
        return dequantize_codes(*self.codes_and_scales(), dtype)

    @property
    def native(self) -> bool:
        """Whether forward runs the native kernel (on a CPU where it is built)."""
        return self.packed.device.type == "cpu" and self.kernel_ready

    def forward(self, x: Tensor, experts: Tensor) -> Tensor:
        """x [R, in] and each row's expert [R] (int64) -> [R, out] in x's dtype."""
        if self.native:  # the kernel takes fp32 or bf16 rows
            rows = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
            return torch.ops.genfast.mxfp4_expert_linear(rows, experts, self.packed, self.out_features).to(x.dtype)
        return torch.ops.genfast.mxfp4_expert_linear_dequantized(x, experts, self.packed, self.out_features)

    def extra_repr(self) -> str:
        kernel = f"native-{mxfp4_kernel.KERNEL.loaded_isa()}" if self.native else "dequantize"
        shape = f"experts={self.n_experts}, in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, kernel={kernel}"
