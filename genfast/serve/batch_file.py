"""`genfast generate --input prompts.jsonl --output answers.jsonl`: a file of prompts through the
continuous-batching engine, each answer written the moment it is complete.

Input: one JSON object a line, `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages": [...]}`
(a chat conversation, through the model's template), optionally with its own `max_new_tokens`,
`temperature`, `top_k`, `top_p`, `seed` and `stop` (else the command's flags). Blank lines are
skipped. Output: one JSON object a line, in the order the answers finish:
`{"id", "text", "finish_reason", "usage": {"prompt_tokens", "completion_tokens"}}`.

Nothing is lost or done twice. Each answer goes to the output file in one append, flushed to the
disk; a re-run reads the ids already there and skips them. A line cut short (the machine went down
mid-write) is the only thing removed from an existing output, and its item runs again. A bad item
(not JSON, no id, a repeated id, no prompt, a prompt too long for the context) is reported by its
line and id and left out, and the rest run; it is not written, so a later run tries it again.
Ctrl-C stops at once and leaves only complete answers.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from genfast.errors import UserError
from genfast.interface.batch import Summary
from genfast.llm.decoding.sampling import SamplingParams

if TYPE_CHECKING:
    from genfast.serve.engine import Engine, Finished, GenerationRequest, Ticket

OPTIONS = {"max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int, "stop": list}
FIELDS = {"id", "prompt", "messages", *OPTIONS}


@dataclass(frozen=True)
class Item:
    """One input line: its id, the prompt text (a conversation already through the template) and
    the options it sets."""

    line: int
    id: Any
    prompt: str | None
    messages: list[dict[str, Any]] | None
    options: dict[str, Any] = field(default_factory=dict)


def read_items(path: Path, summary: Summary, stream: Any = None) -> list[Item]:
    """The items of a JSONL input; each bad line is reported (`summary.fail`) and left out."""
    if not path.is_file():
        raise UserError(f"input file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"input file {path} is not UTF-8 text") from e
    items: list[Item] = []
    seen: set[str] = set()
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            item = _parse(number, text)
        except ValueError as e:
            summary.fail(f"line {number}: {e}", stream)
            continue
        key = json.dumps(item.id)
        if key in seen:
            summary.fail(f"line {number}: id {key} repeats an earlier line's", stream)
            continue
        seen.add(key)
        items.append(item)
    return items


def _parse(number: int, text: str) -> Item:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg})") from e
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    return item_from_record(number, record)


def item_from_record(number: int, record: dict[str, Any], strict: bool = True) -> Item:
    """An item from its fields; ValueError says what is wrong. `strict` (a file's line): the id is
    required and unknown fields are refused; otherwise (a row among other columns, as Ray Data
    gives them) the id is optional and other fields are ignored."""
    has_id = "id" in record and isinstance(record["id"], (str, int)) and not isinstance(record["id"], bool)
    if strict and not has_id:
        raise ValueError('no "id" (a string or an integer)')
    name = f"id {json.dumps(record['id'])}" if has_id else f"row {number}"
    unknown = sorted(set(record) - FIELDS)
    if strict and unknown:
        raise ValueError(f"{name}: unknown fields {', '.join(unknown)} (known: {', '.join(sorted(FIELDS))})")
    prompt, messages = record.get("prompt"), record.get("messages")
    if (prompt is None) == (messages is None):
        raise ValueError(f'{name}: give exactly one of "prompt" (text) and "messages" (a conversation)')
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f'{name}: "prompt" must be text')
    if messages is not None and not (
        isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m for m in messages)
    ):
        raise ValueError(f'{name}: "messages" must be a list of {{"role", "content"}} objects')
    options = {}
    for key, kind in OPTIONS.items():
        if record.get(key) is not None:
            value = record[key]
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if kind is int and isinstance(value, float) and value.is_integer():  # a column with gaps is float
                value = int(value)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f'{name}: "{key}" must be {"a list of strings" if kind is list else kind.__name__}')
            options[key] = value
    return Item(number, record["id"] if has_id else None, prompt, messages, options)


def encode_item(tokenizer: Any, item: Item) -> list[int]:
    """The prompt's token ids: the text, or the conversation through the chat template."""
    text = item.prompt if item.messages is None else tokenizer.apply_chat_template(item.messages)
    return tokenizer.encode(text)


def completed_ids(path: Path) -> set[str]:
    """The ids (as JSON text) an earlier run wrote to `path`; a last line cut short is removed."""
    if not path.exists():
        return set()
    if not path.is_file():
        raise UserError(f"--output {path} exists and is not a file")
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):  # an append cut short: drop it, its item runs again
        cut = data.rfind(b"\n") + 1
        with path.open("r+b") as f:
            f.truncate(cut)
        data = data[:cut]
    ids = set()
    for number, text in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        try:
            ids.add(json.dumps(json.loads(text)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(
                f"--output {path} line {number} is not an answer genfast wrote ({e}); "
                "choose another output file (it is never overwritten)"
            ) from e
    return ids


class AnswerWriter:
    """Appends one JSON line per answer in a single write, flushed to the disk before the next."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        written = os.write(self.fd, line)
        if written != len(line):  # a full disk: what was written is an unfinished line
            raise OSError(f"could not write an answer ({written} of {len(line)} bytes): is the disk full?")
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


class AnswerFile:
    """A batch's output as it runs: each answer appended (AnswerWriter), each failure named and
    counted in `summary`, the progress shown."""

    def __init__(self, path: Path, summary: Summary, total: int, stream: Any) -> None:
        from genfast.interface.progress import Progress

        self.summary, self.stream = summary, stream
        self.writer = AnswerWriter(path)
        self.progress = Progress(total, "answers", stream)

    def add(
        self, item: Item, error: str | None, text: str, finish: str, prompt_tokens: int, completion_tokens: int
    ) -> None:
        """The outcome of one item: its error, or its answer."""
        if error is not None:
            self.summary.fail(f"line {item.line}: id {json.dumps(item.id)}: {error}", self.stream)
        else:
            self.writer.write(answer_record(item, text, finish, prompt_tokens, completion_tokens))
            self.summary.done += 1
        self.progress.advance()

    def __enter__(self) -> AnswerFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.writer.close()
        self.progress.finish()


def run_batch_file(
    engine: Engine,
    input_path: Path,
    output_path: Path,
    defaults: dict[str, Any],
    stream: Any = None,
) -> Summary:
    """Answer every item of `input_path` not yet in `output_path` on the started `engine`;
    `defaults`: the options an item does not set
    (max_new_tokens, temperature, top_k, top_p, seed, stop)."""

    stream = stream if stream is not None else sys.stderr
    summary = Summary()
    items = read_items(input_path, summary, stream)
    finished_before = completed_ids(output_path)
    todo = [item for item in items if json.dumps(item.id) not in finished_before]
    summary.skipped = len(items) - len(todo)
    requests, runnable = [], []
    for item in todo:
        try:
            requests.append(request_for(engine, item, encode_item(engine.tokenizer, item), defaults))
            runnable.append(item)
        except UserError as e:
            summary.fail(f"line {item.line}: id {json.dumps(item.id)}: {e}", stream)
    with AnswerFile(output_path, summary, len(runnable), stream) as answers:
        for index, finished in as_they_finish(engine, requests):
            f = finished
            answers.add(runnable[index], f.error, f.text, f.finish_reason, f.prompt_tokens, f.completion_tokens)
    return summary


def as_they_finish(engine: Engine, requests: Sequence[GenerationRequest]) -> Iterator[tuple[int, Finished]]:
    """Run `requests` on the (started) engine, any number of them: (index, result) pairs in the
    order they finish. At most as many are in flight as the engine's queue holds (it refuses
    more, and counts a request as waiting until its slot is freed, which may be just after its
    result is sent); the rest go in as earlier ones finish. Requests still running when the
    caller stops iterating (an exception, Ctrl-C) are cancelled."""
    from genfast.serve.engine import Finished

    done: queue.Queue[tuple[int, Finished]] = queue.Queue()
    window = threading.Semaphore(max(engine.max_queue, 1))
    tickets: dict[int, Ticket] = {}

    def sink_for(index: int) -> Callable[[object], None]:
        def sink(event: object) -> None:
            if isinstance(event, Finished):
                window.release()
                done.put((index, event))

        return sink

    submitted = 0
    try:
        for _ in range(len(requests)):
            while submitted < len(requests) and window.acquire(blocking=False):
                tickets[submitted] = engine.submit(requests[submitted], sink_for(submitted))
                submitted += 1
            index, finished = done.get()
            del tickets[index]
            yield index, finished
    finally:
        for ticket in tickets.values():
            ticket.cancel()


def request_for(engine: Engine, item: Item, ids: list[int], defaults: dict[str, Any]) -> GenerationRequest:
    """The engine request of an item (its options over `defaults`); UserError where the engine
    cannot run it (e.g. too long for the context)."""
    from genfast.serve.engine import GenerationRequest

    options = {**defaults, **item.options}
    params = SamplingParams(options["temperature"], options["top_k"], options["top_p"])
    request = GenerationRequest(tuple(ids), options["max_new_tokens"], params, tuple(options["stop"]), options["seed"])
    engine.validate(request)
    return request


def answer_record(
    item: Item, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """An output line: what the file holds for one answered item."""
    return {
        "id": item.id,
        "text": text,
        "finish_reason": finish_reason,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
    }


def item_row(item: Item) -> dict[str, Any]:
    """An item as a row for `genfast.LLM` on Ray: its line (to find the item again), the prompt or
    conversation and its options. The id stays with the caller: ids of mixed kinds (text and
    numbers) would not share one column."""
    return {"line": item.line, "prompt": item.prompt, "messages": item.messages, **item.options}


def check_file_flags(args: argparse.Namespace) -> tuple[Path, Path, dict[str, Any]]:
    """`genfast generate --input --output`'s flags checked before the slow load: the input, the
    output and the sampling defaults of items that set none."""
    from genfast.llm.commands import draft_of, sampling_of

    if args.input is None or args.output is None:
        raise UserError("--input and --output go together: prompts are read from one, answers written to the other")
    if args.prompt or args.prompt_file or args.chat:
        raise UserError("--input takes its prompts (and chat conversations) from the file: drop the prompt arguments")
    if draft_of(args) is not None or (args.tp or 1) > 1:
        raise UserError("--input runs on the batching engine, without speculative decoding or --tp (yet)")
    source, target = Path(args.input), Path(args.output)
    if not source.is_file():
        raise UserError(f"input file not found: {source}")
    if target.exists() and target.resolve() == source.resolve():
        raise UserError("--output must be another file than --input")
    params = sampling_of(args)
    defaults = dict(
        max_new_tokens=args.max_new_tokens, temperature=params.temperature, top_k=params.top_k,
        top_p=params.top_p, seed=args.seed, stop=list(args.stop),
    )  # fmt: skip
    return source, target, defaults


def generate_file_command(args: argparse.Namespace) -> int:
    """`genfast generate --input F --output F`: the file through this machine's batching engine.
    Exit status 1 when an item was left out."""
    from genfast.llm.commands import load_announced
    from genfast.serve.engine import Engine

    source, target, defaults = check_file_flags(args)
    loaded, settings = load_announced(args)
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        max_batch=args.max_batch,
        max_queue=2 * args.max_batch,
        max_seq_len=args.max_seq_len,
        compile=settings.compile,
    )
    engine.precompile(loaded, _log)
    engine.start()
    try:
        engine.warmup()
        summary = run_batch_file(engine, source, target, defaults)
    finally:
        engine.shutdown()
    _log(f"genfast: {summary.line()}; answers in {target}")
    return 1 if summary.failed else 0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
