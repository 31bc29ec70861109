"""Draw a JSONL file of prompts on a Ray cluster with genfast (Ray Data, genfast.ImageGenerator per actor).

    ray start --head                                   # or join an existing cluster
    python examples/ray/imagine.py prompts.jsonl images/ --model ./sdxl-turbo --actors 2

prompts.jsonl: {"id": ..., "prompt": "..."} a line, optionally with "seed" and "negative". Each row's
image comes back to this process and is written as images/ID.png. `genfast imagine --prompts
prompts.jsonl -o images/ --ray` does the same and more (a re-run skips the PNGs already there,
bad rows are named, seeds follow the line numbers); this is the pipeline written out for those who
build their own around genfast.ImageGenerator.
"""

import argparse
from pathlib import Path

import ray
from PIL import Image

from genfast import ImageGenerator

parser = argparse.ArgumentParser()
parser.add_argument("prompts")
parser.add_argument("images")
parser.add_argument("--model", required=True)
parser.add_argument("--random-weights", action="store_true", help="a tiny random pipeline (tiny-sd15 ...)")
parser.add_argument("--actors", type=int, default=1)
parser.add_argument("--denoising-steps", type=int, default=30)
args = parser.parse_args()

ray.init(address="auto")
rows = ray.data.read_json(args.prompts, lines=True, num_cpus=0)
generator = {"model": args.model, "random_weights": args.random_weights, "steps": args.denoising_steps, "threads": 1}
drawn = rows.map_batches(
    ImageGenerator,  # each actor loads the pipeline once (__init__) and draws batches (__call__)
    fn_constructor_kwargs=generator,
    compute=ray.data.ActorPoolStrategy(size=args.actors),
    batch_size=1,
    batch_format="numpy",
    num_cpus=1,
)
folder = Path(args.images)
folder.mkdir(parents=True, exist_ok=True)
for batch in drawn.iter_batches(batch_format="numpy"):
    for row_id, image, error in zip(batch["id"], batch["image"], batch["error"]):
        if isinstance(error, str):  # a row that could not run: its reason
            print(f"{row_id}: {error}")
        else:
            Image.fromarray(image).save(folder / f"{row_id}.png")
