"""Many prompts on a Ray cluster: JSONL in, a folder of JSONL answers out, through `genfast.LLM`.

Input rows are what `genfast generate --input` reads (`prompt` or `messages`, optional sampling
fields; genfast/serve/batch_file.py); every input column comes out again with `text`,
`finish_reason`, `prompt_tokens`, `completion_tokens` and `error` (the reason a row could not
run; its text is then null). Ray Data writes the answers as one JSONL file per block into the
output folder, in no particular order: join on your own id column.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from genfast.errors import UserError
from genfast.ray.cluster import connect, map_to_jsonl


def generate_jsonl(
    input_path: str | Path,
    output_dir: str | Path,
    llm: dict[str, Any],
    *,
    sampling: dict[str, Any] | None = None,
    address: str | None = None,
    concurrency: int = 1,
    batch_size: int = 16,
    cpus_per_actor: float = 1,
) -> int:
    """Answer every row of `input_path` with `concurrency` actors, each a `genfast.LLM(**llm)`
    reserving `cpus_per_actor` CPUs, `batch_size` rows per call; `sampling`: the options of rows
    that do not set them (`LLM.__call__`'s keywords). Returns the rows written."""
    from genfast.serve.offline import LLM

    source, target = Path(input_path).expanduser(), Path(output_dir).expanduser()
    if not source.is_file():
        raise UserError(f"input file not found: {source}")
    if target.exists() and any(target.iterdir()):
        raise UserError(f"{target} is not empty: give an empty or new folder for the answers")
    ray = connect(address)
    # Reading takes no CPU either (see map_to_jsonl).
    dataset = ray.data.read_json(str(source.resolve()), lines=True, num_cpus=0)
    return map_to_jsonl(
        ray, dataset, LLM, llm, sampling or {}, target, concurrency=concurrency, batch_size=batch_size,
        cpus_per_actor=cpus_per_actor,
    )  # fmt: skip


def generate_command(args: argparse.Namespace) -> int:
    """`genfast generate --input F --output DIR --ray [ADDRESS]`: the file on the cluster."""
    from genfast.serve.batch_file import check_file_flags

    source, target, defaults = check_file_flags(args)
    llm = dict(
        model=args.model, recipe=args.recipe, quant=args.quant, device=args.device, dtype=args.dtype,
        threads=args.threads or args.cpus_per_actor, compile=args.compile, batch_invariant=args.batch_invariant,
        max_batch=args.max_batch, max_seq_len=args.max_seq_len,
    )  # fmt: skip
    rows = generate_jsonl(
        source, target, llm, sampling=defaults, address=args.ray, concurrency=args.actors,
        batch_size=2 * args.max_batch, cpus_per_actor=args.cpus_per_actor,
    )  # fmt: skip
    print(f"genfast: {rows} rows answered on Ray; answers in {target}/ (rows with an error say why)", file=sys.stderr)
    return 0
