"""Token sampling that never synchronizes with the device (so it can live inside a compiled step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from genfast.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"--top-k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: Tensor, params: SamplingParams) -> Tensor:
    """Next token ids [B] from fp32 logits [B, V]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return draw(probabilities(logits, params))


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution `sample` draws from, fp32 [B, V]: temperature, top-k and top-p applied;
    one-hot at the argmax when greedy (so speculative decoding's acceptance rule covers greedy)."""
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top one stays).
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def draw(weights: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One index per row [B] drawn in proportion to the non-negative `weights` [B, V] (they need
    not sum to 1). Gumbel-style trick: argmax(w / Exp(1)) is a draw from w, with no host round trip.
    generator: the random stream (default torch's global one; a server seeds one per request)."""
    noise = torch.empty_like(weights).exponential_(1, generator=generator)
    return (weights / noise).argmax(dim=-1)
