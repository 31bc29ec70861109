"""Dynamic int8 convolution (oneDNN): the same numbers as its dequantized reference, a bounded
error against the float convolution, and compiled == eager with no recompile across sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from genfast.nn import Fp32ProductsConv2d, use_fp32_products
from genfast.quant.conv import DynamicInt8Conv2d, int8_conv_unavailable_reason, quantize_dynamic_int8_convs

pytestmark = pytest.mark.skipif(
    int8_conv_unavailable_reason("cpu") is not None, reason=str(int8_conv_unavailable_reason("cpu"))
)


def relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        dict(cin=64, cout=96, k=3, stride=1, padding=1, dilation=1, bias=True, hw=(20, 24)),
        dict(cin=48, cout=32, k=3, stride=2, padding=1, dilation=1, bias=False, hw=(17, 9)),
        dict(cin=32, cout=40, k=1, stride=1, padding=0, dilation=1, bias=True, hw=(8, 8)),
        dict(cin=16, cout=24, k=3, stride=1, padding=2, dilation=2, bias=True, hw=(11, 13)),
    ],
)
def test_matches_its_dequantized_reference_and_stays_close_to_float(dtype, shape):
    torch.manual_seed(0)
    conv = nn.Conv2d(
        shape["cin"],
        shape["cout"],
        shape["k"],
        stride=shape["stride"],
        padding=shape["padding"],
        dilation=shape["dilation"],
        bias=shape["bias"],
    ).to(dtype)
    q = DynamicInt8Conv2d(conv)
    x = torch.randn(2, shape["cin"], *shape["hw"], dtype=dtype)
    for layout in (torch.contiguous_format, torch.channels_last):
        x = x.contiguous(memory_format=layout)
        y = q(x)
        assert y.dtype == dtype and y.shape == conv(x).shape
        reference = q.reference_forward(x)
        # fp32: the int32 sums are exact, only the final scaling rounds; bf16: one output rounding.
        bound = 1e-5 if dtype == torch.float32 else 1e-2
        assert (y.float() - reference.float()).abs().max().item() <= bound * reference.float().abs().max().item()
        # int8 weights and uint8 activations on random data: ~1% RMS error (bf16 alone: ~0.3%).
        assert relative_rms(y, conv(x)) < 0.03


def test_zero_padding_stays_exact_for_all_positive_inputs():
    """The activation range always includes 0: padded zeros quantize to exactly 0."""
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 3, padding=1)
    q = DynamicInt8Conv2d(conv)
    x = torch.rand(1, 8, 6, 6) + 5.0  # all far from 0
    assert relative_rms(q(x), conv(x)) < 0.03


def test_compiled_equals_eager_and_new_sizes_do_not_recompile():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    q = DynamicInt8Conv2d(nn.Conv2d(32, 48, 3, padding=1).to(torch.bfloat16))
    compiled = torch.compile(q, fullgraph=True, dynamic=True)
    x = torch.randn(2, 32, 12, 16, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    assert torch.equal(compiled(x), q(x))
    graphs = counters["stats"]["unique_graphs"]
    for hw in ((16, 8), (20, 20)):
        x = torch.randn(2, 32, *hw, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        assert torch.equal(compiled(x), q(x))
    assert counters["stats"]["unique_graphs"] == graphs


def test_replacement_follows_the_filter_and_skips_unsupported_convs():
    model = nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.Conv2d(64, 64, 3, padding=1, groups=4),
        nn.Conv2d(64, 64, 3, padding="same"),
    )
    replaced = quantize_dynamic_int8_convs(model, keep=lambda name, conv: min(conv.in_channels, conv.out_channels) < 8)
    assert replaced == ["1"]
    assert isinstance(model[1], DynamicInt8Conv2d) and type(model[0]) is nn.Conv2d
    with pytest.raises(ValueError, match="groups=1"):
        DynamicInt8Conv2d(nn.Conv2d(8, 8, 3, groups=2))


def test_convolutions_multiplying_in_fp32_are_replaced_as_plain_ones():
    """The bf16 step's fp32-product convolutions (genfast.nn, on CPUs with slow bf16 products) are
    among those the int8-conv step replaces."""
    model = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.Conv2d(64, 64, 3, padding="same"))
    assert use_fp32_products(model) == 2
    assert quantize_dynamic_int8_convs(model) == ["0"]
    assert isinstance(model[0], DynamicInt8Conv2d) and type(model[1]) is Fp32ProductsConv2d


def test_no_int8_convolution_off_the_cpu():
    assert "CPU" in int8_conv_unavailable_reason("cuda")
    with pytest.raises(ValueError, match="CPU"):
        DynamicInt8Conv2d(nn.Conv2d(8, 8, 3, device="meta"))


def test_activations_use_seven_bits_where_int16_pair_sums_would_saturate(monkeypatch):
    """Without VNNI oneDNN sums u8 x s8 pairs in int16: 255 * 127 * 2 overflows, 127 * 127 * 2 does not."""
    from genfast.quant import conv as conv_module
    from tests.cpus import ZEN3, ZEN4, pretend_cpu

    pretend_cpu(monkeypatch, ZEN4)
    assert conv_module.activation_levels() == 255
    pretend_cpu(monkeypatch, ZEN3)
    assert conv_module.activation_levels() == 127
    q, _, zero_point = DynamicInt8Conv2d.quantize_activation(torch.randn(1, 4, 8, 8), 127)
    assert q.max() <= 127 and 0 <= zero_point.item() <= 127


def test_packed_once_repacked_after_an_in_place_change_and_dropped_with_the_weight():
    """The oneDNN-packed weight lives in a cache keyed by the int8 weight tensor, not in the module:
    packed when the module is made, reused by every call, packed again when the weight is changed
    in place (load_state_dict copies into it), and gone when the weight is."""
    import gc

    from genfast.quant import conv as int8_conv

    torch.manual_seed(0)
    q = DynamicInt8Conv2d(nn.Conv2d(16, 24, 3, padding=1))
    assert not any(isinstance(v, torch.Tensor) and v.layout == torch._mkldnn for v in vars(q).values())
    packed = int8_conv._PACKED[q.qweight][1]
    x = torch.randn(1, 16, 8, 8)
    before = q(x)
    assert int8_conv._PACKED[q.qweight][1] is packed
    other = DynamicInt8Conv2d(nn.Conv2d(16, 24, 3, padding=1))
    q.load_state_dict(other.state_dict())
    assert torch.equal(q(x), other(x)) and not torch.equal(q(x), before)
    with torch.inference_mode():  # its tensors have no version counter
        made_there = DynamicInt8Conv2d(nn.Conv2d(16, 24, 3, padding=1))
        inside = made_there(x)
    reference = made_there.reference_forward(x)
    for y in (inside, made_there(x)):
        assert (y - reference).abs().max().item() <= 1e-5 * reference.abs().max().item()
    count = len(int8_conv._PACKED)
    del q, other, made_there
    gc.collect()
    assert len(int8_conv._PACKED) == count - 3


def test_compiled_code_is_saved_and_loaded_by_a_module_with_other_weights():
    """Compiled code holds the int8 weight as an input and the convolution as an opaque call: it is
    saved, and a fresh module of the same shape (as in a later process) loads it and gets its own
    answer, equal to eager."""
    from genfast.compilation import saved as saved_compile
    from genfast.compilation.saved import compile_saved

    x = torch.randn(1, 32, 10, 12, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    events = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        block = nn.Sequential(DynamicInt8Conv2d(nn.Conv2d(32, 48, 3, padding=1).to(torch.bfloat16)), nn.SiLU()).eval()
        with torch.no_grad():
            expected = block(x)
            saved_compile._READY.clear()  # as a new process: nothing compiled in memory
            compile_saved(block, "int8 block", {}, {}, log=lambda message: None)
            got = block(x)
        events.append(block.forward.events[0])
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert events[0].startswith("compiled in") and events[1].startswith("loaded in"), events
