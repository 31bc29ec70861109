"""Bytes moved per generated token and model bandwidth utilization (MBU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genfast.llm.decoding.generate import GenerationResult
from genfast.llm.model.moe import MoEFeedForward
from genfast.llm.model.transformer import Transformer
from genfast.platform.hardware import peak_memory_bytes


def weight_bytes_per_step(model: Transformer, batch_size: int = 1) -> int:
    """Weight bytes one decode step reads: every parameter once (a tied embedding is read by the
    output head), except an untied input embedding, of which only the looked-up rows are read,
    and a mixture's experts, of which a step reads only those it runs: k of E per sequence (for
    a batch, k * batch_size of E: an upper bound, as sequences may share experts)."""
    seen, total = set(), 0
    for p in list(model.parameters()) + list(model.buffers()):
        if id(p) in seen or p is model.inv_freq:
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    for layer in model.layers:  # the KV caches are counted by kv_bytes_per_slot
        cache = layer.attention.kv_cache
        if cache is not None:
            total -= sum(b.nbytes for b in cache.buffers())
    emb = model.tok_embeddings.weight
    if emb is not getattr(model.output, "weight", None):  # untied, or the head is quantized
        total -= emb.numel() * emb.element_size()
    n_experts = model.args.n_experts
    active = min(n_experts, model.args.n_active_experts * batch_size)
    for module in model.modules():
        if isinstance(module, MoEFeedForward):
            stacked = sum(t.nbytes for t in module.expert_tensors())
            total -= stacked - stacked * active // n_experts
    return total


def kv_bytes_per_slot(model: Transformer) -> int:
    """Bytes of keys and values one cache slot holds across all layers (with caches set up; a
    latent cache's slot holds its latent and shared rotary key, not per-head keys and values)."""
    return sum(layer.attention.kv_cache.slot_bytes for layer in model.layers)


@dataclass(frozen=True)
class DecodeTraffic:
    weight_bytes: int
    kv_bytes: float  # per step, all sequences of the batch
    steps_per_s: float

    @property
    def bytes_per_step(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_per_step * self.steps_per_s

    def mbu(self, peak_bytes_per_s: float) -> float:
        return self.bytes_per_s / peak_bytes_per_s


def kv_bytes_read(model: Transformer, kv_len: float) -> float:
    """Bytes of keys and values a decode step of one sequence reads at cache length `kv_len`: the
    valid prefix of each layer's cache, and at most its ring of a sliding-window layer's."""
    total = 0.0
    for layer in model.layers:
        cache = layer.attention.kv_cache
        if cache is None:
            continue
        total += cache.slot_bytes * cache.slots_read(kv_len)
    return total


def decode_traffic(model: Transformer, result: GenerationResult) -> DecodeTraffic:
    kv = kv_bytes_read(model, result.mean_kv_len) * result.batch_size
    return DecodeTraffic(weight_bytes_per_step(model, result.batch_size), kv, result.decode_tok_s)


def format_stats(
    model: Transformer, result: GenerationResult, peak_bw: float, compile_s: float | None, device: torch.device
) -> str:
    t = decode_traffic(model, result)
    lines = [
        f"prompt {result.prompt_tokens} tokens | prefill {result.prefill_tok_s:.1f} tok/s | "
        f"time to first token {result.ttft_s * 1000:.0f} ms",
        f"decode {result.decode_tok_s:.1f} tok/s per sequence ({result.new_tokens} new tokens, "
        f"batch {result.batch_size})",
    ]
    if result.speculate_k:  # a target pass yields several tokens: bytes per token and MBU do not apply
        lines.append(
            f"speculative (k={result.speculate_k}): {100 * result.acceptance_rate:.0f}% of "
            f"{result.drafted_tokens} drafted tokens accepted | {result.tokens_per_pass:.2f} tokens "
            f"per target pass ({result.target_passes} passes) | drafting "
            f"{100 * result.draft_s / max(result.decode_s, 1e-9):.0f}% of decode time"
        )
    else:
        a = model.args
        experts = f", of experts the {a.n_active_experts} of {a.n_experts} each token runs" if a.n_experts else ""
        lines.append(
            f"bytes/step {t.bytes_per_step / 1e6:.1f} MB (weights {t.weight_bytes / 1e6:.1f} MB{experts} + KV "
            f"{t.kv_bytes / 1e6:.1f} MB, {kv_bytes_per_slot(model) / 1e3:.1f} KB per token) | "
            f"{t.bytes_per_s / 1e9:.1f} GB/s | MBU {100 * t.mbu(peak_bw):.0f}% of "
            f"{peak_bw / 1e9:.1f} GB/s measured"
        )
    lines.append(f"peak memory {peak_memory_bytes(device) / 1e9:.2f} GB")
    if compile_s is not None:
        lines.append(f"compile + warm-up {compile_s:.1f} s (not in the rates above; compiled code is cached)")
    return "\n".join(lines)
