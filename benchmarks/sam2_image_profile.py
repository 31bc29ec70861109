"""Where a SAM 2 image goes: the image predictor (set_image and one point, as `genfast bench sam`
times it) under torch's profiler, its time per image grouped by kind of work, and the minor page
faults per image (memory faulted in afresh: genfast/platform/heap.py).

    python benchmarks/sam2_image_profile.py --model sam2.1-hiera-tiny --step dynamic-int8

Random weights at the real architecture. The process is prepared as `genfast` prepares its own
(malloc's thresholds settled); a step that compiles loads the encoder compiled by an earlier run,
or compiles it first. The groups: genfast's attention kernel, its int8 linears, oneDNN's floating-
point linears, the compiled graphs' own kernels (inductor's fused elementwise work), the rest.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

GROUPS = {
    "genfast::attention": "attention (genfast's kernel)",
    "genfast::qlinear_dynamic": "int8 linears (genfast's kernel)",
    "mkldnn::_linear_pointwise": "floating-point linears (oneDNN)",
    "aten::addmm": "floating-point linears (ATen)",
    "aten::mm": "floating-point linears (ATen)",
    "## Call CompiledFxGraph None ##": "compiled graphs' own kernels",
}


def minor_faults() -> int:
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[7])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sam2.1-hiera-tiny")
    parser.add_argument("--step", default="dynamic-int8", help="the SAM recipe's step to run up to")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto")
    parser.add_argument("--images", type=int, default=5, help="images profiled (after three unprofiled ones)")
    parser.add_argument("--top", type=int, default=15, help="the slowest operator calls listed, by input shape")
    args = parser.parse_args()

    from genfast.interface.process import prepare_process
    from genfast.platform.hardware import describe_isa, dtype_name
    from genfast.recipe import Target
    from genfast.sam.bench import _centre_prompt, bench_images
    from genfast.sam.recipe import RECIPE, apply_recipe
    from genfast.sam.sam2.build import build_random_sam2
    from genfast.sam.sam2.predictor import SAM2ImagePredictor

    prepare_process()
    plan = RECIPE.plan(args.step, Target(torch.device("cpu"), dtype_name(args.dtype)))
    predictor = SAM2ImagePredictor(apply_recipe(build_random_sam2(args.model), plan.settings))
    image = bench_images(1)[0][0]
    prompt = {**_centre_prompt(image), "multimask_output": False, "return_logits": True}

    with torch.inference_mode():
        seconds, faults = [], []
        for i in range(3 + args.images):
            before, start = minor_faults(), time.perf_counter()
            predictor.set_image(image)
            predictor.predict(**prompt)
            if i >= 3:
                seconds.append(time.perf_counter() - start)
                faults.append(minor_faults() - before)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(args.images):
                predictor.set_image(image)
                predictor.predict(**prompt)

    # An operator's time is its wall time on the calling thread (its own threads work inside it).
    groups: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        groups[GROUPS.get(event.key, "the rest")] += event.self_cpu_time_total / 1e3 / args.images
    print(
        f"\n{args.model}, random weights, recipe {args.step} in {plan.settings.dtype}; {image.shape[1]}x"
        f"{image.shape[0]} image, one point; {platform.processor() or platform.machine()}, {describe_isa()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(
        f"unprofiled: median {np.median(seconds) * 1e3:.0f} ms an image over {args.images}; minor page faults "
        f"{np.median(faults) * 4096 / 2**20:.0f} MiB an image (median)\n"
    )
    print("| work | ms an image (profiled) |")
    print("|---|---|")
    for name, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {ms:.1f} |")
    print(f"\nThe {args.top} slowest operators by input shape:\n")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
