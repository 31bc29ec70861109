"""Ray Data pipelines for genfast's workloads, for when one machine is too slow.

Each pipeline reads its inputs into a Ray Dataset, maps them with a genfast object as Ray Data's
callable class (`map_batches(<class>, fn_constructor_kwargs=..., concurrency=N)`: each of the N
actors loads the model once, in `__init__`) and writes the outputs; genfast schedules nothing
itself. A killed actor is restarted and its batches run again (Ray Data's defaults for actor
pools). Ray is an optional extra: `pip install 'genfast[ray]'`; genfast/ray/cluster.py joins a
cluster.

- `genfast.ray.llm.generate_file`: a JSONL file of prompts (what `genfast generate --input`
  reads) -> the answers file the single-machine command writes, resumed by a re-run, through
  `genfast.LLM`; `generate_jsonl`: the same prompts -> Ray Data's folder of JSONL rows.
- `genfast.ray.sam.segment_folder`: a folder or glob of images (what `genfast segment -o OUTDIR`
  reads) -> the mask PNGs and JSON files the single-machine command writes, resumed by a re-run;
  `segment_images`: image files -> Ray Data's folder of JSONL masks, through `genfast.Segmenter`.
- `genfast.ray.diffusion.imagine_folder`: a file of prompts (what `genfast imagine --prompts`
  reads) -> a PNG each in a folder of this machine, through `genfast.ImageGenerator`.
"""
