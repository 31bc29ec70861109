"""Text generation: static KV cache, separately compiled prefill and decode, streaming, stats."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from genfast.compilation.inductor import compile_fn
from genfast.errors import UserError
from genfast.llm.checkpoints.tokenizer import Tokenizer
from genfast.llm.decoding.sampling import SamplingParams, sample
from genfast.llm.decoding.streaming import TextStream
from genfast.llm.model.transformer import Transformer, attention_mask
from genfast.platform.hardware import HostCopy, synchronize, to_device

# on_text(sequence_index, text) receives each sequence's final text as it is produced.
TextCallback = Callable[[int, str], None]


@dataclass
class GenerationResult:
    texts: list[str]
    token_ids: list[list[int]]
    prompt_tokens: int  # total over the batch
    new_tokens: int  # total over the batch
    prefill_s: float
    decode_s: float  # all decode steps after the first token
    decode_steps: int
    mean_kv_len: float = 0.0  # average valid cache length read per decode step
    batch_size: int = 1
    stop_reasons: list[str] = field(default_factory=list)
    cached_prompt_tokens: int = 0  # of prompt_tokens, those already in the cache (Generator.reuse_prefix)
    # Speculative decoding (genfast.llm.decoding.speculative); decode_steps then counts tokens, not passes.
    speculate_k: int = 0  # draft tokens per verify pass; 0: not speculative
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    target_passes: int = 0  # target forward passes during decode (verifies and plain steps)
    draft_s: float = 0.0  # the part of decode_s spent drafting

    @property
    def ttft_s(self) -> float:
        return self.prefill_s

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens run per second (those found in the cache were not run)."""
        return (self.prompt_tokens - self.cached_prompt_tokens) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second per sequence during decode (batch rows are counted once per step)."""
        return self.decode_steps / self.decode_s if self.decode_s else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Share of drafted tokens the target accepted."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Mean tokens produced per target pass: the accepted drafts plus the one token (correction
        or bonus) each pass samples itself."""
        return (self.accepted_tokens + self.target_passes) / self.target_passes if self.target_passes else 0.0


class Completions:
    """Per-sequence generated ids, streamed text and stop reasons of one generate() call."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        batch: int,
        stop_strings: Sequence[str],
        stop_at_eos: bool,
        on_text: TextCallback | None,
    ) -> None:
        self.streams = [TextStream(tokenizer, tuple(stop_strings)) for _ in range(batch)]
        self.generated: list[list[int]] = [[] for _ in range(batch)]
        self.reasons = ["length"] * batch
        self.done = [False] * batch
        self.stop_ids = tokenizer.stop_ids if stop_at_eos else set()
        self.on_text = on_text
        self.first_row: list[int] = []  # row 0's token of every step, in order (what it fed back)

    def push(self, i: int, tok: int) -> None:
        """Append one token to sequence i (ignored once it is done)."""
        if self.done[i]:
            return
        if tok in self.stop_ids:
            self.done[i], self.reasons[i] = True, "eos"
            return
        self.generated[i].append(tok)
        text = self.streams[i].push(tok)
        if text and self.on_text:
            self.on_text(i, text)
        if self.streams[i].stopped:
            self.done[i], self.reasons[i] = True, "stop"

    def push_step(self, next_tokens: list[int]) -> None:
        """One token per sequence (rows past the batch are filler)."""
        tokens = next_tokens[: len(self.done)]
        self.first_row.append(tokens[0])
        for i, tok in enumerate(tokens):
            self.push(i, tok)

    def finish(self, **stats: Any) -> GenerationResult:
        """Flush the held-back text; the result with `stats` (GenerationResult's timing fields)."""
        for i, stream in enumerate(self.streams):
            tail = stream.finish()
            if tail and self.on_text:
                self.on_text(i, tail)
        return GenerationResult(
            texts=[s.text for s in self.streams],
            token_ids=self.generated,
            new_tokens=sum(len(g) for g in self.generated),
            batch_size=len(self.done),
            stop_reasons=self.reasons,
            **stats,
        )


def positions(gen: Generator, start: int, n: int) -> tuple[Tensor, Tensor]:
    """Slots [start, start+n) and their causal mask over the valid cache (on CUDA the whole
    cache, so shapes stay static for CUDA graphs)."""
    input_pos = torch.arange(start, start + n, device=gen.device)
    return input_pos, attention_mask(input_pos, gen.max_seq_len if gen.static_kv else start + n)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def reusable_prefix(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """How many leading tokens of `prompt` a cache row holding `cached` (its tokens, in order)
    shares with it, short of the prompt's last token, which always runs (its logits give the next
    token). Whether the row still holds their keys is the cache's to say (CacheRows.reusable)."""
    return common_prefix(cached, prompt[:-1])


def cache_length(model: Transformer, max_seq_len: int | None) -> int:
    """KV-cache slots per sequence: `max_seq_len` (default: all) capped at the model's context."""
    limit = model.args.max_seq_len
    length = min(max_seq_len or limit, limit)
    if length < 2:
        raise UserError(f"--max-seq-len must be at least 2, got {max_seq_len}")
    return length


class Generator:
    """Owns a model with static caches and its compiled prefill/decode steps.

    Prefill runs a whole (left-padded) prompt batch; its sequence length is a dynamic dimension,
    so one compiled graph serves all prompt lengths. Decode runs one token per sequence and reads
    only the valid cache prefix, whose length is again a dynamic dimension (on CUDA the whole
    cache is read instead, so shapes are static and CUDA graphs can replay).
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        max_seq_len: int | None = None,
        max_batch_size: int = 1,
        compile: bool = True,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.device = model.norm.weight.device
        self.max_seq_len = cache_length(model, max_seq_len)
        self.max_batch_size = max_batch_size
        model.setup_caches(max_batch_size, self.max_seq_len)
        self.static_kv = self.device.type == "cuda"
        self.compiled = compile
        self.skip_guards = True  # in steady decode steps (see _step)
        self.guard_fallbacks = 0  # steady decode steps that had to be retried with all guards
        # Steps compiled ahead of time and kept on disk (genfast/llm/decoding/precompiled.py, `attach`);
        # while they are not ready, steps run eagerly.
        self.precompiled: Any = None
        # A one-sequence generation reuses the cache of the previous one for their common prefix
        # (a chat's earlier turns) instead of prefilling it again. Only for a generator that is
        # the sole user of its model's cache.
        self.reuse_prefix = False
        self.cached_tokens: list[int] = []  # whose keys and values fill the cache's first slots
        if compile:
            self._prefill = compile_fn(self._prefill_step, self.device, decode=False)
            self._decode = compile_fn(self._decode_step, self.device, decode=True, model=model)

    # Two functions, not one: dynamo keeps compiled graphs per code object, and decode's cache
    # must hold only decode graphs for its guard-skipping steady state (see _step).
    def _prefill_step(self, tokens: Tensor, input_pos: Tensor, mask: Tensor, params: SamplingParams) -> Tensor:
        return sample(self.model(tokens, input_pos, mask), params)

    def _decode_step(self, tokens: Tensor, input_pos: Tensor, mask: Tensor, params: SamplingParams) -> Tensor:
        return sample(self.model(tokens, input_pos, mask), params)

    def encode_prompt(self, prompt: str) -> list[int]:
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise UserError("the prompt is empty")
        return ids

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        params: SamplingParams = SamplingParams(),
        stop_strings: Sequence[str] = (),
        seed: int | None = None,
        on_text: TextCallback | None = None,
        stop_at_eos: bool = True,
    ) -> GenerationResult:
        """Generate up to `max_new_tokens` for each prompt (token ids); stream text via `on_text`."""
        lengths = self.check_request(prompts, max_new_tokens)
        prompt_len = max(lengths)
        if seed is not None:
            torch.manual_seed(seed)
        out = Completions(self.tokenizer, len(prompts), stop_strings, stop_at_eos, on_text)
        start = self._reusable_prefix(prompts)
        self.cached_tokens = []  # until this call has filled the cache
        next_tokens, pad_start, prefill_s = self._prefill_prompts(prompts, params, start)
        out.push_step(HostCopy(next_tokens).values())
        if self.precompiled is not None:  # saved compiled steps load once the first token is out
            self.precompiled.poll()

        # Decode: one token per step; the mask row grows by one slot each step.
        last = prompt_len + max_new_tokens - 1
        row_len = self.max_seq_len if self.static_kv else last
        decode_row = attention_mask(to_device(torch.tensor([last]), self.device), row_len, pad_start)
        slots = torch.arange(row_len, device=self.device)
        # CUDA: positions advance on the device and each step's tokens are read one step later,
        # after the next step is queued, so the host never waits on the step it just queued and
        # the GPU never waits on the host (no synchronization: tests/cuda count them). A sequence
        # that ends is noticed a step late; the extra step's tokens are ignored.
        device_pos = to_device(torch.tensor([prompt_len]), self.device) if self.static_kv else None
        pending: list[HostCopy] = []
        steps, kv_total = 0, 0
        t0 = time.perf_counter()
        for pos in range(prompt_len, last):
            if all(out.done):
                break
            kv_len = pos + 1
            if device_pos is not None:  # static shapes over the whole cache (CUDA graphs)
                step_pos, step_mask = device_pos, decode_row & (slots <= device_pos)
                device_pos = device_pos + 1
            else:  # only the valid prefix (clone, not contiguous(): that keeps a size-1 dim's old
                # stride, which compiled code guards)
                step_pos = torch.tensor([pos], device=self.device)
                step_mask = decode_row[..., :kv_len].clone(memory_format=torch.contiguous_format)
            next_tokens = self._step(next_tokens.view(-1, 1), step_pos, step_mask, params, steady=steps > 0)
            steps += 1
            kv_total += kv_len
            pending.append(HostCopy(next_tokens))
            if len(pending) > (1 if device_pos is not None else 0):
                out.push_step(pending.pop(0).values())
        for copy in pending:
            out.push_step(copy.values())
        decode_s = time.perf_counter() - t0 if steps else 0.0

        if len(prompts) == 1:  # the prompt, then each token fed back by a decode step
            self.cached_tokens = [*prompts[0], *out.first_row[:steps]]
        return out.finish(
            prompt_tokens=sum(lengths),
            prefill_s=prefill_s,
            decode_s=decode_s,
            decode_steps=steps,
            mean_kv_len=kv_total / steps if steps else 0.0,
            cached_prompt_tokens=start,
        )

    def _reusable_prefix(self, prompts: Sequence[Sequence[int]]) -> int:
        """How many leading prompt tokens already are in the cache (see `reuse_prefix`); at least
        the last prompt token is always run, for its logits."""
        if not self.reuse_prefix or len(prompts) != 1 or self.max_batch_size != 1:
            return 0
        return self.model.cache_rows().reusable(0, reusable_prefix(self.cached_tokens, prompts[0]))

    def check_request(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[int]:
        """Validate a generate() request (UserError names what is wrong and the fix); return the
        prompt lengths. generate() calls it; a command calls it first to fail before slow work."""
        batch = len(prompts)
        if not 1 <= batch <= self.max_batch_size:
            raise UserError(f"got {batch} prompts; this generator was set up for 1 to {self.max_batch_size}")
        if max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        lengths = [len(p) for p in prompts]
        if min(lengths) == 0:
            raise UserError("a prompt is empty")
        prompt_len = max(lengths)
        needed = prompt_len + max_new_tokens
        if needed > self.max_seq_len:
            fix = "shorten the prompt or lower --max-new-tokens"
            if needed <= self.model.args.max_seq_len:
                fix = f"pass --max-seq-len {needed} (or more), or {fix}"
            raise UserError(
                f"the prompt has {prompt_len} tokens and {max_new_tokens} new tokens were asked for, but the "
                f"context holds {self.max_seq_len} (model limit {self.model.args.max_seq_len}); {fix}"
            )
        return lengths

    def _prefill_prompts(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, start: int = 0
    ) -> tuple[Tensor, Tensor, float]:
        """Prefill the whole (left-padded) prompt batch at once, from slot `start` (the slots
        before it are cached already: one sequence only); return the first new tokens
        [max_batch_size], each row's first real slot [max_batch_size] and the seconds taken."""
        batch, lengths = len(prompts), [len(p) for p in prompts]
        prompt_len = max(lengths)
        pad_start = to_device(torch.tensor([prompt_len - n for n in lengths]), self.device)
        padded = [([0] * (prompt_len - n) + list(p))[start:] for p, n in zip(prompts, lengths)]
        tokens = to_device(torch.tensor(padded), self.device)
        if batch < self.max_batch_size:  # keep the compiled batch dimension static
            filler = tokens[:1].expand(self.max_batch_size - batch, -1)
            tokens = torch.cat([tokens, filler])
            pad_start = torch.cat([pad_start, pad_start[:1].expand(self.max_batch_size - batch)])

        input_pos = torch.arange(start, prompt_len, device=self.device)
        mask = attention_mask(input_pos, prompt_len, pad_start)  # [max_batch_size, 1, S, prompt_len]
        t0 = time.perf_counter()
        if prompt_len - start == 1:
            next_tokens = self._step(tokens, input_pos, mask, params)
        else:
            next_tokens = self._step(tokens, input_pos, mask, params, prefill=True)
        synchronize(self.device)
        return next_tokens, pad_start, time.perf_counter() - t0

    def _step(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        mask: Tensor,
        params: SamplingParams,
        prefill: bool = False,
        steady: bool = False,
    ) -> Tensor:
        """Run one compiled (or eager) forward + sample.

        steady: a decode step after the first one of this generate() call. That first step ran
        with all of dynamo's guards (compiling if needed); later steps differ from it only in the
        cache length, a dynamic dimension, so they skip guard evaluation (the guards check
        every weight and cache tensor: a large part of a small model's step). If dynamo still finds it would have to
        recompile, it raises before running anything and the step is retried with all guards.
        """
        if self.precompiled is not None:
            out = None
            if params == self.precompiled.params:
                out = self.precompiled.step("prefill" if prefill else "decode", tokens, input_pos, mask)
            if out is None:
                return self._prefill_step(tokens, input_pos, mask, params)
            return self._own_outputs(out) if not prefill else out
        if not self.compiled:
            return self._prefill_step(tokens, input_pos, mask, params)
        # Lengths that vary between calls are marked dynamic so they never recompile; decode
        # with a static cache (CUDA graphs) keeps every shape static instead.
        if prefill:
            torch._dynamo.mark_dynamic(tokens, 1)
            torch._dynamo.mark_dynamic(input_pos, 0)
            torch._dynamo.mark_dynamic(mask, 2)
        if (prefill or not self.static_kv) and mask.shape[3] > 1:  # size 1 is always specialized
            torch._dynamo.mark_dynamic(mask, 3)
        if prefill:
            return self._prefill(tokens, input_pos, mask, params)
        return self._own_outputs(self._run_compiled(self._decode, steady, tokens, input_pos, mask, params))

    def _own_outputs(self, out: Any) -> Any:
        """A compiled decode step's outputs, copied where they live in a CUDA graph's memory,
        which its next replay overwrites (a stream-ordered copy: no wait)."""
        return tree_map(Tensor.clone, out) if self.static_kv else out

    def _run_compiled(self, fn: Callable[..., Any], steady: bool, *args: Any) -> Any:
        """Call a compiled step, skipping guard evaluation when `steady` (see _step)."""
        if steady and self.skip_guards:
            try:
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    return fn(*args)
            except RuntimeError as e:
                if "skip_guard_eval_unsafe" not in str(e):
                    raise
                self.guard_fallbacks += 1
        return fn(*args)

    def warmup(self, params: SamplingParams = SamplingParams()) -> float:
        """Compile (or load from the compile cache) prefill and decode; return the seconds spent.

        Lengths are dynamic, so a 2-token prompt compiles the graphs every later call uses. With
        precompiled steps (genfast/llm/decoding/precompiled.py): load them, or compile and save them now.
        """
        t0 = time.perf_counter()
        if self.precompiled is not None and params == self.precompiled.params:
            self.precompiled.wait()
        prompts = [[self.tokenizer.bos_id or 0] * 2] + [[0]] * (self.max_batch_size - 1)
        self.generate(prompts[: self.max_batch_size], max_new_tokens=3, params=params, stop_at_eos=False)
        return time.perf_counter() - t0
