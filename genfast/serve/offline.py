"""`genfast.LLM`: generation from Python, many prompts at a time.

The shape is vLLM's offline API: build the object once (load, apply the recipe, compile), then
`generate(prompts)` or `chat(conversations)` return one `Completion` per input, in input order.
Every prompt goes through the server's continuous-batching engine (genfast/serve/engine.py), so a
list of prompts shares decode steps as concurrent requests to `genfast serve` do: its throughput
is the engine's, not one prompt after another. At most `max_batch` prompts decode together and
as many wait; the rest are fed in as earlier ones finish, so the list can be of any length.

An `LLM` pickles as the arguments it was built with and is rebuilt from them where it is
unpickled, and it is a Ray Data callable class as it is: `__call__(batch)` takes a column of
prompts (or chat conversations) and returns the batch with the completions' columns added.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from genfast.errors import UserError
from genfast.llm.decoding.sampling import SamplingParams
from genfast.serve.batch_file import FIELDS, as_they_finish, encode_item, item_from_record, request_for

if TYPE_CHECKING:
    from genfast.serve.engine import Finished

log = logging.getLogger("genfast")

Prompt = str | Sequence[int]  # text, or token ids as they are
Message = Mapping[str, Any]  # {"role": ..., "content": ...}
DEFAULT_MAX_NEW_TOKENS = 128  # as `genfast generate`


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Completion:
    """One prompt's result: the generated text and token ids, why it stopped ("stop": end of
    sequence or a stop string; "length": max_new_tokens) and the token counts."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage


class LLM:
    """A loaded model that answers lists of prompts.

    `model`: what `genfast generate --model` takes (a GGUF file, a Hugging Face directory, a hub id
    or a name genfast knows; None: the default model). `recipe`, `quant`, `device`, `dtype`,
    `threads`, `compile`, `batch_invariant` and `max_seq_len` mean what the command-line flags do;
    `max_batch`, `prefill_chunk` and `prefix_cache_mib` what `genfast serve`'s do. Call `close()`
    (or use it as a context manager) to stop its scheduler thread before the process ends.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        recipe: str | None = None,
        quant: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        threads: int | None = None,
        compile: bool = True,
        batch_invariant: bool | None = None,
        max_batch: int = 8,
        max_seq_len: int | None = None,
        prefill_chunk: int = 256,
        prefix_cache_mib: float = 1024,
    ) -> None:
        from genfast.llm.recipe import DEFAULT_STEP, apply_recipe, plan
        from genfast.serve.engine import Engine

        self._arguments = dict(
            model=model, recipe=recipe, quant=quant, device=device, dtype=dtype, threads=threads, compile=compile,
            batch_invariant=batch_invariant, max_batch=max_batch, max_seq_len=max_seq_len,
            prefill_chunk=prefill_chunk, prefix_cache_mib=prefix_cache_mib,
        )  # fmt: skip
        settings = plan(recipe or DEFAULT_STEP, device, dtype, quant, compile, batch_invariant).settings
        self.loaded = apply_recipe(model, settings, device, threads)
        self.tokenizer = self.loaded.tokenizer
        self.engine = Engine(
            self.loaded.model,
            self.tokenizer,
            max_batch=max_batch,
            max_queue=2 * max_batch,
            max_seq_len=max_seq_len,
            compile=settings.compile,
            prefill_chunk=prefill_chunk,
            prefix_cache_mib=prefix_cache_mib,
        )
        self.engine.precompile(self.loaded, log.info)
        self.engine.start()
        self.engine.warmup()

    @property
    def max_seq_len(self) -> int:
        """Tokens one sequence may hold: its prompt and what it generates."""
        return self.engine.max_seq_len

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        stop: Sequence[str] = (),
        seed: int | None = None,
    ) -> list[Completion]:
        """Complete each prompt (text, or token ids); one Completion per prompt, in order.

        Sampling: a `SamplingParams`, or `temperature` / `top_k` / `top_p` as keywords (not both);
        greedy by default. `seed`: each prompt samples from its own stream seeded with `seed`, so
        a call gives the same answers again. Every prompt is checked before any runs: one that
        does not fit the context with `max_new_tokens` raises UserError naming it."""
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in batch]
        return self._run(ids, _sampling(params, temperature, top_k, top_p), max_new_tokens, tuple(stop), seed)

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | None = None,
        **options: Any,
    ) -> list[Completion]:
        """The assistant's reply to each conversation (a list of {"role", "content"} messages, or a
        list of them), through the model's chat template; options as `generate`'s."""
        single = bool(conversations) and isinstance(conversations[0], Mapping)
        batch = [conversations] if single else list(conversations)
        prompts = [self.tokenizer.apply_chat_template([dict(m) for m in messages]) for messages in batch]
        return self.generate(prompts, params, **options)

    def __call__(
        self,
        batch: dict[str, Any],
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
    ) -> dict[str, Any]:
        """Ray Data's `map_batches` protocol: rows with a `prompt` (text) or `messages` (a
        conversation) and optionally their own `max_new_tokens`, `temperature`, `top_k`, `top_p`,
        `seed` and `stop` (else the keywords', which `map_batches(fn_kwargs=...)` sets); other
        columns pass through. Out: the batch with `text`,
        `finish_reason`, `prompt_tokens`, `completion_tokens` and `error` added. A row that cannot
        run (no prompt, too long for the context) gets its reason in `error` and no text: one
        bad row does not fail the batch."""
        import numpy as np

        rows = _rows(batch)
        defaults = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        stop=list(stop))  # fmt: skip
        results: list[Completion | None] = [None] * len(rows)
        errors: list[str | None] = [None] * len(rows)
        runnable, requests = [], []
        for index, row in enumerate(rows):
            try:
                item = item_from_record(index + 1, row, strict=False)
                requests.append(request_for(self.engine, item, encode_item(self.tokenizer, item), defaults))
                runnable.append(index)
            except (ValueError, UserError) as e:
                errors[index] = str(e)
        for position, finished in as_they_finish(self.engine, requests):
            index = runnable[position]
            if finished.error is not None:
                errors[index] = finished.error
            else:
                results[index] = _completion(finished)
        return {
            **{key: _missing_as_none(column) for key, column in batch.items()},
            "text": np.array([r.text if r else None for r in results], dtype=object),
            "finish_reason": np.array([r.finish_reason if r else "error" for r in results], dtype=object),
            "prompt_tokens": np.array([r.usage.prompt_tokens if r else 0 for r in results]),
            "completion_tokens": np.array([r.usage.completion_tokens if r else 0 for r in results]),
            "error": np.array(errors, dtype=object),
        }

    def close(self) -> None:
        """Stop the engine's scheduler thread (requests still running are cancelled)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return dict(self._arguments)

    def __setstate__(self, arguments: dict[str, Any]) -> None:
        self.__init__(**arguments)  # type: ignore[misc]

    def _run(
        self, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int, stop: tuple[str, ...],
        seed: int | None,
    ) -> list[Completion]:  # fmt: skip
        from genfast.serve.engine import GenerationRequest

        requests = [GenerationRequest(tuple(p), max_new_tokens, params, stop, seed) for p in prompts]
        for index, request in enumerate(requests):
            try:
                self.engine.validate(request)
            except UserError as e:
                raise UserError(f"prompt {index}: {e}") from e
        results: list[Finished | None] = [None] * len(requests)
        for index, finished in as_they_finish(self.engine, requests):
            if finished.error is not None:
                raise RuntimeError(f"prompt {index} failed in the engine: {finished.error}")
            results[index] = finished
        return [_completion(f) for f in results if f is not None]


def _rows(batch: dict[str, Any]) -> list[dict[str, Any]]:
    """A column batch (numpy arrays or lists, as Ray Data gives them) as one dict per row of the
    fields an item reads, in plain Python values; missing values (None, NaN) left out."""
    columns = {key: list(batch[key]) for key in FIELDS if key in batch}
    count = len(next(iter(batch.values()))) if batch else 0
    return [{key: value for key, column in columns.items() if (value := _plain(column[i])) is not None} for i in
            range(count)]  # fmt: skip


def _missing_as_none(column: Any) -> Any:
    """An object column with NaN (Arrow's missing value, through pandas) as None: Ray Data's JSON
    writer crashed (pandas' to_json, a segmentation fault) on NaN beside lists in one column."""
    import numpy as np

    if isinstance(column, np.ndarray) and column.dtype == object:
        values = [None if isinstance(v, float) and v != v else v for v in column]
        return np.array([*values, None], dtype=object)[:-1]  # the extra None keeps equal-length lists 1-D
    return column


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (Arrow's lists and structs become them) as Python values; NaN as None."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _sampling(
    params: SamplingParams | None, temperature: float | None, top_k: int | None, top_p: float | None
) -> SamplingParams:
    keywords = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    given = {k: v for k, v in keywords.items() if v is not None}
    if params is not None and given:
        raise UserError(f"pass either a SamplingParams or {', '.join(given)} as keywords, not both")
    return params if params is not None else SamplingParams(**given)


def _completion(finished: Any) -> Completion:
    return Completion(
        finished.text,
        list(finished.token_ids),
        finished.finish_reason,
        Usage(finished.prompt_tokens, finished.completion_tokens),
    )
