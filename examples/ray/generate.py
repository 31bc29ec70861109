"""Answer a JSONL file of prompts on a Ray cluster with genfast (Ray Data, genfast.LLM per actor).

    ray start --head                                   # or join an existing cluster
    python examples/ray/generate.py prompts.jsonl answers/ --model smollm2-135m-instruct --actors 2

prompts.jsonl: {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]} a line. answers/
receives JSONL files whose rows are the input rows with text, finish_reason, prompt_tokens,
completion_tokens and error. genfast.ray.llm.generate_jsonl does the same from Python; `genfast
generate --input prompts.jsonl --output answers.jsonl --ray` writes one answers file instead.
"""

import argparse

import ray

from genfast import LLM

parser = argparse.ArgumentParser()
parser.add_argument("prompts")
parser.add_argument("answers")
parser.add_argument("--model", default=None)
parser.add_argument("--actors", type=int, default=1)
parser.add_argument("--max-new-tokens", type=int, default=128)
args = parser.parse_args()

ray.init(address="auto")
rows = ray.data.read_json(args.prompts, lines=True, num_cpus=0)
answers = rows.map_batches(
    LLM,  # each actor loads the model once (LLM.__init__) and answers batches (LLM.__call__)
    fn_constructor_kwargs={"model": args.model, "threads": 1},
    fn_kwargs={"max_new_tokens": args.max_new_tokens},
    compute=ray.data.ActorPoolStrategy(size=args.actors),
    batch_size=16,
    batch_format="numpy",
    num_cpus=1,
)
answers.write_json(args.answers, ray_remote_args={"num_cpus": 0})
