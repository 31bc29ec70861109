"""Many prompts on a Ray cluster, through `genfast.LLM` actors.

`generate_file` is `genfast generate --input F --output F --ray`: the answers file a single
machine writes (genfast/serve/batch_file.py), written by this process as answers arrive, resumed
by a re-run. `generate_jsonl` is the plain Ray Data pipeline for clusters whose output goes to
shared storage: input rows are what `--input` reads (`prompt` or `messages`, optional sampling
fields); every input column comes out again with `text`, `finish_reason`, `prompt_tokens`,
`completion_tokens` and `error` (the reason a row could not run; its text is then null), written
by Ray Data as one JSONL file per block into the output folder, in no particular order: join on
your own id column.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from genfast.errors import UserError
from genfast.interface.batch import Summary
from genfast.ray.cluster import connect, leaving_ray, map_through, write_jsonl


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
    # Reading takes no CPU either (see write_jsonl).
    dataset = ray.data.read_json(str(source.resolve()), lines=True, num_cpus=0)
    return write_jsonl(
        map_through(ray, dataset, LLM, llm, sampling or {}, concurrency, batch_size, cpus_per_actor), target
    )


def generate_file(
    input_path: str | Path,
    output_path: str | Path,
    llm: dict[str, Any],
    *,
    sampling: dict[str, Any],
    address: str | None = None,
    concurrency: int = 1,
    batch_size: int = 16,
    cpus_per_actor: float = 1,
    stream: TextIO | None = None,
) -> Summary:
    """`genfast generate --input --output` on the cluster: the same output file as on one machine.

    The input is read here, with the single-process reader (the same bad lines), and the items not
    yet in `output_path` go to `concurrency` actors of `genfast.LLM(**llm)` as rows; the answers
    come back to this process, which appends each to `output_path` as its batch arrives. A stop
    leaves only whole lines, which a re-run skips; a killed actor is restarted and its rows run
    again (Ray Data's defaults for actor pools). `sampling`: the options of items that set none."""
    from genfast.serve.batch_file import AnswerFile, completed_ids, item_row, read_items
    from genfast.serve.offline import LLM

    stream = stream if stream is not None else sys.stderr
    source, target = Path(input_path).expanduser(), Path(output_path).expanduser()
    summary = Summary()
    items = read_items(source, summary, stream)
    answered = completed_ids(target)
    todo = [item for item in items if json.dumps(item.id) not in answered]
    summary.skipped = len(items) - len(todo)
    if not todo:
        return summary
    ray = connect(address)
    rows = ray.data.from_items([item_row(item) for item in todo])
    answers = map_through(ray, rows, LLM, llm, sampling, concurrency, batch_size, cpus_per_actor)
    by_line = {item.line: item for item in todo}
    with AnswerFile(target, summary, len(todo), stream) as out:
        for batch in answers.iter_batches(batch_size=None, batch_format="numpy"):
            for index, line in enumerate(batch["line"]):
                error = batch["error"][index]
                out.add(
                    by_line[int(line)], error if isinstance(error, str) else None, batch["text"][index],
                    batch["finish_reason"][index], int(batch["prompt_tokens"][index]),
                    int(batch["completion_tokens"][index]),
                )  # fmt: skip
    return summary


def generate_command(args: argparse.Namespace) -> int:
    """`genfast generate --input F --output F --ray [ADDRESS]`: the file on the cluster. Exit
    status 1 when an item was left out."""
    from genfast.serve.batch_file import check_file_flags

    source, target, defaults = check_file_flags(args)
    llm = dict(
        model=args.model, recipe=args.recipe, quant=args.quant, device=args.device, dtype=args.dtype,
        threads=args.threads or args.cpus_per_actor, compile=args.compile, batch_invariant=args.batch_invariant,
        max_batch=args.max_batch, max_seq_len=args.max_seq_len,
    )  # fmt: skip
    with leaving_ray():
        summary = generate_file(
            source, target, llm, sampling=defaults, address=args.ray, concurrency=args.actors,
            batch_size=2 * args.max_batch, cpus_per_actor=args.cpus_per_actor,
        )  # fmt: skip
    print(f"genfast: {summary.line()} on Ray; answers in {target}", file=sys.stderr, flush=True)
    return 1 if summary.failed else 0
