"""Items per second of the three genfast.ray pipelines with one and with two actors on this machine,
beside the same work in one process without Ray, in one run.

    python benchmarks/ray_actors.py [--workloads llm,sam,diffusion] [--json results.json]

One local Ray node that offers this machine's CPUs (`ray.init(num_cpus=N)`). One actor reserves
every CPU and runs that many threads; two actors reserve half each and run half the threads. Each
rate is items over the wall time of the whole call, the actors' start and model load included (what
a user waits for); the load alone is measured in the one-process row and printed beside it.

Workloads (real architectures; the SAM and diffusion weights are random, which changes no timing):
- llm: SmolLM2-135M-Instruct (genfast's demo model), 1024 prompts, up to 64 greedy tokens each, bf16
  where the CPU has native bf16, eager (each actor would compile its own graphs), 16 rows a call.
- sam: SAM ViT-B, 24 photos-sized images (640x480), one point each, bf16, 4 images per encoder call.
- diffusion: SD 1.5, 8 prompts at 256x256, 4 denoising steps, the default recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genfast.bench.machine import describe_machine, machine_info

LLM_PROMPTS, LLM_TOKENS = 1024, 64
# Rows an actor takes a call: four times its 16 slots, so that its engine refills slots as answers
# finish instead of draining to the last answer of every call.
LLM_ROWS_PER_CALL = 64
SAM_IMAGES = 24
DIFFUSION_PROMPTS = 8


def _llm(threads: int) -> dict[str, Any]:
    return {"model": "smollm2-135m-instruct", "compile": False, "max_batch": 16, "threads": threads}


def _segmenter(threads: int) -> dict[str, Any]:
    return {"model": "sam-vit-b", "random_weights": True, "dtype": "bfloat16", "threads": threads, "batch_size": 4}


def _generator(threads: int, folder: Path) -> dict[str, Any]:
    return {"model": str(folder / "sd15"), "size": "256x256", "steps": 4, "threads": threads}


def _inputs(folder: Path, workloads: list[str]) -> dict[str, Any]:
    """The chosen workloads' inputs, written into `folder`."""
    inputs: dict[str, Any] = {"folder": folder}
    if "llm" in workloads:
        inputs["prompts"] = folder / "prompts.jsonl"
        lines = [json.dumps({"id": i, "prompt": f"Tell me about the number {i}."}) for i in range(LLM_PROMPTS)]
        inputs["prompts"].write_text("".join(line + "\n" for line in lines))
    if "sam" in workloads:
        from PIL import Image

        rng = np.random.default_rng(0)
        inputs["photos"] = [folder / f"photo-{i:02d}.png" for i in range(SAM_IMAGES)]
        for path in inputs["photos"]:
            Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(path)
    if "diffusion" in workloads:
        from genfast.diffusion.pipelines import random_pipeline

        # SD 1.5 at its real size with random weights, saved as a diffusers directory for the actors.
        random_pipeline("sd15", dtype=torch.bfloat16).save_pretrained(folder / "sd15")
        inputs["drawings"] = folder / "drawings.txt"
        inputs["drawings"].write_text("".join(f"a lighthouse at dusk, study {i}\n" for i in range(DIFFUSION_PROMPTS)))
    return inputs


def _alone(workload: str, inputs: dict[str, Any], threads: int) -> tuple[float, float]:
    """(load seconds, work seconds) of the workload's genfast object in this process."""
    start = time.perf_counter()
    if workload == "llm":
        from genfast.serve.offline import LLM

        model = LLM(**_llm(threads))
        loaded = time.perf_counter()
        texts = [json.loads(line)["prompt"] for line in inputs["prompts"].read_text().splitlines()]
        model.generate(texts, max_new_tokens=LLM_TOKENS)
        model.close()
    elif workload == "sam":
        from genfast.sam.segmenter import Segmenter

        model = Segmenter(**_segmenter(threads))
        loaded = time.perf_counter()
        model.segment(inputs["photos"], points=[[320, 240]])
    else:
        from genfast.diffusion.generator import ImageGenerator

        model = ImageGenerator(**_generator(threads, inputs["folder"]))
        loaded = time.perf_counter()
        model.generate(inputs["drawings"].read_text().splitlines(), seed=0)
    return loaded - start, time.perf_counter() - loaded


def _on_ray(workload: str, inputs: dict[str, Any], out: Path, actors: int, cpus: int) -> None:
    per_actor = cpus // actors
    if workload == "llm":
        from genfast.ray.llm import generate_jsonl

        generate_jsonl(
            inputs["prompts"], out, _llm(per_actor), sampling={"max_new_tokens": LLM_TOKENS},
            batch_size=LLM_ROWS_PER_CALL, concurrency=actors, cpus_per_actor=per_actor,
        )  # fmt: skip
    elif workload == "sam":
        from genfast.ray.sam import segment_images

        segment_images(
            inputs["photos"], out, _segmenter(per_actor), prompt={"points": [[320, 240]]}, concurrency=actors,
            cpus_per_actor=per_actor,
        )  # fmt: skip
    else:
        from genfast.ray.diffusion import imagine_folder

        generator = _generator(per_actor, inputs["folder"])
        imagine_folder(inputs["drawings"], out, generator, concurrency=actors, cpus_per_actor=per_actor)


def _timed(run: Callable[[], None]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _rows(workload: str, inputs: dict[str, Any], folder: Path, cpus: int) -> list[dict[str, Any]]:
    n = {"llm": LLM_PROMPTS, "sam": SAM_IMAGES, "diffusion": DIFFUSION_PROMPTS}[workload]
    load_s, work_s = _alone(workload, inputs, cpus)
    rows = [{"workload": workload, "run": "one process", "items": n, "load_s": load_s,
             "items_s": n / (load_s + work_s), "items_s_loaded": n / work_s}]  # fmt: skip
    for actors in (1, 2):
        wall = _timed(lambda a=actors: _on_ray(workload, inputs, folder / f"{workload}-{a}", a, cpus))
        rows.append({"workload": workload, "run": f"Ray, {actors} actor{'s' * (actors > 1)}", "items": n,
                     "items_s": n / wall})  # fmt: skip
    for row in rows:
        once = f"  {row['items_s_loaded']:.3f} once loaded ({row['load_s']:.1f} s load)" if "load_s" in row else ""
        print(f"{workload:10s} {row['run']:16s} {n:4d} items {row['items_s']:8.3f} items/s{once}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="llm,sam,diffusion")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs the Ray node offers")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    rows = []
    machine = machine_info("cpu")
    print(describe_machine(machine))
    workloads = args.workloads.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        inputs = _inputs(folder, workloads)
        ray.init(num_cpus=args.cpus, log_to_driver=False, configure_logging=False, include_dashboard=False)
        try:
            for workload in workloads:
                rows += _rows(workload, inputs, folder, args.cpus)
        finally:
            ray.shutdown()
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
