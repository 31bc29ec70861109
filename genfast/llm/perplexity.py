"""Perplexity of a model on the evaluation half of the shipped corpus (`genfast eval ppl`).

The protocol, so that a number can be reproduced with any other implementation:

1. Text: `genfast.llm.corpus.evaluation_text()`, the second half (by characters) of the
   `pydoc_data.topics` documentation that ships with CPython, topics in sorted key order joined by
   blank lines. (The first half is the quantizers' calibration text, so quantized models are never
   scored on the text they were fitted to.) The topics change between Python versions: compare
   numbers taken with the same Python minor version, and the same token count.
2. Tokens: the whole text is tokenized once with the model's own tokenizer, without special
   tokens (no BOS, no EOS).
3. Windows: every window has exactly `window` positions (default 512), must fit the model's
   context, and windows do not overlap. If the tokenizer adds BOS (`add_bos`, as Llama 3's does;
   SmolLM2's does not), each window is BOS followed by the next `window - 1` text tokens;
   otherwise it is the next `window` text tokens. The ragged tail that does not fill a window is
   dropped; `max_windows` keeps only the first N windows.
4. Scoring: each window is one independent forward pass (no state carried between windows,
   positions 0..window-1). Every position except the first is scored: the token at position
   t + 1 is predicted from positions 0..t of the same window, so a window scores `window - 1`
   tokens, BOS (when present) is never a target, and with BOS the first text token is scored.
5. Result: `nll` is the mean negative log-likelihood in nats over all scored tokens (log-softmax
   of fp32 logits, summed in fp64), and `ppl = exp(nll)`. This equals Hugging Face's
   `model(window_ids, labels=window_ids).loss` averaged over windows weighted by their scored
   token count (all windows score the same count, so a plain mean of the per-window losses).

Windows run in batches (`batch_size`, default 4) under `torch.inference_mode()`; batching does not
change the result beyond floating-point reordering.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from genfast.errors import UserError
from genfast.llm.checkpoints.tokenizer import Tokenizer
from genfast.llm.model.transformer import Transformer

CORPUS_NAME = "pydoc_data.topics evaluation half"
# Rows of logits turned into log-probabilities at a time: bounds the log-softmax temporary to
# 256 x vocab fp32 (48 MiB for a 49,152-token vocabulary) next to the batch's logits.
_NLL_ROWS = 256


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float  # exp(nll)
    nll: float  # mean negative log-likelihood per scored token, in nats
    tokens: int  # scored tokens: windows * (window - 1)
    windows: int


def evaluation_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The evaluation half of the corpus as token ids, without special tokens (protocol step 2)."""
    from genfast.llm.corpus import evaluation_text

    return tokenizer.encode(evaluation_text(), add_bos=False)


def window_bos(tokenizer: Tokenizer) -> int | None:
    """The BOS id each window starts with: the tokenizer's, if it adds one to its inputs."""
    return tokenizer.bos_id if tokenizer.add_bos and tokenizer.bos_id is not None else None


def make_windows(
    token_ids: list[int] | Tensor, window: int, max_windows: int | None = None, bos_id: int | None = None
) -> Tensor:
    """[N, window] int64 windows over `token_ids` (protocol step 3)."""
    if window < 2:
        raise UserError(f"--window must be at least 2 (one context token and one scored), got {window}")
    if max_windows is not None and max_windows < 1:
        raise UserError(f"--max-windows must be >= 1, got {max_windows}")
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    step = window - 1 if bos_id is not None else window
    n = len(ids) // step
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise UserError(
            f"the text has only {len(ids)} tokens, too few for one window of {window}; use a smaller --window"
        )
    windows = ids[: n * step].view(n, step)
    if bos_id is not None:
        windows = torch.cat([torch.full((n, 1), bos_id, dtype=torch.long), windows], dim=1)
    return windows


@contextmanager
def _without_kv_caches(model: Transformer) -> Iterator[None]:
    """Detach the model's KV caches (so attention is causal within each call, from position 0) and
    put them back afterwards, so a Generator sharing this model keeps working."""
    saved = [layer.attention.kv_cache for layer in model.layers]
    sizes = (model.max_batch_size, model.max_seq_len)
    model.clear_caches()
    try:
        yield
    finally:
        for layer, cache in zip(model.layers, saved):
            layer.attention.kv_cache = cache
        model.max_batch_size, model.max_seq_len = sizes


def _summed_nll(logits: Tensor, targets: Tensor) -> float:
    """Sum over rows of -log p(target) in fp64, from fp32 logits [R, V], a few rows at a time."""
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for start in range(0, logits.shape[0], _NLL_ROWS):
        rows = logits[start : start + _NLL_ROWS]
        t = targets[start : start + _NLL_ROWS, None]
        logp = torch.log_softmax(rows, dim=-1).gather(1, t)
        total -= logp.double().sum()
    return total.item()


def perplexity(
    model: Transformer,
    token_ids: list[int] | Tensor,
    window: int = 512,
    max_windows: int | None = None,
    batch_size: int = 4,
    bos_id: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Perplexity of `model` on `token_ids` by the protocol in this module's docstring.

    token_ids: text tokens without BOS; bos_id: prepend it to every window (see `window_bos`).
    on_progress(done_windows, total_windows) is called after each batch.
    """
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    context = model.args.max_seq_len
    if window > context:
        raise UserError(
            f"--window {window} is longer than the model's context of {context} tokens; use --window {context} or less"
        )
    windows = make_windows(token_ids, window, max_windows, bos_id)
    n = windows.shape[0]
    device = model.norm.weight.device
    input_pos = torch.arange(window, device=device)
    total = 0.0
    with torch.inference_mode(), _without_kv_caches(model):
        for start in range(0, n, batch_size):
            batch = windows[start : start + batch_size].to(device)
            logits = model(batch, input_pos, all_logits=True)  # [B, T, V] fp32
            scored = logits[:, :-1].reshape(-1, logits.shape[-1])  # position t predicts t + 1
            total += _summed_nll(scored, batch[:, 1:].reshape(-1))
            del logits, scored
            if on_progress is not None:
                on_progress(min(start + batch_size, n), n)
    tokens = n * (window - 1)
    nll = total / tokens
    return PerplexityResult(ppl=math.exp(nll), nll=nll, tokens=tokens, windows=n)


def _log(message: str, end: str = "\n") -> None:
    print(message, file=sys.stderr, end=end, flush=True)


def eval_ppl_command(args: argparse.Namespace) -> int:
    """`genfast eval ppl`: one summary line on stdout, optional JSON (never over a file unasked)."""
    from genfast.llm.model.transformer import describe_size
    from genfast.llm.recipe import load_for_command, plan
    from genfast.storage.files import check_outputs, write_json_atomic

    json_path = Path(args.json_path) if args.json_path else None
    if json_path is not None:
        check_outputs([json_path], args.force, inputs=[args.model])
    settings = plan(args.recipe, args.device, args.dtype, args.quant, False, args.batch_invariant).settings  # eager
    loaded = load_for_command(args, settings, _log)
    dtype = loaded.dtype_label()
    _log(
        f"genfast: {loaded.path} | {describe_size(loaded.model.args)} | "
        f"{dtype}{'' if loaded.quant == 'none' else ', ' + loaded.quant + ' weights'} on {loaded.device}"
    )
    ids = evaluation_token_ids(loaded.tokenizer)
    bos = window_bos(loaded.tokenizer)
    interactive = sys.stderr.isatty()

    def progress(done: int, total: int) -> None:
        if interactive:
            _log(f"\rgenfast: window {done}/{total}", end="\n" if done == total else "")

    started = time.perf_counter()
    result = perplexity(loaded.model, ids, args.window, args.max_windows, args.batch_size, bos, progress)
    seconds = time.perf_counter() - started
    model_name = loaded.path.name
    print(
        f"{model_name} | quant {loaded.quant} | {dtype} | {result.windows} windows x {args.window} "
        f"tokens{' (BOS first)' if bos is not None else ''} | {result.tokens:,} tokens scored | "
        f"ppl {result.ppl:.4f} (nll {result.nll:.5f}) | {seconds:.1f} s"
    )
    if json_path is not None:
        write_json_atomic(
            json_path,
            {
                "ppl": result.ppl,
                "nll": result.nll,
                "tokens": result.tokens,
                "windows": result.windows,
                "window": args.window,
                "bos": bos is not None,
                "model": model_name,
                "quant": loaded.quant,
                "dtype": dtype,
                "device": str(loaded.device),
                "corpus": CORPUS_NAME,
                "seconds": round(seconds, 2),
            },
        )
    return 0
