"""MXFP4: the number format, its two storage orders (Hugging Face, GGUF) and MXFP4ExpertLinear's
portable path (dequantize the present experts), against slow references written from the spec."""

import importlib.util

import pytest
import torch

from genfast.kernels.mxfp4_linear import ops as kernel
from genfast.quant.mxfp4 import (
    MXFP4ExpertLinear,
    codes_from_hf,
    dequantize_mxfp4,
    e8m0_to_float,
    gguf_from_codes,
    split_gguf,
)


def e2m1(code: int) -> float:
    """One E2M1 code from its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return sign * magnitude


def slow_dequantize_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Element 2j of a block from byte j's low nibble, 2j + 1 from its high one, times 2^(e - 127)."""
    n, nb, _ = blocks.shape
    out = torch.empty(n, nb * 32, dtype=torch.float64)
    for r in range(n):
        for b in range(nb):
            scale = 2.0 ** (int(scales[r, b]) - 127)
            for j in range(16):
                byte = int(blocks[r, b, j])
                out[r, 32 * b + 2 * j] = e2m1(byte & 15) * scale
                out[r, 32 * b + 2 * j + 1] = e2m1(byte >> 4) * scale
    return out


def slow_gguf_bytes(weights_codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """ggml's block_mxfp4 for one row: scale byte e, then qs[j] = element j | element (j + 16) << 4."""
    n, nb, _ = weights_codes.shape
    out = torch.empty(n, nb * 17, dtype=torch.uint8)
    for r in range(n):
        for b in range(nb):
            out[r, 17 * b] = scales[r, b]
            for j in range(16):
                out[r, 17 * b + 1 + j] = int(weights_codes[r, b, j]) | (int(weights_codes[r, b, j + 16]) << 4)
    return out


def random_mxfp4(*lead: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, n, k // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 132, (*lead, n, k // 32), dtype=torch.uint8, generator=g)
    return blocks, scales


def test_e2m1_table_matches_the_bit_layout():
    from genfast.quant.mxfp4 import FP4_VALUES

    assert [e2m1(c) for c in range(16)] == list(FP4_VALUES)


def test_e8m0_scales_are_exact_powers_of_two_including_the_denormal():
    e = torch.arange(0, 255, dtype=torch.uint8)
    got = e8m0_to_float(e).double()
    assert torch.equal(got, torch.tensor([2.0 ** (i - 127) for i in range(255)], dtype=torch.float64))
    assert got[0] > 0  # 2^-127, a denormal, not flushed to zero


def test_dequantize_matches_the_slow_reference():
    blocks, scales = random_mxfp4(n=5, k=96)
    scales[0, 0], scales[1, 1], scales[2, 2] = 0, 1, 140  # denormal scales and a large one
    got = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(got.double(), slow_dequantize_hf(blocks, scales))
    bf16 = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16.float(), got)  # every value fits bf16


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_dequantize_matches_transformers_converter():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4(3, n=40, k=128)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N]: transposed
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), want.transpose(1, 2))


def test_dequantize_rejects_mismatched_shapes():
    blocks, scales = random_mxfp4(n=4, k=64)
    with pytest.raises(ValueError, match="blocks must be"):
        dequantize_mxfp4(blocks, scales[:, :1], torch.float32)
    with pytest.raises(TypeError, match="uint8"):
        dequantize_mxfp4(blocks.int(), scales, torch.float32)


def test_gguf_split_matches_the_ggml_block_layout():
    blocks, scales = random_mxfp4(n=6, k=64)
    codes = codes_from_hf(blocks)
    raw = slow_gguf_bytes(codes, scales)
    assert torch.equal(gguf_from_codes(codes, scales), raw)
    got_codes, got_scales = split_gguf(raw)
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales)


def test_from_hf_and_from_gguf_hold_the_same_weights():
    blocks, scales = random_mxfp4(3, n=70, k=96)
    raw = torch.stack([slow_gguf_bytes(codes_from_hf(blocks[e]), scales[e]) for e in range(3)])
    a, b = MXFP4ExpertLinear.from_hf(blocks, scales), MXFP4ExpertLinear.from_gguf(raw)
    assert torch.equal(a.packed, b.packed)
    want = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(a.dequantize(), want) and torch.equal(b.dequantize(torch.float32), want)
    got_blocks, got_scales = a.hf_tensors()
    assert torch.equal(got_blocks, blocks) and torch.equal(got_scales, scales)


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_kernel_layout_round_trips_and_pads_with_zero_rows(n):
    blocks, scales = random_mxfp4(2, n=n, k=64)
    codes = codes_from_hf(blocks)
    packed = kernel.pack(codes, scales)
    assert packed.shape == (2, kernel.padded_rows(n) * 2 * 17)
    got_codes, got_scales = kernel.unpack(packed, n, 64)
    assert torch.equal(got_codes, codes) and torch.equal(got_scales, scales)
    padded_codes, _ = kernel.unpack(packed, kernel.padded_rows(n), 64)
    assert not padded_codes[:, n:].any()


def test_constructor_checks():
    with pytest.raises(ValueError, match="multiple of 32"):
        MXFP4ExpertLinear(2, 48, 16)
    with pytest.raises(ValueError, match="experts, N"):
        MXFP4ExpertLinear.from_hf(*random_mxfp4(n=4, k=64))
    with pytest.raises(ValueError, match="GGUF"):
        MXFP4ExpertLinear.from_gguf(torch.zeros(2, 4, 30, dtype=torch.uint8))


def reference(layer: MXFP4ExpertLinear, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    w = layer.dequantize(torch.float64)
    return torch.stack([w[e] @ x[i].double() for i, e in enumerate(experts.tolist())])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_portable_path_is_the_dequantized_product(dtype):
    blocks, scales = random_mxfp4(4, n=48, k=96)
    layer = MXFP4ExpertLinear.from_hf(blocks, scales)
    x = torch.randn(6, 96).to(dtype)
    experts = torch.tensor([3, 0, 3, 3, 1, 0])  # expert 2 unused, several rows on one
    got = torch.ops.genfast.mxfp4_expert_linear_dequantized(x, experts, layer.packed, 48)
    want = reference(layer, x, experts)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the weights are exact, the products round
    assert got.dtype == dtype
    assert ((got.double() - want).norm() / want.norm()).item() < tol


def test_forward_on_the_meta_device_gives_shapes():
    layer = MXFP4ExpertLinear(4, 64, 40, device="meta")
    out = layer(torch.empty(3, 64, device="meta"), torch.zeros(3, dtype=torch.long, device="meta"))
    assert out.shape == (3, 40)


def test_store_linear_weights_leaves_the_codes_alone():
    from torch import nn

    from genfast.nn import store_linear_weights

    layer = MXFP4ExpertLinear.from_hf(*random_mxfp4(2, n=16, k=32))
    before = layer.packed.clone()
    assert store_linear_weights(nn.Sequential(layer), torch.bfloat16) == 0
    assert torch.equal(layer.packed, before) and layer.packed.dtype == torch.uint8
