"""Models with random weights at published shapes: `--model random:llama-2-7b`.

Speed does not depend on the weights' values, so a benchmark on a machine that cannot download
a model (or before downloading one) can still measure it at its real size. The weights are
drawn on the model's device as each block is built (no checkpoint on disk), N(0, 0.02) with norms
at one, from a seed per tensor name: loading the same shape twice gives the same weights (a
self-draft quantizes the same model). The tokenizer is `genfast.llm.checkpoints.tokenizer.pydoc_tokenizer`
(~9,200 tokens, within every shape's vocabulary), so benchmark prompts encode as text does; it
has no end-of-sequence token, so generation runs to its length. The text is noise.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from genfast.errors import UserError
from genfast.llm.model.config import ModelArgs
from genfast.llm.model.reading import args_from_hf_config

PREFIX = "random:"
_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5)
# From the models' published config.json files.
SHAPES = {
    "llama-2-7b": dict(
        _LLAMA, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "llama-2-70b": dict(
        _LLAMA, vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096, rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "llama-3.1-8b": dict(
        _LLAMA, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    "llama-3.2-1b": dict(
        _LLAMA, vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    "tinyllama-1.1b": dict(
        _LLAMA, vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        _LLAMA, vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
}  # fmt: skip


def is_random(path: Path | str) -> bool:
    return str(path).startswith(PREFIX)


def shape_name(path: Path | str) -> str:
    """The shape a `random:NAME` spec names (checked)."""
    name = str(path).removeprefix(PREFIX).lower()
    if name not in SHAPES:
        raise UserError(f"unknown random-weight shape {name!r}; use random: with one of {', '.join(SHAPES)}")
    return name


def random_args(path: Path | str) -> ModelArgs:
    return args_from_hf_config(SHAPES[shape_name(path)])


def decode_step_shapes(name: str) -> list[tuple[int, int]]:
    """(out, in) of each weight matrix a decode step of shape `name` reads, in order: per block
    the fused qkv, o, fused gate+up and down projections (as genfast's model fuses them), then the
    output head. For benchmarks of the linear kernels at a real model's sizes."""
    c = SHAPES[name]
    dim, ffn = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * dim // c["num_attention_heads"]
    block = [(dim + 2 * kv, dim), (dim, dim), (2 * ffn, dim), (dim, ffn)]
    return block * c["num_hidden_layers"] + [(c["vocab_size"], dim)]


def fill_random(module: torch.nn.Module, prefix: str) -> None:
    """Draw `module`'s parameters (stored under `prefix`) in place on their device: norms (1-D
    weights) are ones, the rest N(0, 0.02), each from a seed of its name."""
    with torch.no_grad():
        for local, param in module.named_parameters(remove_duplicate=False):
            if param.dim() == 1:
                param.fill_(1.0)
                continue
            generator = torch.Generator(device=param.device).manual_seed(zlib.crc32((prefix + local).encode()))
            param.normal_(0.0, 0.02, generator=generator)
