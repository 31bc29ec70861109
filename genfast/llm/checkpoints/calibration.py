"""GPTQ calibration of a whole LLM: block by block on windows of text (the GPTQ math itself is
shared: genfast/quant/gptq.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from genfast.llm.checkpoints.tokenizer import Tokenizer
from genfast.llm.model.transformer import Transformer, attention_mask
from genfast.llm.perplexity import make_windows, window_bos
from genfast.quant.gptq import HessianAccumulator, gptq_quantize
from genfast.quant.grids import QuantizedWeight


def _collect_inputs(hessian: HessianAccumulator) -> Callable[[nn.Module, tuple[Tensor, ...]], None]:
    """A forward pre-hook adding a module's input to `hessian`."""

    def hook(module: nn.Module, args: tuple[Tensor, ...]) -> None:
        hessian.add(args[0])

    return hook


@torch.no_grad()
def calibrate_gptq(
    model: Transformer,
    windows: Tensor,
    bits: int = 4,
    group_size: int = 128,
    block_size: int = 128,
    damp: float = 0.01,
    progress: Callable[[str], None] | None = None,
    skip: Callable[[str, nn.Linear], bool] | None = None,
    batch_size: int = 8,
) -> dict[str, QuantizedWeight]:
    """GPTQ-quantize every nn.Linear of `model` on calibration token `windows` [S, T].

    Blocks are quantized in order, each on the hidden states the already-quantized blocks before
    it produce (so later layers see, and correct for, earlier layers' errors): the block's linears
    collect Hessians over one pass, are quantized, their dequantized weights are written back into
    the model, and the block runs again to give the next block its inputs. The output head comes
    last, on norm(final hidden state); a head tied to the embeddings is not written back (that
    would change the embeddings too). The model's float weights are thus modified in place.

    Returns {module name (as in model.named_modules()): QuantizedWeight}; `skip(name, linear)`
    leaves a linear out (float and unchanged). KV caches are dropped: attention runs causally
    within each window. Windows go through `batch_size` at a time, to bound memory.
    """
    if windows.ndim != 2 or windows.is_floating_point():
        raise ValueError(f"windows must be token ids of shape [S, T], got {tuple(windows.shape)} {windows.dtype}")
    seq_len = windows.shape[1]
    if seq_len > model.args.max_seq_len:
        raise ValueError(f"windows of {seq_len} tokens exceed the model's context of {model.args.max_seq_len}")
    model.clear_caches()
    device = model.norm.weight.device
    windows = windows.to(device)
    input_pos = torch.arange(seq_len, device=device)
    cos, sin = model.rope(input_pos)
    mask = attention_mask(input_pos, seq_len)
    names = {module: name for name, module in model.named_modules()}
    results: dict[str, QuantizedWeight] = {}

    def wanted(linear: nn.Module) -> bool:
        return isinstance(linear, nn.Linear) and (skip is None or not skip(names[linear], linear))

    def quantize(linear: nn.Linear, hessian: HessianAccumulator) -> None:
        name = names[linear]
        if progress is not None:
            progress(f"GPTQ int{bits} g{group_size}: {name} {tuple(linear.weight.shape)}")
        try:
            qw = gptq_quantize(linear.weight, hessian.hessian, bits, group_size, block_size, damp)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
        results[name] = qw
        if linear.weight is not model.tok_embeddings.weight:
            linear.weight.data.copy_(qw.dequantize(linear.weight.dtype))

    hidden = [model.tok_embeddings(windows[i : i + batch_size]) for i in range(0, len(windows), batch_size)]
    for layer in model.layers:
        hessians = {m: HessianAccumulator(m.in_features, device=device) for m in layer.modules() if wanted(m)}
        hooks = [m.register_forward_pre_hook(_collect_inputs(acc)) for m, acc in hessians.items()]
        try:
            for x in hidden:
                layer(x, cos, sin, input_pos, mask)
        finally:
            for hook in hooks:
                hook.remove()
        for linear, hessian in hessians.items():
            quantize(linear, hessian)
        hidden = [layer(x, cos, sin, input_pos, mask) for x in hidden]

    if wanted(model.output):  # fed directly: running the head would materialize [B, T, vocab] logits
        hessian = HessianAccumulator(model.output.in_features, device=device)
        for x in hidden:
            hessian.add(model.norm(x))
        quantize(model.output, hessian)
    return results


def calibration_windows(tokenizer: Tokenizer, text: str, n_windows: int = 32, window: int = 512) -> Tensor:
    """The first `n_windows` (or fewer, for a short text) non-overlapping windows [S, window] of
    `text`'s tokens, cut as perplexity windows are (BOS first when the tokenizer adds one), so the
    model is calibrated on inputs shaped like those it serves. Raises ValueError if none fits."""
    if n_windows < 1 or window < 2:
        raise ValueError(f"need at least one window of at least 2 tokens, got {n_windows} x {window}")
    ids = tokenizer.encode(text, add_bos=False)
    bos = window_bos(tokenizer)
    text_tokens = window - (bos is not None)
    if len(ids) < text_tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window's {text_tokens}")
    return make_windows(ids, window, n_windows, bos)
