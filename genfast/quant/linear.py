"""QuantLinear: a linear layer over 8- or 4-bit weight codes (see `grids` for the number format).

Two uses: weight-only quantization (memory-bound decode: fewer bytes per weight) and dynamic int8
(compute-bound layers: int8 x int8 products; `dynamic=True`, per-channel int8 weights only).

Kernels, chosen once per layer from its device (`QuantLinear.kernel`):
- "native", CPU with AVX512-VNNI or AVX2: `torch.ops.genfast.qlinear` (genfast/kernels/qlinear/,
  the variant chosen at run time), for any number of rows, eager or compiled.
  Weight-only layers quantize activations to int8 per block of 32, dynamic ones per token; both
  variants compute the same integer sums.
- "int4pack", CUDA (compute capability 8.0+), int4 in groups of 32-256 with bf16 activations:
  torch's tinygemm kernel (`_weight_int4pack_mm`), which wants w = (u - 8) * scale + zero per group.
  In a compiled Llama-2-7B-shape decode step on an H100 it beat genfast's Triton GEMV each time
  the two ran side by side, so it is CUDA's int4 kernel wherever it applies, for up to
  `tinygemm.MAX_ROWS` rows; more (prefill) dequantize its layout (genfast/quant/tinygemm.py) and
  use cuBLAS.
- "triton", CUDA where Triton is installed (it ships with torch's CUDA wheels), weight-only int8
  and the int4 that tinygemm does not take (fp32 or fp16 activations, other group sizes):
  genfast/kernels/triton/qlinear.py reads the codes directly (int4 in a word layout of its own),
  one pass over the weight for up to 64 rows (int4 with more than one row: K in whole 128
  columns); longer inputs, and narrower int4, dequantize and use cuBLAS.
  Compiled prefill, whose length is dynamic, always takes the dequantize path (`rows_at_most`).
- "int8pack", CUDA without Triton, weight-only int8 with one scale per output channel: the codes
  as int8; one row (decode) under torch.compile is a fused multiply-sum that reads the int8 codes
  once (`row_linear`), more rows a matmul over the upcast codes. (torch's CUDA
  `_weight_int8pack_mm` streams a Llama-2-7B block an order of magnitude slower:
  benchmarks/cuda_linear.py.)
- "dequantize" elsewhere, weight-only: dequantize to the activation dtype and matmul. Under
  torch.compile a one-row input becomes a single fused loop that reads the codes (`row_linear`).
- dynamic int8 without the native kernel: activations quantized per token, `torch._int_mm`,
  rescaled; on a CPU without VNNI the same integer product in fp32 (`_int8_product`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from genfast.kernels.qlinear import ops as qlinear_kernel
from genfast.nn import DtypeAttribute, ExpertLinear, grouped_by_expert, row_linear
from genfast.platform import hardware
from genfast.quant import tinygemm
from genfast.quant.grids import QuantizedWeight, pack_nibbles, unpack_nibbles


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    return F.pad(t, (0, 0, 0, rows - t.shape[0])) if rows != t.shape[0] else t


def _kernel_rows(out_features: int) -> int:
    """Rows of the kernel's layout: out_features padded to whole row groups."""
    return -(-out_features // qlinear_kernel.ROW_GROUP) * qlinear_kernel.ROW_GROUP


def _pack(qweight: QuantizedWeight, rows: int) -> Tensor:
    """One weight's codes and grid ([N, ...]) in the kernel's layout, zero-padded to `rows`."""
    return qlinear_kernel.pack(
        *(_pad_rows(t, rows) for t in (qweight.codes, qweight.scales, qweight.mins)), qweight.bits
    )


def _unpack(packed: Tensor, bits: int, rows: int, n: int, k: int, group_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `_pack`: codes, scales and mins of the first `n` rows."""
    codes, scales, mins = qlinear_kernel.unpack(packed, bits, rows, k, group_size)
    return codes[:n], scales[:n], mins[:n]


# The Triton kernels' activations, and the most rows they take (more: dequantize and cuBLAS).
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_GEMM_ROWS = 64

KERNELS = ("native", "triton", "int4pack", "int8pack", "dequantize")  # see the module docstring


@cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def int4pack_fits(qweight: QuantizedWeight) -> bool:
    """Whether tinygemm takes this weight: int4, its group sizes and tiles, an Ampere or later GPU
    whose torch packs it as genfast reads it."""
    n, k = qweight.codes.shape
    device = qweight.codes.device
    return (
        qweight.bits == 4
        and tinygemm.fits(n, k, qweight.group_size)
        and torch.cuda.get_device_capability(device) >= (8, 0)
        and tinygemm.layout_matches(device)
    )


def choose_kernel(qweight: QuantizedWeight, dynamic: bool, dtype: torch.dtype | None = None) -> str:
    """The kernel a QuantLinear over `qweight` runs with activations of `dtype` (None: not known;
    see the module docstring)."""
    device = qweight.codes.device
    if device.type == "cpu":
        return "native" if qlinear_kernel.available() else "dequantize"
    if device.type != "cuda" or dynamic:
        return "dequantize"
    per_channel = qweight.group_size == qweight.codes.shape[1]
    return cuda_weight_only_kernel(qweight.bits, per_channel, dtype, int4pack_fits(qweight))


def cuda_weight_only_kernel(bits: int, per_channel: bool, dtype: torch.dtype | None, int4pack_ok: bool) -> str:
    """CUDA's weight-only kernel for a weight of `bits` (`per_channel`: one group per row) whose
    shape and GPU tinygemm takes (`int4pack_ok`, see int4pack_fits), under activations of `dtype`:
    choose_kernel's rule, which the LLM recipe also states before any weight is loaded."""
    if int4pack_ok and dtype == torch.bfloat16:
        return "int4pack"
    if triton_available():
        return "triton"
    if bits == 8 and per_channel:
        return "int8pack"
    return "int4pack" if int4pack_ok else "dequantize"


def rows_at_most(x: Tensor, most: int) -> bool:
    """Whether x has at most `most` rows (its size but the last dimension), known without a guard:
    inside a compiled prefill the prompt's length is a dynamic dimension, and a kernel picked by
    comparing it would guard on it, so that the prefill compiled again at each bound a prompt
    crosses (the Triton kernels' 16, 32 and 64 rows). A dynamic length takes the path for any
    length instead (dequantize, cuBLAS), and one prefill graph serves every prompt."""
    return statically_known_true(x.numel() // x.shape[-1] <= most)


class QuantLinear(nn.Module):
    """y = x @ dequantize(weight)^T + bias, from a QuantizedWeight (or `from_linear`)."""

    activation_dtype = DtypeAttribute()

    def __init__(
        self,
        qweight: QuantizedWeight,
        bias: Tensor | None = None,
        dynamic: bool = False,
        kernel: str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """`dtype`: the activations' (the model's) dtype, where known; the CUDA kernel depends on it.
        `kernel` overrides `choose_kernel` (tests and benchmarks compare the CUDA kernels)."""
        super().__init__()
        self.activation_dtype = dtype
        if dynamic and (qweight.bits != 8 or qweight.group_size != qweight.codes.shape[1]):
            raise ValueError("dynamic int8 needs 8-bit weights with one scale per output channel")
        self.dynamic = dynamic
        self.in_features, self.out_features = qweight.in_features, qweight.out_features
        self.bits, self.group_size = qweight.bits, qweight.group_size
        self.padded_in_features = qweight.codes.shape[1]
        if kernel is not None and kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; one of {', '.join(KERNELS)}")
        self.kernel = kernel or choose_kernel(qweight, dynamic, dtype)
        self.native = self.kernel == "native"
        # Buffers hold the kernel's layout; `quantized_weight()` gives back the canonical form.
        if self.native:
            self.padded_out_features = _kernel_rows(self.out_features)
            self.register_buffer("packed", _pack(qweight, self.padded_out_features))
        elif self.kernel == "int4pack":
            self.register_buffer("packed", tinygemm.pack(qweight.codes))
            self.register_buffer("scales_and_zeros", tinygemm.scales_and_zeros(qweight.scales, qweight.mins))
        elif self.kernel == "int8pack":
            self.register_buffer("weight_int8", (qweight.codes ^ 0x80).view(torch.int8).contiguous())  # u - 128
        elif self.kernel == "triton":
            from genfast.kernels.triton import qlinear as qlinear_triton

            self.register_buffer("codes", qlinear_triton.store_codes(qweight.codes, self.bits))
        else:
            codes = pack_nibbles(qweight.codes) if self.bits == 4 else qweight.codes
            self.register_buffer("codes", codes.contiguous())
        if not self.native:  # the grid, small; the int4pack kernel's copy is in bf16
            self.register_buffer("scales", qweight.scales.contiguous())
            self.register_buffer("mins", qweight.mins.contiguous())
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, bits: int, group_size: int | None = None, dynamic: bool = False
    ) -> QuantLinear:
        from genfast.quant.grids import quantize

        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(quantize(linear.weight, bits, group_size), bias, dynamic, dtype=linear.weight.dtype)

    def quantized_weight(self) -> QuantizedWeight:
        """The canonical (storage) form of this layer's weight."""
        n, k = self.out_features, self.padded_in_features
        if self.native:
            codes, scales, mins = _unpack(self.packed, self.bits, self.padded_out_features, n, k, self.group_size)
        elif self.kernel == "int4pack":
            codes = tinygemm.unpack(self.packed)
            scales, mins = self.scales, self.mins
        elif self.kernel == "int8pack":
            codes, scales, mins = self.weight_int8.view(torch.uint8) ^ 0x80, self.scales, self.mins
        elif self.kernel == "triton":
            from genfast.kernels.triton import qlinear as qlinear_triton

            codes, scales, mins = qlinear_triton.load_codes(self.codes, self.bits), self.scales, self.mins
        else:
            codes = unpack_nibbles(self.codes) if self.bits == 4 else self.codes
            scales, mins = self.scales, self.mins
        return QuantizedWeight(
            codes.contiguous(), scales.contiguous(), mins.contiguous(), self.bits, self.group_size, self.in_features
        )

    @property
    def channel_scales(self) -> Tensor:
        """Per-channel weights' scales [N] (int8, one group per row)."""
        return self.scales[:, 0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        if self.kernel == "int8pack":  # what the kernel computes: int8 codes times the channel's scale
            return (self.weight_int8.float() * self.channel_scales.float()[:, None])[:, : self.in_features].to(dtype)
        return self.quantized_weight().dequantize(dtype)

    def _rows(self, x: Tensor) -> Tensor:
        """x [..., in_features] as the kernels' rows [R, padded_in_features] (zero columns added)."""
        rows = x.reshape(-1, self.in_features)
        if self.padded_in_features != self.in_features:
            rows = F.pad(rows, (0, self.padded_in_features - self.in_features))
        return rows

    def _outputs(self, out: Tensor, x: Tensor) -> Tensor:
        """A kernel's [R, out_features] back in x's leading shape, plus the bias."""
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def forward(self, x: Tensor, activation: str = "none") -> Tensor:
        """x @ W^T + bias, then `activation` ("none", or "gelu": the exact, erf GELU, which the
        native dynamic kernel applies to its fp32 outputs, with the bias, before rounding them)."""
        if activation not in ("none", "gelu"):
            raise ValueError(f"unknown activation {activation!r}; one of none, gelu")
        if self.native and self.dynamic and x.dtype in (torch.float32, torch.bfloat16):
            # Per-token activations, int32 sums over all of K (compute-bound layers).
            out = torch.ops.genfast.qlinear_dynamic(
                self._rows(x), self.packed, self.out_features, self.bias, activation == "gelu"
            )
            return out.reshape(*x.shape[:-1], self.out_features)
        out = self._forward(x)
        return F.gelu(out) if activation == "gelu" else out

    def _forward(self, x: Tensor) -> Tensor:
        if self.native and x.dtype in (torch.float32, torch.bfloat16):
            # Activations per block of 32 (weight-only quantization: decode, LLM prefill).
            out = torch.ops.genfast.qlinear(self._rows(x), self.packed, self.bits, self.group_size, self.out_features)
            return self._outputs(out, x)
        if self.dynamic:
            return self._dynamic_int8_fallback(x)
        # (other dtypes than bf16, many rows and CPU tensors take the dequantize path below)
        if self.kernel == "int4pack" and x.dtype == torch.bfloat16 and x.is_cuda and rows_at_most(x, tinygemm.MAX_ROWS):
            out = torch.ops.aten._weight_int4pack_mm(self._rows(x), self.packed, self.group_size, self.scales_and_zeros)
            return self._outputs(out, x)
        if self.kernel == "int8pack":
            return self._int8pack_forward(x)
        if self.kernel == "triton" and x.dtype in TRITON_DTYPES and self._triton_takes(x):
            return self._triton_forward(x)
        weight = self.dequantize(x.dtype)
        if torch.compiler.is_compiling() and x.numel() == x.shape[-1]:
            return row_linear(x, weight, self.bias)
        return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def _triton_takes(self, x: Tensor) -> bool:
        """Whether the Triton kernels take x's rows (`rows_at_most`; more, or a K the few-row
        kernel does not take: dequantize and cuBLAS)."""
        from genfast.kernels.triton import qlinear as qlinear_triton

        if not rows_at_most(x, MAX_GEMM_ROWS):
            return False
        return x.numel() == x.shape[-1] or qlinear_triton.few_rows_take(self.padded_in_features, self.bits)

    def _triton_forward(self, x: Tensor) -> Tensor:
        from genfast.kernels.triton import qlinear as qlinear_triton  # registers the op; imports triton

        rows = self._rows(x)
        args = (rows.contiguous(), self.codes, self.scales, self.mins, self.bits, self.group_size)
        # Eagerly the kernel is launched directly, without the op's dispatch: host time per call
        # counts wherever no CUDA graph replays the step. Compiled code needs the op.
        compiling = torch.compiler.is_compiling()
        out = torch.ops.genfast.qlinear_triton(*args) if compiling else qlinear_triton.qlinear(*args)
        return self._outputs(out, x)

    def _int8pack_forward(self, x: Tensor) -> Tensor:
        rows = self._rows(x)
        if torch.compiler.is_compiling() and rows.shape[0] == 1:
            out = row_linear(rows, self.weight_int8, scales=self.channel_scales)
        else:
            out = F.linear(rows, self.weight_int8.to(x.dtype)) * self.channel_scales.to(x.dtype)
        return self._outputs(out, x)

    def _dynamic_int8_fallback(self, x: Tensor) -> Tensor:
        rows = self._rows(x).float()
        row_scales = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        xq = torch.round(rows / row_scales).to(torch.int8)
        wq = (self.codes ^ 0x80).view(torch.int8)  # u - 128
        out = _int8_product(xq, wq.t()) * row_scales * self.scales[:, 0].float()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = self.kernel
        if self.native:
            kernel = f"native-{qlinear_kernel.KERNEL.loaded_isa()}"
        elif self.dynamic:
            kernel = "fp32-matmul" if _int_mm_saturates(self.codes.device) else "int_mm"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, bias={self.bias is not None}, kernel={kernel}"
        )


def _int_mm_saturates(device: torch.device) -> bool:
    """Whether torch._int_mm sums in saturating int16 on `device` (a CPU without VNNI)."""
    return device.type == "cpu" and not hardware.has_vnni()


def _int8_product(a: Tensor, b: Tensor) -> Tensor:
    """a @ b for int8 [M, K] x [K, N], as fp32. On a CPU without VNNI, oneDNN's int8 GEMM (behind
    torch._int_mm) sums u8 x s8 pairs in saturating int16: off by up to a quarter of the largest output
    (measured under ONEDNN_MAX_CPU_ISA=AVX2, also with 7-bit activations). There the same integer
    product runs in fp32, exact while the sums stay under 2**24 and within fp32 rounding above."""
    if _int_mm_saturates(a.device):
        return a.float() @ b.float()
    m = a.shape[0]
    if m <= 16:  # torch._int_mm wants more than 16 rows on CUDA; pad with zero rows
        a = F.pad(a, (0, 0, 0, 17 - m))
    return torch._int_mm(a, b)[:m].float()


@torch.library.custom_op("genfast::expert_qlinear", mutates_args=())
def expert_qlinear(x: Tensor, experts: Tensor, packed: Tensor, bits: int, group_size: int, out_features: int) -> Tensor:
    """Row r of `x` [R, K_padded] times expert `experts[r]`'s quantized weight, each expert's in the
    native kernel's layout (`packed` [E, bytes]): [R, out_features]."""

    def matmul(rows: Tensor, expert: int) -> Tensor:
        return torch.ops.genfast.qlinear(rows, packed[expert], bits, group_size, out_features)

    return grouped_by_expert(x, experts, out_features, matmul)


@expert_qlinear.register_fake
def _expert_qlinear_fake(
    x: Tensor, experts: Tensor, packed: Tensor, bits: int, group_size: int, out_features: int
) -> Tensor:
    return x.new_empty(x.shape[0], out_features)


@torch.library.custom_op("genfast::expert_qlinear_dequantized", mutates_args=())
def expert_qlinear_dequantized(
    x: Tensor, experts: Tensor, codes: Tensor, scales: Tensor, mins: Tensor, bits: int, group_size: int
) -> Tensor:
    """The same without a native kernel: each present expert's weight (codes [E, N, K_padded] in
    storage form: 4-bit ones two per byte) is dequantized when used."""

    def matmul(rows: Tensor, expert: int) -> Tensor:
        expert_codes = unpack_nibbles(codes[expert]) if bits == 4 else codes[expert]
        weight = QuantizedWeight(expert_codes, scales[expert], mins[expert], bits, group_size, x.shape[-1])
        return F.linear(rows, weight.dequantize(rows.dtype))

    return grouped_by_expert(x, experts, codes.shape[1], matmul)


@expert_qlinear_dequantized.register_fake
def _expert_qlinear_dequantized_fake(
    x: Tensor, experts: Tensor, codes: Tensor, scales: Tensor, mins: Tensor, bits: int, group_size: int
) -> Tensor:
    return x.new_empty(x.shape[0], codes.shape[1])


class QuantExpertLinear(nn.Module):
    """ExpertLinear over weight-only codes: a QuantizedWeight with the experts stacked ([E, N, K]),
    each expert's weight in the layout of QuantLinear's kernel; a row reads only its own expert's."""

    def __init__(self, qweight: QuantizedWeight) -> None:
        super().__init__()
        self.n_experts = qweight.codes.shape[0]
        self.in_features, self.out_features = qweight.in_features, qweight.out_features
        self.bits, self.group_size = qweight.bits, qweight.group_size
        self.padded_in_features = qweight.codes.shape[-1]
        self.register_buffer("bias", None)  # as QuantLinear's (weight-only, no bias), for code that serves both
        self.dynamic = False
        self.native = qweight.codes.device.type == "cpu" and qlinear_kernel.available()
        if self.native:
            self.padded_out_features = _kernel_rows(self.out_features)
            experts = (QuantizedWeight(*(t[e] for t in (qweight.codes, qweight.scales, qweight.mins)), self.bits,
                                       self.group_size, self.in_features) for e in range(self.n_experts))  # fmt: skip
            self.register_buffer("packed", torch.stack([_pack(w, self.padded_out_features) for w in experts]))
        else:
            codes = pack_nibbles(qweight.codes) if self.bits == 4 else qweight.codes
            self.register_buffer("codes", codes.contiguous())
            self.register_buffer("scales", qweight.scales.contiguous())
            self.register_buffer("mins", qweight.mins.contiguous())

    @classmethod
    def from_expert_linear(cls, layer: ExpertLinear, bits: int, group_size: int | None = None) -> QuantExpertLinear:
        from genfast.quant.grids import quantize

        return cls(quantize(layer.weight, bits, group_size))

    def quantized_weight(self) -> QuantizedWeight:
        """The canonical (storage) form, experts stacked."""
        n, k = self.out_features, self.padded_in_features
        if self.native:
            per_expert = [_unpack(p, self.bits, self.padded_out_features, n, k, self.group_size) for p in self.packed]
            codes, scales, mins = (torch.stack(parts) for parts in zip(*per_expert, strict=True))
        else:
            codes = unpack_nibbles(self.codes) if self.bits == 4 else self.codes
            scales, mins = self.scales, self.mins
        return QuantizedWeight(
            codes.contiguous(), scales.contiguous(), mins.contiguous(), self.bits, self.group_size, self.in_features
        )

    def forward(self, x: Tensor, experts: Tensor) -> Tensor:
        """x [R, in] and each row's expert [R] -> [R, out]."""
        if self.padded_in_features != self.in_features:
            x = F.pad(x, (0, self.padded_in_features - self.in_features))
        if self.native:  # the kernel takes fp32 or bf16 rows
            rows = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
            out = torch.ops.genfast.expert_qlinear(
                rows, experts, self.packed, self.bits, self.group_size, self.out_features
            )
            return out.to(x.dtype)
        return torch.ops.genfast.expert_qlinear_dequantized(
            x, experts, self.codes, self.scales, self.mins, self.bits, self.group_size
        )

    def extra_repr(self) -> str:
        kernel = f"native-{qlinear_kernel.KERNEL.loaded_isa()}" if self.native else "dequantize"
        return (
            f"experts={self.n_experts}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bits={self.bits}, group_size={self.group_size}, kernel={kernel}"
        )


def quantized_layer(
    qweight: QuantizedWeight, bias: Tensor | None = None, dynamic: bool = False, dtype: torch.dtype | None = None
) -> nn.Module:
    """QuantLinear for a weight, QuantExpertLinear for experts' stacked weights (which have no bias);
    `dtype` is the activations' (QuantLinear's)."""
    if qweight.codes.dim() == 3:
        if bias is not None or dynamic:
            raise ValueError("expert weights are weight-only and have no bias")
        return QuantExpertLinear(qweight)
    return QuantLinear(qweight, bias, dynamic, dtype=dtype)


def uses_native_kernels(model: nn.Module) -> bool:
    """True when some linear of `model` runs genfast's native quantized kernel."""
    return any(isinstance(m, (QuantLinear, QuantExpertLinear)) and m.native for m in model.modules())


def quantize_layer(layer: nn.Linear | ExpertLinear, bits: int, group_size: int | None = None) -> nn.Module:
    """Round-to-nearest weight-only quantization of a linear (QuantLinear) or of a mixture's expert
    weights (QuantExpertLinear)."""
    if isinstance(layer, ExpertLinear):
        return QuantExpertLinear.from_expert_linear(layer, bits, group_size)
    return QuantLinear.from_linear(layer, bits, group_size)


LinearFilter = Callable[[str, nn.Linear], bool]  # (name, linear) -> True to keep it in floating point


def narrower_than(min_features: int) -> LinearFilter:
    """The dynamic-int8 shape rule of every workload: a linear stays in floating point when
    min(in_features, out_features) < `min_features` (narrow layers gain little from int8, where
    the rescaling dominates, and carry most of its error)."""

    def keep(name: str, linear: nn.Linear) -> bool:
        return min(linear.in_features, linear.out_features) < min_features

    return keep


def replace_linears(
    model: nn.Module, make: Callable[[str, nn.Linear], nn.Module], keep: LinearFilter | None = None
) -> list[str]:
    """Swap every nn.Linear (and ExpertLinear) for which `keep(name, linear)` is not True by
    `make(name, linear)`.

    Returns the names replaced. A weight tied to another module (e.g. an output head sharing the
    embedding table) is untied: the other module keeps its floating-point tensor.
    """
    targets = [
        name
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, ExpertLinear)) and not (keep and keep(name, m))
    ]
    for name in targets:  # by name: each replaced layer's weights are freed as it is replaced, not at the end
        model.set_submodule(name, make(name, model.get_submodule(name)))
    return targets


def quantize_linears(
    model: nn.Module, bits: int, group_size: int | None = None, keep: LinearFilter | None = None
) -> list[str]:
    """Round-to-nearest weight-only quantization of a model's linears (and experts), in place."""
    return replace_linears(model, lambda _, linear: quantize_layer(linear, bits, group_size), keep)


def quantize_dynamic_int8(model: nn.Module, keep: LinearFilter | None = None) -> list[str]:
    """Dynamic int8 (int8 activations x per-channel int8 weights) for the linears `keep` does not
    claim; `keep(name, linear)` is the hook that excludes layers (e.g. small or sensitive ones).
    Experts keep their weights: dynamic int8 has no grouped expert kernel."""

    def keep_experts(name: str, layer: nn.Module) -> bool:
        return isinstance(layer, ExpertLinear) or bool(keep and keep(name, layer))

    return replace_linears(model, lambda _, linear: QuantLinear.from_linear(linear, 8, dynamic=True), keep_experts)
