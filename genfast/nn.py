"""Layers shared by all workloads."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genfast.kernels.linear_few_rows import ops as few_rows
from genfast.kernels.linear_widening_gemm import ops as widening_gemm
from genfast.platform import heap


class DtypeAttribute:
    """A module attribute holding a torch.dtype or None, kept in the instance as the dtype's name.

    Why: torch's serializer of a compiled function's guards (`aot_compile`, which saves genfast's
    compiled steps) marks the plain values in a module's __dict__ as missing; a dtype object there
    is the very object every tensor of that dtype refers to, so those tensors' guards could be
    pickled with a missing dtype, and the saved steps failed to load (seen with a bf16 KV cache
    under fp32 compute: every start recompiled)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}_name"

    def __get__(self, module: object, owner: type | None = None) -> torch.dtype | None:
        if module is None:
            return self  # type: ignore[return-value]  (the class attribute itself)
        name = module.__dict__.get(self.slot)
        return getattr(torch, name) if name is not None else None

    def __set__(self, module: object, dtype: torch.dtype | None) -> None:
        module.__dict__[self.slot] = str(dtype).removeprefix("torch.") if dtype is not None else None


def row_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, scales: Tensor | None = None) -> Tensor:
    """F.linear for inputs with a single row, written as a broadcast multiply-sum in fp32.

    Compiled by inductor this becomes one vectorized reduction that streams the weight at close
    to the machine's read bandwidth, faster than aten::mm or a pre-packed oneDNN linear for one
    row, and it fuses with the neighbouring element-wise ops. Eagerly it would materialize an
    N x K product, so `Linear` only takes this path under torch.compile, and only where the
    few-row kernel does not apply (fp32 weights, no kernel for this CPU): inside a whole compiled
    decode step the kernel was as fast or faster. `scales` (per output channel) serves quantized
    weights: the weight is upcast inside the same loop.
    """
    out = (x.float().reshape(1, -1) * weight.float()).sum(dim=-1)
    if scales is not None:
        out = out * scales.float()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def mixed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear where the weight is stored in a narrower dtype than x computes in (bf16 weights,
    fp32 rows): the few-row kernel for decode's rows, the widening GEMM for more, else the weight
    upcast for aten's GEMM."""
    if few_rows.applies(x, weight):
        return few_rows.linear(x, weight, bias)
    if widening_gemm.applies(x, weight):
        return widening_gemm.linear(x, weight, bias)
    return widening_gemm.portable(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) with bandwidth-bound paths for one and a few
    input rows under torch.compile (decode, batched decode, speculative verification).

    The weight may be stored in bf16 while inputs are fp32 (`store_linear_weights`: half the bytes
    per decode step on CPUs without native bf16): `mixed_linear` multiplies in fp32, eagerly or
    compiled, by the few-row kernel or the widening GEMM (prefill).

    `batch_invariant` (set by genfast.llm.model.invariance): every row count takes the few-row
    kernel, whose sums run in one order whatever the row count, so a row's result never depends on
    the rows beside it."""

    batch_invariant = False

    def forward(self, x: Tensor) -> Tensor:
        if self.batch_invariant:
            return few_rows.linear(x, self.weight, self.bias)
        if self.weight.dtype != x.dtype:
            return mixed_linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling() and few_rows.applies(x, self.weight):
            return few_rows.linear(x, self.weight, self.bias)
        # On CUDA cuBLAS's GEMV is the faster one-row product (benchmarks/cuda_linear.py).
        if torch.compiler.is_compiling() and x.numel() == x.shape[-1] and x.device.type == "cpu":
            return row_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


# Rows of input from which widening a linear's weight pays: below, its pass over the weight costs
# more than the faster products save (a DiT's modulation linears take one row per image); the
# break-even measured on an Intel Xeon is in docs/notes.md.
FP32_PRODUCTS_MIN_ROWS = 512


class Fp32ProductsLinear(nn.Linear):
    """nn.Linear (same parameters) that multiplies bf16 inputs in fp32 and rounds the result back to
    bf16: the linears of a compute-bound bf16 model on a CPU whose bf16 products are slower than its
    fp32 ones (`hardware.fast_bf16_products`), which keep bf16's memory and get fp32's rate. The
    weight is widened on every call, a pass over 3x its bytes that is small next to the product
    where many rows share it (an image's tokens): inputs of fewer than FP32_PRODUCTS_MIN_ROWS rows
    multiply in bf16 as nn.Linear does. Eager, the weight is widened a piece at a time
    (`widening_in_pieces`); compiled, at once, in a buffer inductor plans. `use_fp32_products`
    installs it."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.bfloat16 or x.numel() < FP32_PRODUCTS_MIN_ROWS * self.in_features:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        if torch.compiler.is_compiling():
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return widening_in_pieces(x, self.weight, bias)


def widening_in_pieces(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear(x.float(), weight.float(), bias) rounded to x's dtype, computed a piece of output
    features at a time: each piece's widened weight and fp32 product stay below glibc's mmap
    threshold (`heap.items_per_piece`), so they come from the heap, where one whole widened weight
    (a DiT's are 40-150 MB) would be mapped and faulted in afresh at every call."""
    rows = x.reshape(-1, x.shape[-1]).float()
    out = x.new_empty(rows.shape[0], weight.shape[0])
    per_piece = heap.items_per_piece((rows.shape[0] + weight.shape[1]) * 4)
    for start in range(0, weight.shape[0], per_piece):
        piece = slice(start, start + per_piece)
        widened = weight[piece].float().t()
        out[:, piece] = rows @ widened if bias is None else torch.addmm(bias[piece], rows, widened)
    return out.view(*x.shape[:-1], weight.shape[0])


class Fp32ProductsConv2d(nn.Conv2d):
    """nn.Conv2d (same parameters) that convolves bf16 inputs in fp32 and rounds the result back to
    bf16, as `Fp32ProductsLinear` does for linears: a VAE's or a UNet's convolutions are most of
    their time. The input's widening is a pass over its bytes that a compiled graph fuses into the
    op that produced it (a GroupNorm and SiLU before most of them)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.bfloat16:
            return super().forward(x)
        bias = None if self.bias is None else self.bias.float()
        return self._conv_forward(x.float(), self.weight.float(), bias).to(x.dtype)


def _fp32_products_layer(layer: nn.Module) -> nn.Module:
    """The Fp32Products* form of a plain nn.Linear or nn.Conv2d, holding the same parameters."""
    if type(layer) is nn.Linear:
        new: nn.Module = Fp32ProductsLinear(layer.in_features, layer.out_features, bias=False, device="meta")
    else:
        c = layer
        new = Fp32ProductsConv2d(
            c.in_channels, c.out_channels, c.kernel_size, c.stride, c.padding, c.dilation, c.groups,
            bias=False, padding_mode=c.padding_mode, device="meta",
        )  # fmt: skip
    new.weight, new.bias = layer.weight, layer.bias
    new.train(layer.training)
    return new


# Convolutions of fewer input channels stay in bf16 products: they are cheap (a VAE's conv_in on 4 or
# 16 latent channels), and torch picks an fp32 convolution's backend by its size below 20480
# elements, a guard in a compiled graph; 64 channels or more keep every map of a real image above it,
# so that a new image size does not recompile.
FP32_CONV_MIN_CHANNELS = 64


def _wants_fp32_products(layer: nn.Module) -> bool:
    if type(layer) is nn.Conv2d:
        return layer.in_channels >= FP32_CONV_MIN_CHANNELS
    return type(layer) is nn.Linear


def use_fp32_products(
    model: nn.Module, kinds: tuple[type[nn.Linear] | type[nn.Conv2d], ...] = (nn.Linear, nn.Conv2d)
) -> int:
    """Make every plain nn.Linear and nn.Conv2d (of >= FP32_CONV_MIN_CHANNELS input channels) of
    `model` multiply in fp32 (`Fp32ProductsLinear`, `Fp32ProductsConv2d`) with the same parameters
    (no copy), in place; subclasses and quantized layers stay as they are. `kinds` narrows it to
    one kind of layer (benchmarks/fp32_products.py compares them). Returns how many changed."""
    names = [name for name, m in model.named_modules() if type(m) in kinds and _wants_fp32_products(m)]
    for name in names:
        model.set_submodule(name, _fp32_products_layer(model.get_submodule(name)))
    return len(names)


def grouped_by_expert(x: Tensor, experts: Tensor, out_features: int, matmul: Callable[[Tensor, int], Tensor]) -> Tensor:
    """Rows of `x` [R, K], row r multiplied by the weight of expert `experts[r]` ([R] int64):
    `matmul(rows, e)` once per expert present, on all of its rows at once (a prefill's tokens
    grouped per expert; a decode step's one row for each of its active experts). Experts absent
    from `experts` are never touched, so their weights are not read. Eager code, run inside the
    ops below: the grouping is data-dependent, which a compiled graph keeps opaque."""
    order = torch.argsort(experts, stable=True)
    present, counts = torch.unique_consecutive(experts[order], return_counts=True)
    out = x.new_empty(x.shape[0], out_features)
    start = 0
    for expert, count in zip(present.tolist(), counts.tolist(), strict=True):
        rows = order[start : start + count]
        start += count
        out.index_copy_(0, rows, matmul(x.index_select(0, rows), expert))
    return out


@torch.library.custom_op("genfast::expert_linear", mutates_args=())
def expert_linear(x: Tensor, experts: Tensor, weight: Tensor, batch_invariant: bool = False) -> Tensor:
    """Row r of `x` [R, K] times expert `experts[r]`'s weight, of `weight` [E, N, K]: [R, N]; with
    `batch_invariant`, each row's result whatever the other rows of its expert (Linear's)."""

    def matmul(rows: Tensor, expert: int) -> Tensor:
        w = weight[expert]
        if batch_invariant:
            return few_rows.linear(rows, w)
        if w.dtype != rows.dtype:
            return mixed_linear(rows, w)
        if few_rows.applies(rows, w):
            return few_rows.linear(rows, w)
        return F.linear(rows, w)

    return grouped_by_expert(x, experts, weight.shape[1], matmul)


@expert_linear.register_fake
def _expert_linear_fake(x: Tensor, experts: Tensor, weight: Tensor, batch_invariant: bool = False) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])


class ExpertLinear(nn.Module):
    """The same linear shape for each of a mixture's experts, weights stacked [E, out, in]
    (no bias: no family has one); a row is multiplied by its own expert's weight only."""

    batch_invariant = False  # as Linear's

    def __init__(self, n_experts: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features))
        self.register_parameter("bias", None)  # as a biasless nn.Linear, for code that serves both

    def forward(self, x: Tensor, experts: Tensor) -> Tensor:
        """x [R, in] and each row's expert [R] -> [R, out]."""
        return torch.ops.genfast.expert_linear(x, experts, self.weight, self.batch_invariant)

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, in_features={self.in_features}, out_features={self.out_features}"


def auto_weight_dtype(device: torch.device, compute: torch.dtype) -> torch.dtype:
    """How `--dtype auto` stores Linear weights: in bf16 on a CPU that computes in fp32 (no native
    bf16 dot products) where the few-row kernel multiplies bf16 weights by fp32 rows, halving the
    bytes each decode step reads with no emulated bf16 arithmetic; elsewhere as it computes."""
    if device.type == "cpu" and compute == torch.float32 and few_rows.unavailable_reason() is None:
        return torch.bfloat16
    return compute


def store_linear_weights(model: nn.Module, dtype: torch.dtype) -> int:
    """Store the weight of every `Linear` and `ExpertLinear` of `model` in `dtype` (biases, norms
    and the rest keep theirs), in place; a parameter tied to a converted weight (an embedding table
    shared with the output head) is converted with it and stays tied. Returns how many weights
    were converted."""
    converted: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(old) -> (old, new): old stays alive
    for module in model.modules():
        if isinstance(module, (Linear, ExpertLinear)) and module.weight.dtype != dtype:
            old = module.weight
            if id(old) not in converted:
                converted[id(old)] = (old, nn.Parameter(old.detach().to(dtype), requires_grad=False))
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) in converted:
                setattr(module, name, converted[id(param)][1])
    return len(converted)
