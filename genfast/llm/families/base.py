"""What a decoder family declares (see genfast/llm/families/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from genfast.llm.layers import Attention, TransformerBlock


@dataclass(frozen=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    # ModelArgs fields that the family sets from a Hugging Face config (beyond the shared ones).
    hf_fields: Callable[[dict[str, Any]], dict[str, Any]] = lambda cfg: {}
    attention: type[Attention] = Attention
    block: type[TransformerBlock] = TransformerBlock
    # genfast parameter suffix in a block -> the family's own source tensors (HF, GGUF).
    hf_layer_tensors: dict[str, list[str]] = field(default_factory=dict)
    gguf_layer_tensors: dict[str, list[str]] = field(default_factory=dict)
    # llama.cpp's converter interleaves the rotary halves of q/k rows for this architecture.
    gguf_rope_interleaved: bool = False
    # A config's `sliding_window` applies unless it says `use_sliding_window: false` (Mistral, Phi-3);
    # otherwise only when it says true (Qwen2/3).
    sliding_window_by_default: bool = False
