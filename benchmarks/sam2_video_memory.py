"""SAM 2 video tracking memory over a long clip: does genfast's resident memory stay flat as the
frames go by? (The official package decodes every frame into memory at init_state and keeps every
frame's memory; genfast streams frames and keeps what the tracker can still read.)

Writes an H.264 clip of --frames frames at --size (default 300 at 1920x1080) with two moving
shapes, clicks two objects on frame 0 and propagates to the end with random weights at the real
architecture (speed and memory do not depend on weight values), printing the resident set every
--every frames and a table at the end: frames, seconds, resident GB, growth since the first
report, and how much of it is decoded frames kept for going back (genfast's LRU of RGB frames,
bounded by --frame-cache-mb: it fills over the first frames, then stays at its bound). The model
runs the recipe up to --step (default fused-attention: eager, the native attention kernel where
the CPU has one) in --dtype (default auto: bfloat16 where the CPU computes in it natively, else
float32).

    python benchmarks/sam2_video_memory.py --model sam2.1-hiera-tiny --frames 300 --size 1920x1080
"""

from __future__ import annotations

import argparse
import platform
import resource
import tempfile
import time
from pathlib import Path

import av
import numpy as np
import torch


def resident_gb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 1e9


def write_clip(path: Path, frames: int, width: int, height: int) -> None:
    container = av.open(str(path), "w")
    stream = container.add_stream("libx264", rate=30, options={"crf": "23"})
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    y, x = np.mgrid[0:height, 0:width]
    background = np.stack([(x // 16) % 256, (y // 12) % 256, ((x + y) // 20) % 256], axis=2).astype(np.uint8) // 2
    for i in range(frames):
        frame = background.copy()
        cx, cy = int(width * 0.3) + 3 * i % (width // 2), int(height * 0.35)
        frame[cy - 150 : cy + 150, max(cx - 200, 0) : cx + 200] = (220, 60, 60)
        cx, cy = int(width * 0.7) - 2 * i % (width // 2), int(height * 0.65)
        frame[cy - 120 : cy + 120, max(cx - 120, 0) : cx + 120] = (60, 200, 90)
        for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
            container.mux(packet)
    for packet in stream.encode():
        container.mux(packet)
    container.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sam2.1-hiera-tiny")
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--size", default="1920x1080", help="WIDTHxHEIGHT")
    parser.add_argument("--every", type=int, default=25, help="report every N frames")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto")
    parser.add_argument("--step", default="fused-attention", help="the SAM recipe's step to run up to")
    parser.add_argument(
        "--frame-cache-mb", type=float, default=None, help="bound of the decoded-frame cache (default: genfast's)"
    )
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))

    from genfast.interface.process import prepare_process
    from genfast.platform.hardware import describe_isa, dtype_name
    from genfast.recipe import Target
    from genfast.sam.recipe import RECIPE, apply_recipe
    from genfast.sam.sam2.build import build_random_sam2
    from genfast.sam.sam2.video import SAM2VideoPredictor
    from genfast.sam.video_io import DEFAULT_CACHE_BYTES, open_video

    prepare_process()  # as `genfast segment` runs: malloc's thresholds settled (genfast/platform/heap.py)
    step = args.step
    plan = RECIPE.plan(step, Target(torch.device("cpu"), dtype_name(args.dtype)))
    with tempfile.TemporaryDirectory(prefix="genfast-sam2-memory-") as tmp:
        clip = Path(tmp) / "clip.mp4"
        write_clip(clip, args.frames, width, height)
        model = apply_recipe(build_random_sam2(args.model), plan.settings)
        predictor = SAM2VideoPredictor(model)
        start_rss = resident_gb()
        cache_bytes = DEFAULT_CACHE_BYTES if args.frame_cache_mb is None else int(args.frame_cache_mb * 2**20)
        video = open_video(clip, cache_bytes)
        state = predictor.init_state(video)
        for obj, (fx, fy) in enumerate(((0.3, 0.35), (0.7, 0.65)), start=1):
            point = np.array([[fx * width, fy * height]], dtype=np.float32)
            predictor.add_new_points_or_box(state, 0, obj, points=point, labels=np.array([1], np.int32))
        rows, first = [], None
        start = time.perf_counter()
        with torch.inference_mode():
            for frame, _, _ in predictor.propagate_in_video(state):
                if (frame + 1) % args.every == 0 or frame + 1 == args.frames:
                    rss = resident_gb()
                    first = rss if first is None else first
                    cached = video.cached_bytes() / 1e9
                    rows.append((frame + 1, time.perf_counter() - start, rss, rss - first, cached))
                    print(f"frame {frame + 1}: {rss:.2f} GB resident, {cached:.2f} GB of it cached frames", flush=True)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(
        f"\n{args.model}, random weights, recipe {step} in {plan.settings.dtype}; {args.frames} frames of "
        f"{width}x{height} H.264; {platform.processor() or platform.machine()}, {describe_isa()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; resident before init_state {start_rss:.2f} GB, "
        f"peak {peak:.2f} GB; decoded-frame cache bound {cache_bytes / 1e9:.2f} GB\n"
    )
    print("| frames | seconds | frames/s | resident GB | growth since first report GB | cached frames GB |")
    print("|---|---|---|---|---|---|")
    for frames, seconds, rss, growth, cached in rows:
        print(f"| {frames} | {seconds:.0f} | {frames / seconds:.2f} | {rss:.2f} | {growth:+.3f} | {cached:.2f} |")


if __name__ == "__main__":
    main()
