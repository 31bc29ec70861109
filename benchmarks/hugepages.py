"""Decode with the weights in 2 MB pages against PyTorch's own allocations, in one process.

    python benchmarks/hugepages.py --model SmolLM2.gguf [--dtype bfloat16] [--quant int8]
    bash scripts/with_isa.sh avx2 python benchmarks/hugepages.py --model ... --dtype auto

One model, compiled steps and generator; each round moves its weights into a huge-page mapping
(`genfast.platform.hugepages.move_to_hugepages`, what `genfast.llm.session.load` does) or back into
PyTorch's allocator (a copy per tensor, as loading leaves them), then generates. Alternating in
one process matters on a shared host: between processes its speed drifts by more than the effect.
"""

import argparse
import os
import statistics

import torch
from torch import nn

from genfast.bench.machine import device_name
from genfast.compilation.inductor import use_persistent_cache
from genfast.llm.decoding.speculative import make_generator
from genfast.llm.session import load
from genfast.platform import hugepages


def move_to_default_memory(module: nn.Module) -> None:
    """The tensors `move_to_hugepages` moves, copied back into PyTorch's own allocations."""
    for owner, name, tensor in list(hugepages.movable_tensors(module)):
        if name in owner._parameters:
            tensor.data = tensor.data.clone()
        else:
            owner._buffers[name] = tensor.clone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quant", default="none")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=3, help="generations per round")
    args = parser.parse_args()
    use_persistent_cache()
    if hugepages.unavailable_reason():
        raise SystemExit(f"no huge pages here: {hugepages.unavailable_reason()}")
    os.environ[hugepages.ENV] = "0"  # loaded into PyTorch's memory; the rounds move it
    loaded = load(args.model, "cpu", args.dtype, quant=args.quant)
    del os.environ[hugepages.ENV]
    prompt = loaded.tokenizer.encode("The capital of France is")
    prompt = (prompt * (args.prompt_tokens // len(prompt) + 1))[: args.prompt_tokens]
    generator = make_generator(loaded, args.prompt_tokens + args.new_tokens + 32, 1, compile=True)
    generator.warmup()
    generator.generate([prompt], 8, stop_at_eos=False)
    placements = {"PyTorch's allocations": move_to_default_memory, "one huge-page mapping": hugepages.move_to_hugepages}
    decode: dict[str, list[float]] = {name: [] for name in placements}
    print(f"{device_name('cpu')}; {loaded.dtype_label()}, --quant {args.quant}, {args.prompt_tokens}-token prompt")
    print("| round | placement | in 2 MB pages MB | decode tok/s |\n|---|---|---|---|")
    for round_ in range(args.rounds):
        for name, place in placements.items():
            with torch.inference_mode():
                place(loaded.model)
            granted = hugepages.placement(loaded.model)[2]
            # Untimed: the first generation after a move ran at a fraction of the speed (5-12 tok/s
            # against 60-90 after the first move to PyTorch's memory; cause not found).
            generator.generate([prompt], args.new_tokens, stop_at_eos=False)
            for _ in range(args.per_round):
                decode[name].append(generator.generate([prompt], args.new_tokens, stop_at_eos=False).decode_tok_s)
            runs = ", ".join(f"{x:.1f}" for x in decode[name][-args.per_round :])
            print(f"| {round_ + 1} | {name} | {granted / 1e6:.0f} | {runs} |", flush=True)
    base = statistics.median(decode["PyTorch's allocations"])
    for name, values in decode.items():
        median = statistics.median(values)
        print(f"{name}: median {median:.1f} tok/s ({median / base:.3f}x)")


if __name__ == "__main__":
    main()
