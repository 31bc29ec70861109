"""Where a compiled CUDA decode step spends its time, per weight format and linear kernel.

    python benchmarks/cuda_decode.py [--shape llama-2-7b] [--layers 4] [--tokens 128] [--top 4] [--pdl]

The model is `random:SHAPE` cut to its first `--layers` blocks (a block's cost is what differs
between formats; fewer blocks compile faster). Each variant is compiled as `genfast generate`
compiles it (CUDA graphs for decode), then timed over `--tokens` greedy tokens, median of 3, and
profiled for one more run: the table gives ms per token, the share of it the GPU was busy, the
number of CUDA-graph replays and kernel launches per token seen from the host (a replayed step
launches no kernels of its own), the kernels the GPU ran per token, inductor's count of compiled
graphs that skipped CUDA graphs, and the kernels that took the most GPU time.

Variants: bf16; int8 per channel and int4 in groups of 32 (with an int8 output head), each with
genfast's Triton kernels and with torch's (QuantLinear's "int8pack": inductor's fused multiply-sum
over int8 codes; "int4pack": tinygemm); "int4 g32 tinygemm" is what genfast runs by default
(tinygemm for the blocks, the Triton GEMV for the int8 head), "int4 g128 tinygemm" the same with
a quarter of the scales' bytes.
"""

from __future__ import annotations

import argparse
from collections import Counter
from statistics import median

import torch
from torch._dynamo.utils import counters

from genfast.llm.loading import LoadedModel, load
from genfast.llm.recipe import make_generator
from genfast.quant.linear import QuantLinear

VARIANTS = {  # name -> (quant, group size, the kernel per weight bits: int4 models keep an int8 output head)
    "bf16": ("none", None, {}),
    "int8 triton": ("int8", None, {8: "triton"}),
    "int8 torch": ("int8", None, {8: "int8pack"}),
    "int4 g32 triton": ("int4", 32, {4: "triton", 8: "triton"}),
    "int4 g32 torch": ("int4", 32, {4: "int4pack", 8: "int8pack"}),
    "int4 g32 tinygemm": ("int4", 32, {4: "int4pack", 8: "triton"}),
    "int4 g128 tinygemm": ("int4", 128, {4: "int4pack", 8: "triton"}),
}


def build(shape: str, layers: int, quant: str, group_size: int | None, kernels: dict[int, str]) -> LoadedModel:
    loaded = load(f"random:{shape}", "cuda", "bfloat16", quant=quant, group_size=group_size)
    loaded.model.layers = loaded.model.layers[:layers]
    for name, layer in list(loaded.model.named_modules()):
        if isinstance(layer, QuantLinear) and layer.kernel != kernels[layer.bits]:
            kernel = kernels[layer.bits]
            loaded.model.set_submodule(name, QuantLinear(layer.quantized_weight(), layer.bias, kernel=kernel))
    return loaded


def profile_step(generate, tokens: int) -> tuple[float, Counter, int, int, int]:
    """One profiled run (the prompt's prefill included): GPU-busy ms per token, kernel ms per token
    by name, host launch counts, and the kernels the GPU ran: a step whose GPU idles between
    kernels inside one graph replay runs many short ones (the question tinygemm's 69% busy left
    on an H100)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate()
    kernels: Counter = Counter()
    busy = 0.0
    replays = launches = gpu_kernels = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:60]] += event.device_time / 1000 / tokens
            gpu_kernels += 1
            busy += event.device_time / 1000
        elif "GraphLaunch" in event.name:  # cudaGraphLaunch (a versioned name on some runtimes)
            replays += 1
        elif "LaunchKernel" in event.name:  # cudaLaunchKernel, cuLaunchKernel(Ex) (Triton's), ...
            launches += 1
    return busy / tokens, kernels, replays, launches, gpu_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-2-7b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--top", type=int, default=4, help="kernels listed per variant, by GPU time")
    parser.add_argument(
        "--pdl",
        action="store_true",
        help="time each variant again compiled with inductor's Programmatic Dependent Launch (Hopper and "
        "later: a kernel starts while the one before it drains), as 'VARIANT, PDL'",
    )
    args = parser.parse_args()
    if args.pdl and not hasattr(torch._inductor.config.triton, "enable_pdl"):
        print(f"torch {torch.__version__}'s inductor has no triton.enable_pdl: no PDL rows\n")
        args.pdl = False
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; random:{args.shape}, {args.layers} blocks\n")
    rows, tops = [], []
    prompt = list(range(10, 42))
    runs = [(variant, pdl) for variant in args.variants.split(",") for pdl in ((False, True) if args.pdl else (False,))]
    for variant, pdl in runs:
        quant, group_size, kernels = VARIANTS[variant]
        torch._dynamo.reset()
        counters.clear()
        loaded = build(args.shape, args.layers, quant, group_size, kernels)
        generator = make_generator(loaded, len(prompt) + args.tokens + 8, 1, True)
        name = f"{variant}, PDL" if pdl else variant

        def generate(generator=generator):
            return generator.generate([prompt], args.tokens, stop_at_eos=False)

        # (the steps compile at their first call; a benchmark's A/B, not how genfast compiles)
        with torch._inductor.config.patch({"triton.enable_pdl": True} if pdl else {}):
            for _ in range(2):  # compile, then record the CUDA graphs
                generate()
        rates = [generate().decode_tok_s for _ in range(3)]
        ms = 1000 / median(rates)
        busy, kernels, replays, launches, gpu_kernels = profile_step(generate, args.tokens)
        skips = counters["inductor"]["cudagraph_skips"]
        per_token = f"{replays / args.tokens:.2f} | {launches / args.tokens:.1f} | {gpu_kernels / args.tokens:.0f}"
        rows.append(f"| {name} | {ms:.3f} | {busy / ms:.0%} | {per_token} | {skips} |")
        top = ", ".join(f"{k} {v:.3f}" for k, v in kernels.most_common(args.top))
        tops.append(f"| {name} | {top} |")
        print(rows[-1], tops[-1], sep="\n", flush=True)  # as each finishes: a stopped run keeps them
        del generator, loaded
        torch.cuda.empty_cache()
    print("\n| variant | ms per token | GPU busy | graph replays per token | kernel launches per token "
          "| GPU kernels per token | graphs that skipped CUDA graphs |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n| variant | kernels with the most GPU time (ms per token) |\n|---|---|")
    print("\n".join(tops))


if __name__ == "__main__":
    main()
