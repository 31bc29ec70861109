"""tinygemm's int4 layout, packed and unpacked with tensor ops (genfast/quant/tinygemm.py), against
a line-by-line transcription of aten's CUDA packing kernel; the layer's paths that need no GPU.
(Against aten's own op on a GPU: tests/cuda/test_llm.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from genfast.quant import tinygemm
from genfast.quant.grids import QuantizedWeight, quantize
from genfast.quant.linear import QuantLinear, rows_at_most


def aten_cuda_packing(codes: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """What aten's `matrix_to_m16n8k16_Bint4_layout` kernel (aten/src/ATen/native/cuda/int4mm.cu,
    NVIDIA branch) writes, one thread at a time: block (k outer tile, n tile), lane t, pairs of
    inner k-tiles; its input is the codes two per byte, even column in the high nibble."""
    n, k = codes.shape
    pairs = ((codes[:, 0::2] << 4) | codes[:, 1::2]).tolist()
    out = torch.zeros(n // 8, k // (16 * inner_k_tiles), 32, inner_k_tiles // 2, dtype=torch.int64)
    for k_outer in range(out.shape[1]):
        for n_tile in range(out.shape[0]):
            for t in range(32):
                for inner in range(0, inner_k_tiles, 2):
                    n0 = n_tile * 8 + t // 4
                    base0 = (k_outer * inner_k_tiles + inner) * 16 // 2
                    base1 = base0 + 16 // 2
                    ks = [base0 + t % 4, base0 + t % 4 + 4, base1 + t % 4, base1 + t % 4 + 4]
                    v = [pairs[n0][i] for i in ks]
                    word = (
                        ((v[3] & 0xF) << 28) | ((v[2] & 0xF) << 24) | ((v[1] & 0xF) << 20) | ((v[0] & 0xF) << 16)
                        | ((v[3] & 0xF0) << 8) | ((v[2] & 0xF0) << 4) | (v[1] & 0xF0) | ((v[0] & 0xF0) >> 4)
                    )  # fmt: skip
                    out[n_tile, k_outer, t, inner // 2] = word - (1 << 32) if word >= 1 << 31 else word
    return out.to(torch.int32)


@pytest.mark.parametrize("inner_k_tiles", [2, 4, 8])
def test_pack_lays_codes_out_as_aten_and_unpack_reads_them_back(inner_k_tiles):
    generator = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (24, 16 * inner_k_tiles * 3), dtype=torch.uint8, generator=generator)
    packed = tinygemm.pack(codes, inner_k_tiles)
    assert torch.equal(packed, aten_cuda_packing(codes, inner_k_tiles))
    assert torch.equal(tinygemm.unpack(packed), codes)


def test_aten_bytes_hold_the_even_column_in_the_high_nibble():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert tinygemm.aten_bytes(codes).tolist() == [[0x12, 0xF0]]


def test_scales_and_zeros_give_the_same_weights_within_bf16s_rounding():
    qweight = quantize(torch.randn(16, 128, generator=torch.Generator().manual_seed(2)), 4, 32)
    grid = tinygemm.scales_and_zeros(qweight.scales, qweight.mins).float()  # [groups, N, 2], bf16 values
    scale, zero = grid[..., 0].t().repeat_interleave(32, 1), grid[..., 1].t().repeat_interleave(32, 1)
    error = ((qweight.codes.float() - 8) * scale + zero - qweight.dequantize()).abs()
    # each of scale and zero rounded to bf16 (8 significant bits): half a unit, at most 2^-8 of the value
    assert (error <= (zero.abs() + 8 * scale) * 2**-8).all()


def layer(kernel: str) -> tuple[QuantLinear, QuantizedWeight]:
    qweight = quantize(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.05, 4, 32)
    return QuantLinear(qweight, kernel=kernel), qweight


def test_an_int4pack_layer_reads_its_canonical_form_back_and_runs_off_the_gpu():
    """The layout is the storage: the exact codes come back (checkpoints and tensor-parallel shards
    read them), and a CPU input dequantizes (tinygemm is CUDA's)."""
    qlinear, qweight = layer("int4pack")
    back = qlinear.quantized_weight()
    assert torch.equal(back.codes, qweight.codes) and torch.equal(back.scales, qweight.scales)
    x = torch.randn(5, 256)
    want = F.linear(x.double(), qweight.dequantize(torch.float64))
    assert ((qlinear(x).double() - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.parametrize("kernel", ["int4pack", "triton"])
def test_a_compiled_prefill_takes_one_path_for_every_length(kernel):
    """Row counts pick CUDA's few-row kernels; inside a compiled prefill the count is dynamic, and a
    pick on it would guard on it and compile again at each bound (16, 32, 64 rows): a dynamic count
    takes the dequantize path, whatever the length."""
    from torch._dynamo.testing import CompileCounter

    qlinear, qweight = layer(kernel)
    reference = qweight.dequantize(torch.float64)
    counter = CompileCounter()
    compiled = torch.compile(qlinear, backend=counter, fullgraph=True)
    for rows in (2, 5, 17, 40, 100):
        x = torch.randn(1, rows, 256)
        torch._dynamo.mark_dynamic(x, 1)
        want = F.linear(x.double(), reference)
        assert ((compiled(x).double() - want).norm() / want.norm()).item() < 1e-6
    assert counter.frame_count == 1


def test_rows_at_most_is_false_for_a_dynamic_length_without_guarding_it():
    assert rows_at_most(torch.zeros(3, 4, 8), 12) and not rows_at_most(torch.zeros(3, 5, 8), 12)

    def pick(x):
        return x + 1 if rows_at_most(x, 16) else x - 1

    static = torch.compile(pick, backend="eager", fullgraph=True, dynamic=False)
    assert static(torch.zeros(7, 8))[0, 0] == 1 and static(torch.zeros(20, 8))[0, 0] == -1  # by the count
    torch._dynamo.reset()
    x = torch.zeros(1, 7, 8)
    torch._dynamo.mark_dynamic(x, 1)
    assert torch.compile(pick, backend="eager", fullgraph=True)(x)[0, 0, 0] == -1  # 7 rows, but any length
