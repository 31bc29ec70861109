"""Continuous batching: many requests share each decode step over a fixed set of KV-cache rows.

The engine owns the model's static KV cache of `max_batch` rows ("slots") and one scheduler
thread. Between two decode steps the thread admits queued requests into free slots, prefills up to
`prefill_chunk` prompt tokens into their cache rows (batch-1 calls, oldest request first; a long
prompt takes several rounds, so it never stalls the others' decoding for more than one chunk) and
drops finished or cancelled ones; each decode
step then runs every slot at its own position (`Transformer.forward` with per-row `input_pos`),
free slots included, so the compiled decode graph always sees the same shapes and never
recompiles as requests come and go. Only the attention's cache length varies (the longest
active sequence), and it is a dynamic dimension, as in `Generator` (on CUDA the whole cache is
read, so shapes are fully static).

Nobody waits for anyone else to finish: a request joins at the next step boundary and leaves as
soon as it stops. Rows never attend to each other, and free slots run a dummy token at the last
cache position, which no request's tokens reach. A batch-invariant model (genfast/llm/model/
invariance.py; the default where it runs) computes a request's logits to the same bits whatever
shares its steps, however its prompt was chunked or reused, and as `Generator.generate` does: the
same greedy tokens every time (tests/serve/test_batch_invariance.py). On the library kernels they
can differ in the last bits, which may flip a near-tie in bf16.

Prefix reuse, at two levels. A slot's cache row keeps the keys and values of its last request
after it leaves: a new request takes the free slot whose row shares the longest prefix with its
prompt (ties: the least recently used), so a chat client resending its conversation continues in
place. Beyond the rows, a prefix cache (genfast/serve/prefix_cache.py) keeps blocks of every
request's keys and values under its own memory budget, stored as each prefill chunk ends and when
a request leaves; a request whose prompt begins with stored blocks, longer than what its row
holds, copies them into its row. Either way only the rest of the prompt is prefilled. A
sliding-window ring is reused only where it still holds the window before the reused prefix.

Results are pushed to a per-request `Sink` (a callable) from the scheduler thread: `Delta`s of
final text as it is produced, then exactly one `Finished`. The HTTP layer (genfast/serve/app.py)
bridges them into its event loop; `Engine.generate` is a blocking convenience for scripts.

Under tensor parallelism (the model is a shard and a process group is joined) the engine of
rank 0 schedules and broadcasts each model call; the other ranks' engines `follow` (see
genfast/serve/tensor_parallel.py).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from genfast.compilation.inductor import CUDA_GRAPHS_IN_THREADS, compile_fn
from genfast.errors import UserError
from genfast.llm.checkpoints.tokenizer import Tokenizer
from genfast.llm.decoding.generate import cache_length, reusable_prefix
from genfast.llm.decoding.precompiled import PrecompiledSteps, StepSet, key_parts
from genfast.llm.decoding.sampling import SamplingParams, draw, probabilities
from genfast.llm.decoding.streaming import TextStream
from genfast.llm.model.transformer import Transformer, attention_mask
from genfast.llm.tensor_parallel import current_world_size
from genfast.platform.threads import OtherWork, follow_other_work
from genfast.serve.constraints import Constraints, Matcher
from genfast.serve.prefix_cache import BLOCK_SIZE, PrefixCache
from genfast.serve.tensor_parallel import KEEPALIVE_S, Op, StepBroadcast

if TYPE_CHECKING:
    from genfast.llm.loading import LoadedModel

log = logging.getLogger("genfast.serve")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    seed: int | None = None  # a private random stream: the same seed gives the same sample
    # Report each generated token's log-probability and this many most likely alternatives
    # (None: no log-probabilities).
    logprobs: int | None = None
    # An llguidance grammar the reply must follow (genfast.serve.constraints; None: free text).
    grammar: str | None = None


# What JSON can carry for a token the sampled distribution excludes (log 0), as vLLM reports it.
LOGPROB_FLOOR = -9999.0
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on alternatives per token
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1  # what torch's generators take


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the distribution it was drawn from (the model's
    for greedy decoding; after temperature, top-k and top-p when sampling), with the most likely
    tokens of that distribution, most likely first."""

    token_id: int
    token: str  # its text where it stands (with the space a tokenizer folds into it)
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


def _token_logprob(dist: Tensor, token: int, n_top: int, text: Callable[[int], str]) -> TokenLogprob:
    """The entry of `token` under the log-distribution `dist` [V], with its `n_top` most likely
    tokens; `text`: a token's text where it stands."""
    top = torch.topk(dist, n_top) if n_top else None
    alternatives = [] if top is None else list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return TokenLogprob(
        token,
        text(token),
        max(float(dist[token]), LOGPROB_FLOOR),
        tuple((text(t), max(lp, LOGPROB_FLOOR)) for t, lp in alternatives),
    )


@dataclass(frozen=True)
class Delta:
    """Text that became final (never the start of a possible stop string), and the log-probabilities
    of the tokens taken since the previous Delta (when the request asked for them)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    text: str
    token_ids: list[int]
    # "stop" (EOS or a stop string), "length" (max_tokens), "cancelled", or "error"
    finish_reason: str
    prompt_tokens: int
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token of token_ids, when asked for
    cached_tokens: int = 0  # of prompt_tokens, those found in the slot's row or the prefix cache (not prefilled)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


Event = Delta | Finished
Sink = Callable[[Event], None]


class QueueFull(Exception):
    """Every slot is busy and the waiting queue holds `max_queue` requests."""


# The engine's steps as functions of the model (genfast/llm/decoding/precompiled.py saves them compiled).
def serve_prefill(model: Transformer, tokens: Tensor, input_pos: Tensor, mask: Tensor, rows: Tensor) -> Tensor:
    return model(tokens, input_pos, mask, cache_rows=rows)


def serve_decode(model: Transformer, tokens: Tensor, input_pos: Tensor, mask: Tensor) -> Tensor:
    return model(tokens, input_pos, mask)


def serve_examples(name: str, batch: int, device: torch.device) -> tuple[Tensor, ...]:
    """Inputs of the shapes the engine passes, the varying lengths marked dynamic."""
    if name == "prefill":  # one prompt into one slot
        tokens = torch.zeros(1, 2, dtype=torch.long, device=device)
        input_pos = torch.arange(2, device=device)
        mask = attention_mask(input_pos, 2)
        torch._dynamo.mark_dynamic(tokens, 1)
        torch._dynamo.mark_dynamic(input_pos, 0)
        torch._dynamo.mark_dynamic(mask, 2)
        torch._dynamo.mark_dynamic(mask, 3)
        return tokens, input_pos, mask, torch.tensor([0], device=device)
    tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
    input_pos = torch.ones(batch, 1, dtype=torch.long, device=device)
    mask = attention_mask(input_pos, 2)
    torch._dynamo.mark_dynamic(mask, 3)
    return tokens, input_pos, mask


SERVE = StepSet("serve", {"prefill": serve_prefill, "decode": serve_decode}, serve_examples)


class EngineStopped(Exception):
    """The engine is shutting down and takes no new requests."""


class EngineObserver(Protocol):
    """What the engine reports as requests run, on its own thread (genfast/serve/metrics.py)."""

    def on_first_token(self, seconds: float) -> None: ...  # since submission

    def on_token(self, seconds: float) -> None: ...  # since the request's previous token

    def on_finished(self, finish_reason: str, prompt_tokens: int, seconds: float) -> None: ...  # since submission


class Ticket:
    """A submitted request: cancel it at any time (queued or running); its sink gets `Finished`."""

    def __init__(
        self, engine: Engine, request: GenerationRequest, sink: Sink, ticket_id: int, matcher: Matcher | None = None
    ) -> None:
        self.engine, self.request, self.sink, self.id = engine, request, sink, ticket_id
        self.matcher = matcher  # the request's grammar state, built when it was validated
        self.cancelled = False
        self.submitted = time.perf_counter()

    def finish(self, finished: Finished) -> None:
        """Send the request's one `Finished`, and report it."""
        if self.engine.observer is not None:
            self.engine.observer.on_finished(
                finished.finish_reason, finished.prompt_tokens, time.perf_counter() - self.submitted
            )
        self.sink(finished)

    def cancel(self) -> None:
        self.engine._cancel(self)


@dataclass
class _Sequence:
    """A request running in a slot."""

    ticket: Ticket
    stream: TextStream
    generator: torch.Generator | None
    pos: int = 0  # cache position of the next token to feed
    last: int = 0  # the token to feed next
    generated: list[int] = field(default_factory=list)
    token_time: float = 0.0  # when the last token was taken (perf_counter)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    unsent: int = 0  # of `logprobs`, how many no Delta has carried yet
    cached: int = 0  # leading prompt tokens not prefilled: held by the slot's row or copied from the prefix cache
    prefilled: int = 0  # prompt tokens in the row so far (chunked prefill); then decoding starts

    @property
    def matcher(self) -> Matcher | None:
        """The request's grammar state (structured output)."""
        return self.ticket.matcher


@dataclass
class EngineStats:
    slots: int
    active: int
    queued: int
    decode_steps: int
    generated_tokens: int
    cancelled: int
    max_seq_len: int
    cached_tokens: int  # held in the KV cache by the running requests
    prompt_tokens: int  # of every request prefilled so far
    reused_prompt_tokens: int  # of those, found in a slot's row or the prefix cache
    prefix_cache_bytes: int = 0  # held by the prefix cache's blocks
    prefix_cache_budget: int = 0  # its budget (0: no prefix cache)
    prefix_cache_evicted: int = 0  # blocks evicted to make room, since the start


OMP_PAUSE_HARD = 2  # omp.h's omp_pause_resource_t
# How often a server measures the other work beside it (Engine.follow_other_work): long enough
# for /proc's 10 ms ticks and for a change to last, short against a session of requests.
FOLLOW_OTHER_WORK_S = 5.0


def release_openmp_workers() -> None:
    """Hand back the calling thread's OpenMP worker threads (OpenMP 5.0 `omp_pause_resource_all`).

    The engine computes on its own thread, whose parallel regions get an OpenMP team of their
    own. If the thread that loaded the model keeps its team too, libgomp sees more threads than
    cores and cuts its workers' spin-waits short, so they sleep and wake for each of a step's
    hundreds of parallel regions, which halves decode speed on a 2-core CPU. The caller's team
    is recreated if it computes again. A runtime without the call does nothing."""
    if torch.get_num_threads() <= 1:
        return
    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (OSError, AttributeError):
        return
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    pause(OMP_PAUSE_HARD)


class Engine:
    """A fixed set of `max_batch` KV-cache slots served by one scheduler thread (see module doc).

    max_queue: requests allowed to wait for a slot; beyond that `submit` raises QueueFull
    (back-pressure: memory stays bounded however many clients connect).
    prefix_cache_mib: the prefix cache's budget in MiB (0: none; there is none under tensor
    parallelism, whose ranks would all have to copy alike); prefix_block: its tokens per block.
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        max_batch: int = 8,
        max_queue: int = 64,
        max_seq_len: int | None = None,
        compile: bool = True,
        prefill_chunk: int = 256,  # long prompts prefill in chunks, so running rows keep decoding
        prefix_cache_mib: float = 1024,
        prefix_block: int = BLOCK_SIZE,
    ) -> None:
        if max_batch < 1 or max_queue < 0:
            raise UserError(f"--max-batch must be >= 1 and --max-queue >= 0, got {max_batch} and {max_queue}")
        if prefill_chunk < 1:
            raise UserError(f"--prefill-chunk must be >= 1, got {prefill_chunk}")
        if prefix_cache_mib < 0:
            raise UserError(f"--prefix-cache-mib must be >= 0, got {prefix_cache_mib}")
        self.prefill_chunk = prefill_chunk
        self.model, self.tokenizer = model, tokenizer
        self.constraints = Constraints(tokenizer, model.args.vocab_size)
        self.device = model.norm.weight.device
        self.max_seq_len = cache_length(model, max_seq_len)
        self.max_batch, self.max_queue = max_batch, max_queue
        model.setup_caches(max_batch, self.max_seq_len)
        # As in Generator: CUDA reads the whole cache (static shapes for CUDA graphs); elsewhere
        # only the prefix up to the longest active sequence.
        self.static_kv = self.device.type == "cuda"
        self.compiled = compile
        if compile:
            graphs = CUDA_GRAPHS_IN_THREADS  # the steps run on the scheduler's thread
            if self.device.type == "cuda" and not graphs:
                log.warning(
                    "torch %s cannot replay CUDA graphs on the server's scheduler thread (torch >= 2.13 can): "
                    "decode steps launch their kernels one by one, slower",
                    torch.__version__,
                )
            self._prefill = compile_fn(self._prefill_step, self.device, decode=False)
            self._decode = compile_fn(self._decode_step, self.device, decode=True, model=model, cuda_graphs=graphs)
        else:
            self._prefill, self._decode = self._prefill_step, self._decode_step

        self._slots: list[_Sequence | None] = [None] * max_batch
        self._pending: deque[Ticket] = deque()
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._stopping = False  # no new requests
        self._abort = False  # cancel everything now
        self._thread: threading.Thread | None = None
        self.decode_steps = self.generated_tokens = self.cancelled = 0
        # Steps compiled ahead of time and kept on disk (`precompile`); None: torch.compile's.
        self.precompiled: PrecompiledSteps | None = None
        # Rank 0 of several tensor-parallel ranks tells the others which call to run next.
        self._broadcast = StepBroadcast() if current_world_size() > 1 else None
        self.observer: EngineObserver | None = None  # e.g. the server's metrics
        # Per slot: the tokens whose keys and values fill its cache row's first positions (kept
        # after its request leaves: prefix reuse, see the module doc) and when it was last used.
        self._row_tokens: list[list[int]] = [[] for _ in range(max_batch)]
        self._row_used = [0.0] * max_batch
        self.rows = model.cache_rows()
        self.prefix_cache: PrefixCache | None = None
        if prefix_cache_mib > 0 and current_world_size() == 1:
            self.prefix_cache = PrefixCache(self.rows, int(prefix_cache_mib * 2**20), prefix_block)
        elif prefix_cache_mib > 0:
            log.info("no prefix cache under tensor parallelism: each slot reuses only its own row")
        self.reuse_prefixes = True  # look prompts up in the rows and the prefix cache (benchmarks switch it off)
        self.prompt_tokens = self.reused_prompt_tokens = 0
        # `follow_other_work`: the other work measured since when, the most threads, and the log.
        self._other_work: tuple[OtherWork, int, Callable[[str], None]] | None = None

    # Two functions, not one: dynamo keeps graphs per code object, so prefill's dynamic prompt
    # length and decode's fixed batch never share (or evict) each other's graphs.
    def _prefill_step(self, tokens: Tensor, input_pos: Tensor, mask: Tensor, rows: Tensor) -> Tensor:
        return self.model(tokens, input_pos, mask, cache_rows=rows)

    def _decode_step(self, tokens: Tensor, input_pos: Tensor, mask: Tensor) -> Tensor:
        return self.model(tokens, input_pos, mask)

    # The inputs of a call are built by one function on every rank, so that tensor-parallel
    # followers trace the same graphs (the same dynamic dimensions) as rank 0.
    def _run_prefill(self, tokens: Tensor, slot: int, start: int = 0) -> Tensor:
        """Prefill `tokens` [1, S] at positions start.. of the slot's row (the positions before
        `start` hold a reused prefix)."""
        s = tokens.shape[1]
        input_pos = torch.arange(start, start + s, device=self.device)
        mask = attention_mask(input_pos, start + s)
        rows = torch.tensor([slot], device=self.device)
        if self.precompiled is not None:
            out = self.precompiled.step("prefill", tokens, input_pos, mask, rows)
            return out if out is not None else self._prefill_step(tokens, input_pos, mask, rows)
        if self.compiled:  # size 1 is always specialized (a one-token prompt compiles once more)
            if s > 1:
                torch._dynamo.mark_dynamic(tokens, 1)
                torch._dynamo.mark_dynamic(input_pos, 0)
                torch._dynamo.mark_dynamic(mask, 2)
            if start + s > 1:
                torch._dynamo.mark_dynamic(mask, 3)
        return self._prefill(tokens, input_pos, mask, rows)

    def _run_decode(self, tokens: Tensor, input_pos: Tensor, kv_len: int) -> Tensor:
        mask = attention_mask(input_pos, kv_len)
        if self.precompiled is not None:
            out = self.precompiled.step("decode", tokens, input_pos, mask)
            return out if out is not None else self._decode_step(tokens, input_pos, mask)
        if self.compiled and not self.static_kv:
            torch._dynamo.mark_dynamic(mask, 3)
        return self._decode(tokens, input_pos, mask)

    def follow(self, receiver: StepBroadcast | None = None) -> None:
        """On a tensor-parallel rank other than 0: run the model calls rank 0 broadcasts, until it
        stops. This rank's logits are not used (rank 0 samples; every rank has the same ones)."""
        receiver = receiver or StepBroadcast()
        with torch.inference_mode():
            while True:
                op, arg, payload = receiver.receive()
                if op is Op.STOP:
                    return
                if op is Op.PREFILL:
                    tokens, positions = payload.to(self.device)
                    self._run_prefill(tokens[None], slot=arg, start=int(positions[0]))
                elif op is Op.DECODE:
                    tokens, positions = payload.to(self.device)
                    self._run_decode(tokens[:, None], positions[:, None], kv_len=arg)

    # ---- public API (any thread) ----

    def follow_other_work(self, most_threads: int, log: Callable[[str], None]) -> None:
        """Between steps, every FOLLOW_OTHER_WORK_S, fit the scheduler thread's count (at most
        `most_threads`) to the CPUs that other processes kept busy meanwhile (genfast/platform/threads.py),
        so that a server follows other work that starts or stops while it runs. Only where the
        thread count is genfast's to choose (genfast.llm.loading.genfast_chooses_threads)."""
        self._other_work = (OtherWork(), most_threads, log)

    def _follow_other_work(self) -> None:
        if self._other_work is None:
            return
        sample, most, log = self._other_work
        if time.monotonic() - sample.started >= FOLLOW_OTHER_WORK_S:
            follow_other_work(sample, most, log)  # on this thread: OpenMP's count is per thread
            self._other_work = (OtherWork(), most, log)

    def start(self) -> Engine:
        if self._thread is None:
            release_openmp_workers()
            # The scheduler computes on as many threads as the thread that starts it. A new thread
            # would take the count that any thread set last (torch keeps one for the process and a
            # new thread adopts it), which another engine, or a chat following other work, may
            # have lowered meanwhile.
            threads = torch.get_num_threads()
            self._thread = threading.Thread(target=self._run, args=(threads,), name="genfast-engine", daemon=True)
            self._thread.start()
        return self

    def submit(self, request: GenerationRequest, sink: Sink) -> Ticket:
        """Queue a request; raises UserError (invalid), QueueFull or EngineStopped."""
        matcher = self.validate(request)
        with self._cond:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            waiting = len(self._pending) - self._slots.count(None)  # those not about to get a slot
            if waiting >= self.max_queue:
                raise QueueFull(
                    f"all {self.max_batch} slots are busy and {len(self._pending)} requests are waiting; retry later"
                )
            ticket = Ticket(self, request, sink, next(self._ids), matcher)
            self._pending.append(ticket)
            self._cond.notify_all()
        return ticket

    def validate(self, request: GenerationRequest) -> Matcher | None:
        """Raise UserError for a request the engine cannot run; return its grammar's matcher (None:
        free text)."""
        n = len(request.prompt_ids)
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
            raise UserError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {request.logprobs}")
        if n == 0:
            raise UserError("the prompt is empty")
        if request.max_tokens < 1:
            raise UserError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if n + request.max_tokens > self.max_seq_len:
            raise UserError(
                f"this model's context holds {self.max_seq_len} tokens, but {n + request.max_tokens} were "
                f"requested ({n} in the prompt, {request.max_tokens} to generate); shorten the prompt or "
                "lower max_tokens"
            )
        if request.seed is not None and not MIN_SEED <= request.seed <= MAX_SEED:
            raise UserError(f"seed must be a 64-bit integer, got {request.seed}")
        vocab = self.model.args.vocab_size
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
            raise UserError(f"prompt token ids must be in [0, {vocab})")
        if request.grammar is None:
            return None
        matcher = self.constraints.matcher(request.grammar)
        if not matcher.allowed().any():
            raise UserError("no token of this model's vocabulary can start a reply in the requested format")
        return matcher

    def generate(self, request: GenerationRequest, on_text: Callable[[str], None] | None = None) -> Finished:
        """Submit and wait (blocking) for the result; `on_text` gets each Delta's text."""
        events: queue.Queue[Event] = queue.Queue()
        self.submit(request, events.put)
        while True:
            event = events.get()
            if isinstance(event, Finished):
                return event
            if on_text:
                on_text(event.text)

    def precompile(self, loaded: LoadedModel, log: Callable[[str], None]) -> PrecompiledSteps | None:
        """Use steps compiled ahead of time and kept on disk (genfast/llm/decoding/precompiled.py) for
        `loaded` (the loading.LoadedModel of this engine's model): on the CPU, one process, no
        transforming recipe step. `warmup` then loads them, or compiles and saves them."""
        if not self.compiled or self.device.type != "cpu" or loaded.tp > 1 or loaded.transforms:
            return None
        parts = key_parts(self.model, loaded.dtype_label(), loaded.quant, self.max_batch, self.max_seq_len, None, SERVE)
        self.precompiled = PrecompiledSteps(self.model, parts, None, loaded.load_args, log, SERVE)
        return self.precompiled

    def warmup(self) -> float:
        """Compile (or load from the compile cache) prefill and decode; return the seconds spent.

        A 2-token prompt marks the prompt length dynamic and 3 tokens the cache length, so these
        two graphs serve every later request (tests/serve checks that nothing recompiles). With
        precompiled steps: load them, or compile and save them, first.
        """
        t0 = time.perf_counter()
        if self.precompiled is not None:
            self.precompiled.wait()
        bos = self.tokenizer.bos_id or 0
        result = self.generate(GenerationRequest((bos, bos), max_tokens=3))
        if result.error:
            raise RuntimeError(f"warm-up failed: {result.error}")
        return time.perf_counter() - t0

    @property
    def stopping(self) -> bool:
        return self._stopping

    def stats(self) -> EngineStats:
        cache = self.prefix_cache
        with self._cond:
            running = [s for s in self._slots if s is not None]
            return EngineStats(
                self.max_batch,
                len(running),
                len(self._pending),
                self.decode_steps,
                self.generated_tokens,
                self.cancelled,
                self.max_seq_len,
                sum(s.pos for s in running),
                self.prompt_tokens,
                self.reused_prompt_tokens,
                prefix_cache_bytes=cache.nbytes if cache is not None else 0,
                prefix_cache_budget=cache.budget if cache is not None else 0,
                prefix_cache_evicted=cache.evicted if cache is not None else 0,
            )

    def shutdown(self, timeout: float = 0.0) -> None:
        """Take no new requests; let running and queued ones finish for up to `timeout` seconds,
        then cancel the rest (their sinks get Finished('cancelled')) and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            deadline = time.monotonic() + timeout
            while not self._idle() and self._thread is not None and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._abort = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._cond:  # never started, or stopped: nobody else will answer these
            self._cancel_all_locked()

    # ---- scheduler thread ----

    def _idle(self) -> bool:
        return not self._pending and all(s is None for s in self._slots)

    def _cancel(self, ticket: Ticket) -> None:
        with self._cond:
            ticket.cancelled = True
            if ticket in self._pending:  # not started: answer now and free its queue place
                self._pending.remove(ticket)
                self._finish_cancelled(ticket, [], None)

    def _finish_cancelled(self, ticket: Ticket, generated: list[int], text: str | None) -> None:
        self.cancelled += 1
        ticket.finish(Finished(text or "", generated, "cancelled", len(ticket.request.prompt_ids)))

    def _cancel_all_locked(self) -> None:
        while self._pending:
            self._finish_cancelled(self._pending.popleft(), [], None)
        for i, seq in enumerate(self._slots):
            if seq is not None:
                self._slots[i] = None
                self._finish_cancelled(seq.ticket, seq.generated, seq.stream.text)

    def _run(self, threads: int) -> None:
        torch.set_num_threads(threads)
        try:
            self._schedule()
        finally:
            if self._broadcast is not None:
                self._broadcast.send(Op.STOP)

    def _schedule(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while self._idle() and not self._stopping and not self._abort:
                        if not self._cond.wait(KEEPALIVE_S) and self._broadcast is not None:
                            self._broadcast.send(Op.KEEPALIVE)
                    if self._abort or (self._stopping and self._idle()):
                        self._cancel_all_locked()
                        self._cond.notify_all()
                        return
                    admitted = []
                    while self._pending and None in self._slots:
                        ticket = self._pending.popleft()
                        slot, cached = self._pick_slot(ticket.request.prompt_ids)
                        try:
                            self._slots[slot] = self._new_sequence(ticket)
                        except Exception as e:  # a bug: fail this request; the scheduler must live on
                            log.exception("admitting a request failed")
                            error = f"{type(e).__name__}: {e}"
                            ticket.finish(Finished("", [], "error", len(ticket.request.prompt_ids), error=error))
                            continue
                        self._slots[slot].cached = self._slots[slot].prefilled = cached
                        admitted.append(slot)
                try:
                    self._follow_other_work()
                    for slot in admitted:  # outside the lock: a copy of up to the whole context
                        self._restore(slot)
                    self._prefill_some()
                    self._drop_cancelled()
                    if any(s is not None and self._decoding(s) for s in self._slots):
                        self._step()
                except Exception as e:  # a bug: fail the running requests, keep serving the next ones
                    log.exception("decode step failed")
                    self._fail_all(f"{type(e).__name__}: {e}")
                with self._cond:
                    self._cond.notify_all()  # shutdown() waits for idleness

    def _pick_slot(self, prompt: Sequence[int]) -> tuple[int, int]:
        """The free slot whose row shares the longest prefix with `prompt` (among equals, the least
        recently used: its row is the one evicted), and how many prompt tokens its row holds."""
        free = [slot for slot, seq in enumerate(self._slots) if seq is None]
        held = {slot: self._row_prefix(slot, prompt) if self.reuse_prefixes else 0 for slot in free}
        slot = max(free, key=lambda slot: (held[slot], -self._row_used[slot]))
        return slot, held[slot]

    def _row_prefix(self, slot: int, prompt: Sequence[int]) -> int:
        return self.rows.reusable(slot, reusable_prefix(self._row_tokens[slot], prompt))

    def _restore(self, slot: int) -> None:
        """Copy the longest prefix of the slot's prompt the prefix cache holds into its row, where
        it is longer than what the row holds already."""
        seq = self._slots[slot]
        assert seq is not None
        if self.prefix_cache is None or not self.reuse_prefixes:
            return
        prompt = seq.ticket.request.prompt_ids
        prefix = self.prefix_cache.match(prompt)
        if prefix.length <= seq.cached:
            return
        seq.cached = seq.prefilled = self.prefix_cache.restore(slot, prefix, seq.cached)
        self._row_tokens[slot] = list(prompt[: seq.prefilled])

    def _keep(self, slot: int) -> None:
        """Store what the slot's row holds in the prefix cache."""
        if self.prefix_cache is not None:
            self.prefix_cache.store(slot, self._row_tokens[slot])

    def _new_sequence(self, ticket: Ticket) -> _Sequence:
        req = ticket.request
        generator = None
        if req.seed is not None and not req.params.greedy:
            generator = torch.Generator(self.device).manual_seed(req.seed)
        return _Sequence(ticket, TextStream(self.tokenizer, req.stop), generator)

    @staticmethod
    def _decoding(seq: _Sequence) -> bool:
        return seq.prefilled == len(seq.ticket.request.prompt_ids)

    def _prefill_some(self) -> None:
        """Up to `prefill_chunk` prompt tokens of the requests still prefilling, oldest first,
        between two decode steps: a long prompt is prefilled a chunk at a time, so the other
        requests keep decoding meanwhile (chunked prefill)."""
        budget = self.prefill_chunk
        waiting = sorted((s.ticket.id, slot) for slot, s in enumerate(self._slots) if s and not self._decoding(s))
        for _, slot in waiting:
            if budget == 0:
                break
            budget -= self._prefill_chunk(slot, budget)

    def _prefill_chunk(self, slot: int, budget: int) -> int:
        """Prefill up to `budget` more of the slot's prompt into its cache row; when the whole
        prompt is in, take the first token. Returns the tokens prefilled."""
        seq = self._slots[slot]
        assert seq is not None
        prompt = seq.ticket.request.prompt_ids
        start = seq.prefilled
        n = min(budget, len(prompt) - start)
        tokens = torch.tensor([prompt[start : start + n]])
        if self._broadcast is not None:
            positions = torch.arange(start, start + n)[None]
            self._broadcast.send(Op.PREFILL, slot, torch.cat([tokens, positions]))
        logits = self._run_prefill(tokens.to(self.device), slot, start)
        seq.prefilled = start + n
        self._row_tokens[slot] = list(prompt[: seq.prefilled])  # what the row holds so far
        self._row_used[slot] = time.monotonic()
        if not self._decoding(seq):
            self._keep(slot)  # requests running beside this one may share its prompt's start
            return n
        self.prompt_tokens += len(prompt)
        self.reused_prompt_tokens += seq.cached
        seq.pos = len(prompt)
        token, logprob = self._sample(logits, [seq])[0]
        self._accept(slot, token, logprob)  # the first token goes out before the prompt is stored
        if self._slots[slot] is seq:
            self._keep(slot)
        return n

    def _step(self) -> None:
        """One decode step for every slot; free slots, and those still prefilling, run a dummy
        token at the last cache position, which no request reaches (their rows keep what prefix
        reuse and the next prefill chunk need)."""
        seqs = [s if s is not None and self._decoding(s) else None for s in self._slots]
        idle = self.max_seq_len - 1
        tokens_positions = torch.tensor([[s.last if s else 0 for s in seqs], [s.pos if s else idle for s in seqs]])
        for slot, s in enumerate(seqs):
            if s is not None:
                self._row_tokens[slot].append(s.last)
        kv_len = self.max_seq_len if self.static_kv else max(s.pos for s in seqs if s) + 1
        if self._broadcast is not None:
            self._broadcast.send(Op.DECODE, kv_len, tokens_positions)
        tokens, positions = tokens_positions.to(self.device)
        logits = self._run_decode(tokens[:, None], positions[:, None], kv_len)
        self.decode_steps += 1
        for slot, (token, logprob) in enumerate(self._sample(logits, seqs)):
            if seqs[slot] is not None:
                seqs[slot].pos += 1
                self._accept(slot, token, logprob)

    def _sample(self, logits: Tensor, seqs: Sequence[_Sequence | None]) -> list[tuple[int, TokenLogprob | None]]:
        """Next token per row: argmax for greedy rows (all rows at once), and for sampling rows a
        draw with the row's own temperature/top-p and random stream; with its log-probabilities
        for the rows that asked. A row with a grammar samples among the tokens it admits."""
        constrained = [(i, seq.matcher) for i, seq in enumerate(seqs) if seq is not None and seq.matcher is not None]
        if constrained:
            allowed = torch.ones(logits.shape, dtype=torch.bool)
            for i, matcher in constrained:
                allowed[i] = matcher.allowed()
            logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
        tokens = logits.argmax(dim=-1)
        sampled: dict[int, Tensor] = {}
        for i, seq in enumerate(seqs):
            if seq is not None and not seq.ticket.request.params.greedy:
                sampled[i] = probabilities(logits[i : i + 1], seq.ticket.request.params)
                tokens[i] = draw(sampled[i], seq.generator)[0]
        chosen = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(chosen)
        for i, seq in enumerate(seqs):
            if seq is not None and seq.ticket.request.logprobs is not None:
                dist = sampled[i][0].log() if i in sampled else logits[i].float().log_softmax(dim=-1)
                text = self._token_text(seq)
                logprobs[i] = _token_logprob(dist, chosen[i], seq.ticket.request.logprobs, text)
        return list(zip(chosen, logprobs, strict=True))

    def _token_text(self, seq: _Sequence) -> Callable[[int], str]:
        """A next token's text after `seq`'s last generated tokens: what decoding adds when it is
        appended (SentencePiece decodes a lone "▁word" without its space), so that the tokens'
        texts join into the generated text."""
        context = seq.generated[-3:]
        before = self.tokenizer.decode(context)

        def text(token: int) -> str:
            after = self.tokenizer.decode([*context, token])
            return after[len(before) :] if after.startswith(before) else self.tokenizer.decode([token])

        return text

    def _accept(self, slot: int, token: int, logprob: TokenLogprob | None = None) -> None:
        seq = self._slots[slot]
        assert seq is not None
        if token in self.tokenizer.stop_ids:  # EOS ends the sequence and is not part of it
            self._finish(slot, "stop")
            return
        if seq.matcher is not None:
            seq.matcher.take(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
            seq.unsent += 1
        seq.generated.append(token)
        self.generated_tokens += 1
        now = time.perf_counter()
        if self.observer is not None:
            if len(seq.generated) == 1:
                self.observer.on_first_token(now - seq.ticket.submitted)
            else:
                self.observer.on_token(now - seq.token_time)
        seq.token_time = now
        text = seq.stream.push(token)
        if text:
            seq.ticket.sink(Delta(text, self._unsent_logprobs(seq)))
        if seq.stream.stopped or (seq.matcher is not None and seq.matcher.complete):
            self._finish(slot, "stop")
        elif len(seq.generated) >= seq.ticket.request.max_tokens:
            self._finish(slot, "length")
        else:
            seq.last = token

    def _finish(self, slot: int, reason: str) -> None:
        seq = self._slots[slot]
        assert seq is not None
        tail = seq.stream.finish()
        if tail or seq.unsent:
            seq.ticket.sink(Delta(tail, self._unsent_logprobs(seq)))
        self._keep(slot)
        with self._cond:
            self._slots[slot] = None
        logprobs = tuple(seq.logprobs) if seq.ticket.request.logprobs is not None else None
        prompt_tokens = len(seq.ticket.request.prompt_ids)
        seq.ticket.finish(
            Finished(seq.stream.text, seq.generated, reason, prompt_tokens, logprobs=logprobs, cached_tokens=seq.cached)
        )

    @staticmethod
    def _unsent_logprobs(seq: _Sequence) -> tuple[TokenLogprob, ...]:
        unsent = tuple(seq.logprobs[len(seq.logprobs) - seq.unsent :])
        seq.unsent = 0
        return unsent

    def _drop_cancelled(self) -> None:
        with self._cond:
            for slot, seq in enumerate(self._slots):
                if seq is not None and seq.ticket.cancelled:
                    self._slots[slot] = None
                    self._finish_cancelled(seq.ticket, seq.generated, seq.stream.text)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            for slot, seq in enumerate(self._slots):
                if seq is not None:
                    self._slots[slot] = None
                    self._row_tokens[slot] = []  # what the failed step left in the row is unknown
                    seq.ticket.finish(
                        Finished(
                            seq.stream.text, seq.generated, "error", len(seq.ticket.request.prompt_ids), error=message
                        )
                    )
