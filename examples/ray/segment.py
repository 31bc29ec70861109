"""Segment a folder of images on a Ray cluster with genfast (Ray Data, genfast.Segmenter per actor).

    ray start --head                                   # or join an existing cluster
    python examples/ray/segment.py photos/ masks/ --model sam2.1-hiera-tiny --point 320,240 --actors 2
    python examples/ray/segment.py photos/ masks/ --everything --actors 2

masks/ receives JSONL files, a row per image: its path, its masks as `genfast segment --json`
writes them (records with uncompressed RLE), num_masks and error (why an image could not be
segmented). genfast.ray.sam.segment_images does the same from Python; `genfast segment photos/
-o masks/ --ray` writes the single-machine command's PNGs and JSON files instead.
"""

import argparse
from pathlib import Path

import ray

from genfast import Segmenter

parser = argparse.ArgumentParser()
parser.add_argument("images", help="a folder of images")
parser.add_argument("masks", help="an empty or new folder for the JSONL output")
parser.add_argument("--model", default=None)
parser.add_argument("--checkpoint", default=None)
parser.add_argument("--point", action="append", default=[], metavar="X,Y")
parser.add_argument("--everything", action="store_true")
parser.add_argument("--actors", type=int, default=1)
parser.add_argument("--address", default="auto")
args = parser.parse_args()

ray.init(address=args.address)
files = sorted(str(p.resolve()) for p in Path(args.images).iterdir() if p.is_file())
rows = ray.data.from_items([{"path": f} for f in files])
prompt = {"everything": True} if args.everything else {"points": [[float(v) for v in p.split(",")] for p in args.point]}
masks = rows.map_batches(
    Segmenter,  # each actor loads the model once (Segmenter.__init__) and segments batches (__call__)
    fn_constructor_kwargs={"model": args.model, "checkpoint": args.checkpoint, "threads": 1},
    fn_kwargs=prompt,
    compute=ray.data.ActorPoolStrategy(size=args.actors),
    batch_size=4,
    batch_format="numpy",
    num_cpus=1,
)
masks.write_json(args.masks, ray_remote_args={"num_cpus": 0})
