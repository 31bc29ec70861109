"""Write a Hugging Face checkpoint with random weights at a published model's shape, for measuring
speed where no weights can be downloaded (speed does not depend on the values).

    python benchmarks/random_llm.py --shape llama-2-7b --output /tmp/llama-2-7b [--device cuda]

Shapes (from the models' published config.json files): llama-2-7b, llama-3.1-8b, tinyllama-1.1b,
llama-3.2-1b. The directory holds config.json, one safetensors file per block (with the index)
and a byte-level BPE tokenizer trained on Python's pydoc topics, so `genfast bench llm`'s prompts
encode to real-looking text (its vocabulary is smaller than the model's; ids stay in range). The
tokenizer has no end-of-sequence token: generation always runs to its length. Weights are
N(0, 0.02) in bf16, norms are ones; the output is written to a staging folder and renamed.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5)
SHAPES = {
    "llama-2-7b": dict(
        LLAMA, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "llama-3.1-8b": dict(
        LLAMA, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    "tinyllama-1.1b": dict(
        LLAMA, vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048, rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        LLAMA, vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
}  # fmt: skip


def block_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors of one block, by their names after `model.layers.{i}.`."""
    dim, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = dim // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    return {
        "self_attn.q_proj.weight": (dim, dim),
        "self_attn.k_proj.weight": (kv, dim),
        "self_attn.v_proj.weight": (kv, dim),
        "self_attn.o_proj.weight": (dim, dim),
        "mlp.gate_proj.weight": (inter, dim),
        "mlp.up_proj.weight": (inter, dim),
        "mlp.down_proj.weight": (dim, inter),
        "input_layernorm.weight": (dim,),
        "post_attention_layernorm.weight": (dim,),
    }


def random_tensor(shape: tuple[int, ...], generator: torch.Generator, device: str) -> torch.Tensor:
    if len(shape) == 1:  # a norm's weight
        return torch.ones(shape, dtype=torch.bfloat16)
    values = torch.empty(shape, dtype=torch.float32, device=device).normal_(0, 0.02, generator=generator)
    return values.to(torch.bfloat16).cpu()


def train_tokenizer(vocab_size: int, directory: Path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from genfast.llm.corpus import pydoc_text
    from genfast.llm.tokenizer import Tokenizer

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 32000), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator([pydoc_text()], trainer)
    Tokenizer(backend, bos_id=None, add_bos=False, stop_ids=set()).save(directory)


def write_checkpoint(shape: str, output: Path, device: str = "cpu", seed: int = 0) -> Path:
    config = SHAPES[shape]
    if output.exists():
        raise SystemExit(f"{output} exists; choose another --output")
    staging = output.with_name(output.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    generator = torch.Generator(device=device).manual_seed(seed)
    dim, vocab = config["hidden_size"], config["vocab_size"]
    weight_map: dict[str, str] = {}

    def save(tensors: dict[str, torch.Tensor], filename: str) -> None:
        save_file(tensors, str(staging / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))

    outer = {
        "model.embed_tokens.weight": random_tensor((vocab, dim), generator, device),
        "model.norm.weight": random_tensor((dim,), generator, device),
    }
    if not config["tie_word_embeddings"]:
        outer["lm_head.weight"] = random_tensor((vocab, dim), generator, device)
    save(outer, "model-outer.safetensors")
    for i in range(config["num_hidden_layers"]):
        block = {
            f"model.layers.{i}.{name}": random_tensor(s, generator, device) for name, s in block_shapes(config).items()
        }
        save(block, f"model-{i:03d}.safetensors")
    index = {"metadata": {}, "weight_map": weight_map}
    (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (staging / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=1))
    train_tokenizer(vocab, staging)
    staging.rename(output)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES))
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--device", default="cpu", help="where the random numbers are drawn (cuda is faster)")
    args = parser.parse_args()
    print(write_checkpoint(args.shape, args.output, args.device))


if __name__ == "__main__":
    main()
