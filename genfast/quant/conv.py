"""Dynamic int8 convolution: int8 weights x uint8 activations quantized at run time.

For the compute-bound convolutions of diffusion UNets and VAE decoders (the linears have
`QuantLinear(dynamic=True)`). Weights: symmetric int8, one scale per output channel, quantized
once. Activations: asymmetric uint8 with one scale and zero point per call (per tensor: the
convolution's reduction runs over neighbouring pixels, so a per-pixel scale cannot be factored
out of it), computed inside the graph; nothing is read on the host.

Kernel: oneDNN's int8 convolution (`torch.ops.onednn.qconv_pointwise`, AVX512-VNNI/AMX on x86),
the op inductor's own x86 quantization lowers to; it traces under torch.compile (fullgraph) with
the scale and zero point as tensors, and inductor fuses the activation quantization into the
preceding kernel. The op wants its weight prepacked into oneDNN's blocked layout, an opaque
(mkldnn) tensor that dynamo cannot serialize a guard on: a module holding one could not have its
compiled code saved. So the module holds plain tensors only and calls `genfast::int8_conv2d`,
which takes the int8 weight and finds its packed form in a cache keyed by that tensor (packed
once, again if the tensor is changed in place; dropped with it). Compiled code then has the plain
weight as an input and the op as an opaque call, and is saved like any other (the VAE decoder's
and a UNet's blocks with their convolutions in int8). Quantize after loading and after any dtype
or device change.

Range: on CPUs without VNNI (e.g. AVX2-only) oneDNN multiplies u8 x s8 with vpmaddubsw, which
sums pairs of products into int16 with saturation: full-range activations (255 * 127 * 2) would
overflow and give wrong outputs (measured on Zen 3: off by 0.31 on a largest output of 2.59). There
activations use 7 bits (0..127, as fbgemm's and PyTorch's x86 "reduce_range"), which cannot
saturate; where VNNI sums in int32 they use all 8.

Only CPU builds with oneDNN have this op. `reference_forward` computes the same quantized
product with a float convolution of the dequantized operands: the tests' oracle.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from genfast.nn import Fp32ProductsConv2d
from genfast.platform import hardware

ConvFilter = Callable[[str, nn.Conv2d], bool]  # (name, conv) -> True to keep it in floating point


def fewer_channels_than(min_channels: int) -> ConvFilter:
    """The int8-conv shape rule: a convolution stays in floating point when min(in_channels,
    out_channels) < `min_channels` (image and latent layers: little to gain, most of the error)."""

    def keep(name: str, conv: nn.Conv2d) -> bool:
        return min(conv.in_channels, conv.out_channels) < min_channels

    return keep


def supports(conv: nn.Conv2d) -> bool:
    """Whether DynamicInt8Conv2d can compute `conv`: groups 1 and numeric zero padding."""
    return conv.groups == 1 and conv.padding_mode == "zeros" and not isinstance(conv.padding, str)


def activation_levels() -> int:
    """Largest uint8 activation code: 255 where the CPU sums u8 x s8 products in int32 (VNNI,
    AMX), 127 where oneDNN's int16 pair sums would otherwise saturate (see the module notes)."""
    return 255 if hardware.has_vnni() else 127


def int8_conv_unavailable_reason(device: torch.device | str) -> str | None:
    """Why DynamicInt8Conv2d cannot run on `device`, or None if it can."""
    if torch.device(device).type != "cpu":
        return "int8 convolutions use oneDNN's CPU kernels (not available on CUDA here)"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.onednn, "qconv_pointwise"):
        return "this PyTorch build has no oneDNN int8 convolution"
    return None


# qweight -> (its version when packed, its packed form); an entry goes when its tensor does.
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def packed_weight(qweight: Tensor, weight_scale: Tensor, stride: list[int], padding: list[int],
                  dilation: list[int]) -> Tensor:  # fmt: skip
    """`qweight` prepacked for oneDNN's int8 convolution, packed on its first use and kept."""
    # A tensor made in inference mode has no version counter: one changed in place there keeps
    # its first packing.
    version = -1 if qweight.is_inference() else qweight._version
    entry = _PACKED.get(qweight)
    if entry is None or entry[0] != version:
        # The activation scale and zero point given to prepack do not change its result: the real
        # ones come with each call.
        packed = torch.ops.onednn.qconv_prepack(qweight, weight_scale, 1.0, 0, stride, padding, dilation, 1, None)
        entry = _PACKED[qweight] = (version, packed)
    return entry[1]


@torch.library.custom_op("genfast::int8_conv2d", mutates_args=())
def int8_conv2d(
    q: Tensor,
    scale: Tensor,
    zero_point: Tensor,
    qweight: Tensor,
    weight_scale: Tensor,
    weight_zero_point: Tensor,
    bias: Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    dtype: torch.dtype,
) -> Tensor:
    """oneDNN's int8 convolution of uint8 codes `q` (scale, zero point) by the int8 `qweight`
    (per-channel scales), its packed form from the cache; the output in `dtype`, channels-last."""
    packed = packed_weight(qweight, weight_scale, stride, padding, dilation)
    return torch.ops.onednn.qconv_pointwise.tensor(
        q, scale, zero_point, packed, weight_scale, weight_zero_point, bias, stride, padding, dilation, 1, 1.0, 0,
        dtype, "none", [], "",
    )  # fmt: skip


@int8_conv2d.register_fake
def _(q, scale, zero_point, qweight, weight_scale, weight_zero_point, bias, stride, padding, dilation,
      dtype):  # fmt: skip
    # The op's signature above types the arguments.
    n, _, h, w = q.shape
    size = [
        (length + 2 * pad - dil * (k - 1) - 1) // step + 1
        for length, pad, dil, k, step in zip((h, w), padding, dilation, qweight.shape[2:], stride)
    ]
    # oneDNN writes channels-last whatever the input's layout.
    return q.new_empty(n, qweight.shape[0], *size, dtype=dtype).contiguous(memory_format=torch.channels_last)


class DynamicInt8Conv2d(nn.Module):
    """A Conv2d (groups 1, zero padding) computing with int8 weights and uint8 activations."""

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        if not supports(conv):
            raise ValueError("DynamicInt8Conv2d supports groups=1 and numeric zero padding only")
        reason = int8_conv_unavailable_reason(conv.weight.device)
        if reason:
            raise ValueError(reason)
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.activation_levels = activation_levels()
        self.kernel_size = conv.kernel_size
        self.stride, self.padding, self.dilation = list(conv.stride), list(conv.padding), list(conv.dilation)
        w = conv.weight.detach().float()
        scale = (w.abs().amax(dim=(1, 2, 3)) / 127).clamp(min=1e-12)
        self.register_buffer("qweight", torch.round(w / scale[:, None, None, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_zero_point", torch.zeros_like(scale, dtype=torch.int32))
        self.register_buffer("bias", None if conv.bias is None else conv.bias.detach().float())
        packed_weight(self.qweight, scale, self.stride, self.padding, self.dilation)  # now, not in the first call

    @staticmethod
    def quantize_activation(x: Tensor, levels: int) -> tuple[Tensor, Tensor, Tensor]:
        """x ≈ (q - zero_point) * scale with q uint8 in [0, levels]; the range always includes 0
        (zero padding must stay exact)."""
        xf = x.float()
        low, high = xf.amin().clamp(max=0), xf.amax().clamp(min=0)
        scale = ((high - low) / levels).clamp(min=1e-12)
        zero_point = torch.round(-low / scale).to(torch.int32)
        q = (torch.round(xf / scale) + zero_point).clamp(0, levels).to(torch.uint8)
        return q, scale, zero_point

    def forward(self, x: Tensor) -> Tensor:
        q, scale, zero_point = self.quantize_activation(x, self.activation_levels)
        return int8_conv2d(
            q, scale, zero_point, self.qweight, self.weight_scale, self.weight_zero_point, self.bias,
            self.stride, self.padding, self.dilation, x.dtype,
        )  # fmt: skip

    def reference_forward(self, x: Tensor) -> Tensor:
        """The same quantized computation as fp32 arithmetic on the dequantized operands."""
        q, scale, zero_point = self.quantize_activation(x, self.activation_levels)
        xd = (q.float() - zero_point) * scale
        wd = self.qweight.float() * self.weight_scale[:, None, None, None]
        return F.conv2d(xd, wd, self.bias, self.stride, self.padding, self.dilation).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={tuple(self.kernel_size)}, "
            f"stride={tuple(self.stride)}, padding={tuple(self.padding)}, "
            f"int8 x uint{8 if self.activation_levels == 255 else 7}"
        )


def quantize_dynamic_int8_convs(model: nn.Module, keep: ConvFilter | None = None) -> list[str]:
    """Replace every nn.Conv2d of `model` (plain, or multiplying in fp32) that `keep` does not keep
    (and that DynamicInt8Conv2d supports) with a DynamicInt8Conv2d, in place; returns the names
    replaced."""
    targets = [
        (name, conv)
        for name, conv in model.named_modules()
        if type(conv) in (nn.Conv2d, Fp32ProductsConv2d)
        and supports(conv)
        and not (keep is not None and keep(name, conv))
    ]
    for name, conv in targets:
        model.set_submodule(name, DynamicInt8Conv2d(conv))
    return [name for name, _ in targets]
