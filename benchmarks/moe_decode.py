"""Decode speed and MBU of real-shaped models with random weights (speed does not depend on them):
Qwen3-0.6B (dense) and Qwen3-30B-A3B's mixture of experts, reduced in layers to fit in memory.

    python benchmarks/moe_decode.py [--shapes qwen3-0.6b,qwen3-30b-a3b] [--moe-layers 6]
                                    [--quant none,int8,int4] [--new-tokens 64] [--repeats 3]

Per shape and weight format: a compiled model, greedy decode of --new-tokens after a 16-token
prompt, the median decode tok/s of --repeats runs, the weight bytes a step reads (a mixture's
experts: only the 8 of 128 each token runs; genfast.llm.decoding.stats) and MBU against the machine's
measured read bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from genfast.bench.machine import machine_info, peak_read_bandwidth
from genfast.llm.checkpoints.quantize import HEAD, INT4_HEAD_BITS
from genfast.llm.checkpoints.tokenizer import Tokenizer
from genfast.llm.decoding.generate import Generator
from genfast.llm.decoding.stats import weight_bytes_per_step
from genfast.llm.model.config import ModelArgs
from genfast.llm.model.transformer import Transformer
from genfast.quant.linear import quantize_linears

# From the published config.json files.
QWEN3_06B = ModelArgs(
    vocab_size=151936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, intermediate_size=3072, head_dim=128,
    norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960, tie_embeddings=True, family="qwen3",
)  # fmt: skip
QWEN3_30B_A3B = ModelArgs(
    vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, intermediate_size=6144, head_dim=128,
    norm_eps=1e-6, rope_theta=1e6, max_seq_len=40960, family="qwen3_moe", n_experts=128, n_active_experts=8,
    expert_intermediate_size=768, normalize_expert_weights=True,
)  # fmt: skip


def random_model(args: ModelArgs, dtype: torch.dtype) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # filled in fp32 chunks, stored in `dtype`
            p.data = p.data.to(dtype)
            for chunk in p.data.view(-1).split(1 << 24):
                chunk.copy_(torch.randn(chunk.shape, generator=generator) * 0.02)
    model.reset_rope()
    return model.eval().requires_grad_(False)


def numbered_tokenizer(vocab_size: int) -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, bos_id=None, add_bos=False, stop_ids=set())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-0.6b,qwen3-30b-a3b")
    parser.add_argument("--moe-layers", type=int, default=6, help="layers kept of Qwen3-30B-A3B's 48")
    parser.add_argument("--quant", default="none,int8,int4")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    shapes = {"qwen3-0.6b": QWEN3_06B, "qwen3-30b-a3b": dataclasses.replace(QWEN3_30B_A3B, n_layers=args.moe_layers)}
    peak = peak_read_bandwidth("cpu")
    info = machine_info("cpu")
    print(f"{info['device']} ({info['isa']}), {torch.get_num_threads()} threads, read {peak / 1e9:.1f} GB/s\n")
    print("| model | weights | parameters (active per token) | weight bytes/token | decode tok/s | GB/s | MBU |")
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        shape = shapes[name]
        for quant in args.quant.split(","):
            model = random_model(shape, torch.bfloat16)
            if quant != "none":  # as --quant does: an int4 model keeps its output head in int8
                bits = 8 if quant == "int8" else 4
                quantize_linears(model, bits, None if bits == 8 else 32, keep=lambda name, _: name == HEAD)
                quantize_linears(model, INT4_HEAD_BITS if bits == 4 else bits)  # what is left: the head
            gen = Generator(model, numbered_tokenizer(shape.vocab_size), max_seq_len=256, compile=True)
            gen.warmup()
            prompt = list(range(100, 116))
            runs = [gen.generate([prompt], args.new_tokens, stop_at_eos=False) for _ in range(args.repeats)]
            rate = statistics.median(r.decode_tok_s for r in runs)
            weights = weight_bytes_per_step(model)
            layers = f" ({shape.n_layers} layers)" if shape.n_experts else ""
            traffic = weights * rate
            print(
                f"| {name}{layers} | {quant} | {shape.n_params / 1e9:.2f} B ({shape.n_active_params / 1e9:.2f} B) | "
                f"{weights / 1e6:.0f} MB | {rate:.1f} | {traffic / 1e9:.1f} | {100 * traffic / peak:.0f}% |",
                flush=True,
            )
            del gen, model


if __name__ == "__main__":
    main()
