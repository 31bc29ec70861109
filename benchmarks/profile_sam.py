"""Where one vit_b image's time goes at a recipe step: cold first call (compile), warm timings of
set_images and predict, and a torch profiler table of one warm call (random weights).

    python benchmarks/profile_sam.py [--step dynamic-int8]
"""

import argparse
import time

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from genfast.recipe import Target
from genfast.sam.bench import _centre_prompt, bench_images
from genfast.sam.build import build_random_sam
from genfast.sam.predictor import SamPredictor
from genfast.sam.recipe import RECIPE, apply_recipe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--step", default="dynamic-int8", choices=RECIPE.names)
    parser.add_argument("--dtype", default="auto", help="the bf16 step's dtype (as for genfast bench sam)")
    args = parser.parse_args()
    inductor_config.cpp.enable_kernel_profile = True  # this script only: inductor's kernels by name
    images, _ = bench_images(1)
    prompt = _centre_prompt(images[0])
    recipe = RECIPE.plan(args.step, Target(torch.device("cpu"), args.dtype)).settings
    model = apply_recipe(build_random_sam("vit_b"), recipe)
    predictor = SamPredictor(model, encoder_batch_size=1 if recipe.compile else None)

    def run() -> tuple[float, float]:
        start = time.perf_counter()
        predictor.set_images(images)
        encoded = time.perf_counter()
        predictor.predict(**prompt, multimask_output=False)
        return encoded - start, time.perf_counter() - encoded

    with torch.inference_mode():
        for i in range(3):
            encode_s, predict_s = run()
            print(f"{'cold' if i == 0 else 'warm'}: set_images {encode_s:.2f} s, predict {predict_s:.3f} s")
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
