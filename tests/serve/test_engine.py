"""The continuous-batching engine without HTTP: per-slot equality with single-request generation
as requests join and leave, per-row sampling, cancellation, shutdown, and no recompiles."""

from __future__ import annotations

import os
import queue
import re
import threading
import time

import pytest
import torch

from genfast.llm.decoding.generate import Generator
from genfast.llm.decoding.sampling import SamplingParams
from genfast.serve import engine as engine_module
from genfast.serve.engine import Delta, Engine, EngineStopped, Finished, GenerationRequest
from tests.busy import busy_loop, needs_proc, skip_if_busy_beside, threads_restored
from tests.serve.conftest import load_tiny, wait_until

PROMPTS = [[5, 17, 3], [9] * 12, [200, 1, 33, 7, 7, 7, 2], [44, 45], [300, 2, 8, 1, 9], [12, 13, 14, 15, 16, 17]]
LENGTHS = [20, 7, 30, 12, 25, 3]  # requests leave at different steps; later ones take their slots


def single_request_outputs(model, tokenizer, prompts, lengths, compile: bool = False) -> list[list[int]]:
    gen = Generator(model, tokenizer, max_seq_len=1024, compile=compile)
    return [gen.generate([p], n).token_ids[0] for p, n in zip(prompts, lengths)]


def run_concurrently(engine: Engine, requests: list[GenerationRequest]) -> list[Finished]:
    results: list[Finished | None] = [None] * len(requests)

    def run(i: int) -> None:
        results[i] = engine.generate(requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_requests_joining_and_leaving_match_single_request_generation(tiny_dir):
    want = single_request_outputs(*load_tiny(tiny_dir), PROMPTS, LENGTHS)
    engine = Engine(*load_tiny(tiny_dir), max_batch=3, compile=False).start()
    got = run_concurrently(engine, [GenerationRequest(tuple(p), n) for p, n in zip(PROMPTS, LENGTHS)])
    assert [r.token_ids for r in got] == want
    assert all(r.finish_reason == "length" and r.prompt_tokens == len(p) for r, p in zip(got, PROMPTS))
    stats = engine.stats()
    assert stats.decode_steps < sum(LENGTHS) - len(LENGTHS)  # steps were shared
    engine.shutdown()


def test_the_static_cache_path_that_cuda_takes_gives_the_single_request_tokens(tiny_dir):
    """On CUDA every decode step reads the whole cache (fixed shapes for CUDA graphs), elsewhere
    only up to the longest sequence: the CUDA path run here, on the CPU, against single requests
    on the CPU's own path."""
    want = single_request_outputs(*load_tiny(tiny_dir), PROMPTS, LENGTHS)
    engine = Engine(*load_tiny(tiny_dir), max_batch=3, max_seq_len=128, compile=False)
    engine.static_kv = True
    engine.start()
    try:
        got = run_concurrently(engine, [GenerationRequest(tuple(p), n) for p, n in zip(PROMPTS, LENGTHS)])
    finally:
        engine.shutdown()
    assert [r.error for r in got] == [None] * len(PROMPTS)
    assert [r.token_ids for r in got] == want


def test_a_request_that_fails_inside_the_scheduler_fails_alone_and_the_engine_serves_on(tiny_dir, monkeypatch):
    """A bug met while admitting a request or running a step fails the requests it touches with
    an "error" answer; the scheduler thread lives on (it died on an admission error, and every
    later request waited forever)."""
    want = single_request_outputs(*load_tiny(tiny_dir), PROMPTS[:1], [6])[0]
    engine = Engine(*load_tiny(tiny_dir), max_batch=1, compile=False).start()
    request = GenerationRequest(tuple(PROMPTS[0]), 6)

    def answer() -> Finished:  # not engine.generate: a dead scheduler would leave it waiting forever
        events: queue.Queue = queue.Queue()
        engine.submit(request, events.put)
        while not isinstance(event := events.get(timeout=60), Finished):
            pass
        return event

    admit, step = engine._new_sequence, engine._step
    for part, original in (("_new_sequence", admit), ("_step", step)):

        def broken(*args, part=part):
            raise RuntimeError(f"broken {part}")

        monkeypatch.setattr(engine, part, broken)
        failed = answer()
        assert failed.finish_reason == "error" and failed.error == f"RuntimeError: broken {part}"
        monkeypatch.setattr(engine, part, original)
        assert answer().token_ids == want
    engine.shutdown()


def test_sampled_neighbours_leave_greedy_rows_alone(tiny_dir):
    want = single_request_outputs(*load_tiny(tiny_dir), PROMPTS[:2], [16, 16])
    engine = Engine(*load_tiny(tiny_dir), max_batch=4, compile=False).start()
    hot = SamplingParams(temperature=1.5, top_p=0.95)
    requests = [
        GenerationRequest(tuple(PROMPTS[0]), 16),
        GenerationRequest(tuple(PROMPTS[3]), 16, hot, seed=1),
        GenerationRequest(tuple(PROMPTS[1]), 16),
        GenerationRequest(tuple(PROMPTS[3]), 16, hot, seed=1),
    ]
    got = run_concurrently(engine, requests)
    assert [got[0].token_ids, got[2].token_ids] == want
    assert got[1].token_ids == got[3].token_ids  # same seed, same draws, whatever the batch holds
    engine.shutdown()


def test_cancel_queued_and_running_requests(tiny_dir):
    engine = Engine(*load_tiny(tiny_dir), max_batch=1, max_queue=2, compile=False).start()
    events: queue.Queue = queue.Queue()
    running = engine.submit(GenerationRequest((1, 2, 3), 900), events.put)
    waiting = engine.submit(GenerationRequest((1, 2, 3), 900), lambda e: None)
    assert wait_until(lambda: engine.stats().active == 1 and engine.stats().queued == 1)
    waiting.cancel()
    assert engine.stats().queued == 0
    assert isinstance(events.get(timeout=10), Delta)
    running.cancel()
    while not isinstance(event := events.get(timeout=10), Finished):
        pass
    assert event.finish_reason == "cancelled" and 0 < event.completion_tokens < 900
    assert wait_until(lambda: engine.stats().active == 0) and engine.stats().cancelled == 2
    engine.shutdown()


def test_shutdown_finishes_in_flight_work_then_refuses(tiny_dir):
    engine = Engine(*load_tiny(tiny_dir), max_batch=2, compile=False).start()
    results: queue.Queue = queue.Queue()
    for p in PROMPTS[:3]:  # two run, one waits
        engine.submit(GenerationRequest(tuple(p), 10), lambda e: isinstance(e, Finished) and results.put(e))
    engine.shutdown(timeout=60)
    done = [results.get(timeout=1) for _ in range(3)]
    assert [r.finish_reason for r in done] == ["length"] * 3
    with pytest.raises(EngineStopped):
        engine.submit(GenerationRequest((1,), 2), lambda e: None)


def test_shutdown_timeout_cancels_what_is_left(tiny_dir):
    engine = Engine(*load_tiny(tiny_dir), max_batch=1, compile=False).start()
    results: queue.Queue = queue.Queue()
    for _ in range(2):
        engine.submit(GenerationRequest((1, 2), 1000), lambda e: isinstance(e, Finished) and results.put(e))
    assert wait_until(lambda: engine.stats().generated_tokens > 0)
    engine.shutdown(timeout=0.1)
    assert sorted(results.get(timeout=1).finish_reason for _ in range(2)) == ["cancelled", "cancelled"]


def test_compiled_decode_never_recompiles_as_requests_come_and_go(tiny_dir):
    """One compiled prefill graph (dynamic prompt length) and one decode graph (fixed slots,
    dynamic cache length) serve every mix of requests; outputs equal eager single requests."""
    from torch._dynamo.utils import counters

    want = single_request_outputs(*load_tiny(tiny_dir), PROMPTS, LENGTHS)
    engine = Engine(*load_tiny(tiny_dir), max_batch=3, compile=True).start()
    engine.warmup()
    graphs = counters["stats"]["unique_graphs"]
    got = run_concurrently(engine, [GenerationRequest(tuple(p), n) for p, n in zip(PROMPTS, LENGTHS)])
    assert [r.token_ids for r in got] == want
    assert counters["stats"]["unique_graphs"] == graphs, "a request joining or leaving recompiled"
    engine.shutdown()


def test_invalid_requests_are_refused_before_queueing(tiny_dir):
    from genfast.errors import UserError

    engine = Engine(*load_tiny(tiny_dir), max_batch=1, max_seq_len=64, compile=False)
    for request, message in [
        (GenerationRequest((), 4), "empty"),
        (GenerationRequest((1,), 0), "max_tokens"),
        (GenerationRequest((1,) * 60, 8), "context holds 64"),
        (GenerationRequest((1, 99999), 4), "token ids"),
        (GenerationRequest((1,), 4, SamplingParams(temperature=1.0), seed=2**64), "64-bit"),  # stopped the engine
    ]:
        with pytest.raises(UserError, match=message):
            engine.submit(request, lambda e: None)
    assert engine.stats().queued == 0


class _Recorder:
    """Stands in for rank 0's broadcast: keeps what would be sent."""

    def __init__(self) -> None:
        self.messages: list[tuple] = []

    def send(self, op, arg: int = 0, payload=None) -> None:
        self.messages.append((op, arg, None if payload is None else payload.clone()))


class _Replay:
    """Stands in for a follower's receiving end: hands back recorded messages in order."""

    def __init__(self, messages: list[tuple]) -> None:
        self.messages = iter(messages)

    def receive(self) -> tuple:
        return next(self.messages)


def test_tensor_parallel_leader_announces_every_model_call_and_a_follower_replays_them(tiny_dir, monkeypatch):
    """Rank 0's engine sends one message per model call (and keep-alives while idle, and STOP when
    it stops); a follower that runs those messages ends with exactly rank 0's KV cache, so its
    shard would have joined every all-reduce in the same order. (tests/serve/test_serve_cli.py
    runs the real two-process server.)"""
    import genfast.serve.engine as engine_module
    from genfast.serve.tensor_parallel import Op

    monkeypatch.setattr(engine_module, "KEEPALIVE_S", 0.02)
    leader = Engine(*load_tiny(tiny_dir), max_batch=2, compile=False)
    leader._broadcast = recorder = _Recorder()
    leader.start()
    assert wait_until(lambda: len(recorder.messages) >= 2)  # idle: keep-alives only
    run_concurrently(leader, [GenerationRequest(tuple(p), n) for p, n in zip(PROMPTS[:3], LENGTHS[:3])])
    leader.shutdown()

    ops = [op for op, _, _ in recorder.messages]
    assert ops[:2] == [Op.KEEPALIVE] * 2 and ops[-1] is Op.STOP and ops.count(Op.STOP) == 1
    assert ops.count(Op.PREFILL) == 3 and ops.count(Op.DECODE) == leader.decode_steps
    prefills = [(arg, payload[0].tolist()) for op, arg, payload in recorder.messages if op is Op.PREFILL]
    assert sorted(tokens for _, tokens in prefills) == sorted(PROMPTS[:3])
    assert all(slot in (0, 1) for slot, _ in prefills)

    follower = Engine(*load_tiny(tiny_dir), max_batch=2, compile=False)
    follower.follow(_Replay(recorder.messages))  # returns at STOP
    for mine, theirs in zip(leader.model.layers, follower.model.layers, strict=True):
        assert torch.equal(mine.attention.kv_cache.k, theirs.attention.kv_cache.k)
        assert torch.equal(mine.attention.kv_cache.v, theirs.attention.kv_cache.v)
    assert leader.model.layers[0].attention.kv_cache.k.abs().sum() > 0  # the caches were written


def test_saved_compiled_steps_serve_every_mix_of_requests(tiny_dir):
    """The engine's steps compiled ahead of time (genfast/llm/decoding/precompiled.py): the first engine
    compiles and saves them, a second one (as at the next start) loads them; both equal eager
    single requests for requests joining and leaving."""
    from genfast.llm.loading import load

    want = single_request_outputs(*load_tiny(tiny_dir), PROMPTS, LENGTHS)
    requests = [GenerationRequest(tuple(p), n) for p, n in zip(PROMPTS, LENGTHS)]
    keys = []
    for _ in range(2):
        loaded = load(str(tiny_dir), "cpu", "float32")
        engine = Engine(loaded.model, loaded.tokenizer, max_batch=3, compile=True)
        steps = engine.precompile(loaded, print)
        assert steps is not None
        keys.append((steps.artifacts.key, steps.artifacts.complete(["prefill", "decode"])))
        engine.start().warmup()
        got = run_concurrently(engine, requests)
        assert [r.token_ids for r in got] == want
        assert steps._checked == {"prefill", "decode"}  # the compiled steps ran
        engine.shutdown()
    assert keys[0][0] == keys[1][0] and keys == [(keys[0][0], False), (keys[0][0], True)]


@pytest.mark.parametrize("name", ["gemma2", "qwen3_moe"])
def test_ring_caches_and_experts_under_continuous_batching(name, tmp_path):
    """Rows at their own positions in sliding-window rings (Gemma 2: sequences outgrow the ring
    of 38 slots) and tokens of several rows routed to shared experts (Qwen3-MoE) still give each
    request its single-request tokens as requests join and leave."""
    from tests.llm.hf_fixtures import make_hf_model, save_hf_model, word_tokenizer

    hf = make_hf_model(name)
    directory = save_hf_model(hf, tmp_path / name)
    word_tokenizer(hf.config.vocab_size).save(directory)
    prompts = [[t % hf.config.vocab_size for t in p] for p in PROMPTS]
    lengths = [n + 30 for n in LENGTHS]
    gen = Generator(*load_tiny(directory), max_seq_len=128, compile=False)
    want = [gen.generate([p], n).token_ids[0] for p, n in zip(prompts, lengths)]
    engine = Engine(*load_tiny(directory), max_batch=3, max_seq_len=128, compile=False).start()
    got = run_concurrently(engine, [GenerationRequest(tuple(p), n) for p, n in zip(prompts, lengths)])
    assert [r.token_ids for r in got] == want
    engine.shutdown()


def test_a_prompt_sharing_a_prefix_with_a_slots_last_request_prefills_only_the_rest(tiny_dir):
    """Prefix reuse (see genfast/serve/engine.py): the longest-matching free slot is taken, only
    the uncached tokens are prefilled, the greedy tokens equal uncached generation, and taking a
    slot for another prompt evicts its row (one slot here)."""
    system = [7, 8, 9, 10, 11, 12, 13, 14] * 8  # a 64-token shared prefix
    first, second, other = system + [20, 21], system + [30, 31, 32], [200, 201, 202]
    gen = Generator(*load_tiny(tiny_dir), max_seq_len=1024, compile=False)
    want = {tuple(p): gen.generate([p], 12).token_ids[0] for p in (first, second, other)}
    engine = Engine(*load_tiny(tiny_dir), max_batch=1, compile=False, prefix_cache_mib=0).start()

    def run(prompt: list[int]) -> Finished:
        done = engine.generate(GenerationRequest(tuple(prompt), 12))
        assert done.token_ids == want[tuple(prompt)]
        return done

    assert run(first).cached_tokens == 0
    assert run(second).cached_tokens == len(system)  # the row holds first's prompt and reply
    assert run(second).cached_tokens == len(second) - 1  # all but the last prompt token
    assert run(other).cached_tokens == 0
    assert run(first).cached_tokens == 0  # other's request evicted the shared prefix
    stats = engine.stats()
    assert stats.reused_prompt_tokens == len(system) + len(second) - 1
    assert stats.prompt_tokens == 2 * len(first) + 2 * len(second) + len(other)
    engine.shutdown()


def test_requests_go_to_the_slot_that_holds_their_prefix(tiny_dir):
    engine = Engine(*load_tiny(tiny_dir), max_batch=3, compile=False).start()
    prompts = [[5 + i] * 20 for i in range(3)]
    for p in prompts:  # one after another: each lands in the least recently used free slot
        engine.generate(GenerationRequest(tuple(p), 4))
    assert sorted(len(r) for r in engine._row_tokens) == [23, 23, 23]
    for p in reversed(prompts):  # each finds its own row again
        assert engine.generate(GenerationRequest(tuple(p + [1]), 4)).cached_tokens == 20
    engine.shutdown()


def block_bytes(engine: Engine) -> int:
    """The memory of one prefix-cache block of `engine`'s model (fp32 keys and values)."""
    args = engine.model.args
    return args.n_layers * 2 * args.n_kv_heads * engine.prefix_cache.block_size * args.head_dim * 4


def test_the_prefix_cache_shares_a_running_requests_prompt_with_another_slot(tiny_dir):
    """B arrives while A, which shares its first 64 tokens, is still decoding in the other slot:
    B copies A's four stored blocks into its own (empty) row instead of prefilling them, and both
    give their uncached greedy tokens."""
    system = [(5 * i) % 300 + 3 for i in range(64)]
    a, b = system + [20, 21, 22], system + [30, 31]
    gen = Generator(*load_tiny(tiny_dir), max_seq_len=1024, compile=False)
    want_a, want_b = (gen.generate([p], n).token_ids[0] for p, n in ((a, 60), (b, 8)))
    engine = Engine(*load_tiny(tiny_dir), max_batch=2, compile=False, prefix_block=16).start()
    events: queue.Queue = queue.Queue()
    engine.submit(GenerationRequest(tuple(a), 60), events.put)
    assert isinstance(events.get(timeout=30), Delta)  # A is decoding
    got_b = engine.generate(GenerationRequest(tuple(b), 8))
    assert engine.stats().active == 1  # A still runs
    assert got_b.cached_tokens == 64 and got_b.token_ids == want_b
    while not isinstance(got_a := events.get(timeout=30), Finished):
        pass
    assert got_a.cached_tokens == 0 and got_a.token_ids == want_a
    engine.shutdown()


def test_the_prefix_cache_evicts_least_recently_used_blocks_to_stay_in_its_budget(tiny_dir):
    """A budget of five 16-token blocks: Y's four blocks evict X's last three (its first, the
    parent of the others, is evicted last), so X again finds one block in the cache and its row
    holds Y; outputs stay the uncached ones."""
    x, y = [[(k * (i + 1)) % 300 + 3 for i in range(66)] for k in (7, 11)]
    gen = Generator(*load_tiny(tiny_dir), max_seq_len=1024, compile=False)
    want = {tuple(p): gen.generate([p], 4).token_ids[0] for p in (x, y)}
    engine = Engine(*load_tiny(tiny_dir), max_batch=1, compile=False, prefix_block=16)
    budget = 5 * block_bytes(engine)
    engine = Engine(*load_tiny(tiny_dir), max_batch=1, compile=False, prefix_block=16, prefix_cache_mib=budget / 2**20)
    engine.start()
    results = [engine.generate(GenerationRequest(tuple(p), 4)) for p in (x, y, x)]
    assert [r.token_ids for r in results] == [want[tuple(x)], want[tuple(y)], want[tuple(x)]]
    assert [r.cached_tokens for r in results] == [0, 0, 16]
    stats = engine.stats()
    assert stats.prefix_cache_budget == budget and stats.prefix_cache_bytes <= budget
    assert stats.prefix_cache_evicted == 3 + 3  # X's last three, then Y's last three
    assert len(engine.prefix_cache) == 5
    engine.shutdown()


def test_without_a_prefix_cache_only_rows_are_reused(tiny_dir):
    engine = Engine(*load_tiny(tiny_dir), max_batch=2, compile=False, prefix_cache_mib=0).start()
    assert engine.prefix_cache is None and engine.stats().prefix_cache_budget == 0
    engine.shutdown()


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    """Gemma 2 with a 6-token window (rings of 38 slots) on every other layer."""
    from tests.llm.hf_fixtures import make_hf_model, save_hf_model, word_tokenizer

    hf = make_hf_model("gemma2")
    directory = save_hf_model(hf, tmp_path_factory.mktemp("gemma2"))
    word_tokenizer(hf.config.vocab_size).save(directory)
    return directory


def test_ring_rows_keep_their_keys_between_prefill_chunks(gemma2_dir):
    """Idle rows run decode steps at the last cache position; a ring must not store that write,
    or a row between two prefill chunks loses a key inside its window."""
    prompts = [[(7 * i + j) % 250 + 3 for j in range(n)] for i, n in enumerate((70, 5, 41, 16, 90))]
    gen = Generator(*load_tiny(gemma2_dir), max_seq_len=128, compile=False)
    want = [gen.generate([p], 10).token_ids[0] for p in prompts]
    engine = Engine(*load_tiny(gemma2_dir), max_batch=2, max_seq_len=128, compile=False, prefill_chunk=5).start()
    got = run_concurrently(engine, [GenerationRequest(tuple(p), 10) for p in prompts])
    assert [r.token_ids for r in got] == want
    engine.shutdown()


def test_sliding_window_models_reuse_rows_and_blocks_whose_window_is_held(gemma2_dir):
    """A chat turn continues in its row (the ring holds the window before the reused prefix); a
    prompt sharing A's first 32 tokens restores them from the prefix cache (block 1 was stored with
    its ring keys right after A's prefill; block 0 was not, the ring having moved past it), and
    one sharing only 16 finds nothing usable: neither block 0 nor A's row holds the window before
    position 16. Every output equals its uncached one."""
    a = [(3 * i) % 250 + 3 for i in range(40)]
    gen = Generator(*load_tiny(gemma2_dir), max_seq_len=128, compile=False)
    reply = gen.generate([a], 8).token_ids[0]
    turn = a + reply + [9, 10, 11]
    b, c = a[:32] + [100, 101, 102], a[:16] + [100, 101, 102]
    want = [gen.generate([p], 8).token_ids[0] for p in (turn, b, c)]
    engine = Engine(*load_tiny(gemma2_dir), max_batch=2, max_seq_len=128, compile=False, prefix_block=16)
    engine.start()
    assert engine.generate(GenerationRequest(tuple(a), 8)).token_ids == reply
    results = [engine.generate(GenerationRequest(tuple(p), 8)) for p in (turn, b, c)]
    assert [r.token_ids for r in results] == want
    assert [r.cached_tokens for r in results] == [len(a) + 7, 32, 0]
    engine.shutdown()


def test_long_prompts_are_prefilled_in_chunks_with_the_same_tokens(tiny_dir):
    """Prompts longer than the chunk are prefilled over several rounds (each chunk attends to the
    ones before it in the cache) and give the single-request tokens (fp32), alongside short ones."""
    prompts = [[(7 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate((70, 5, 41, 16))]
    gen = Generator(*load_tiny(tiny_dir), max_seq_len=1024, compile=False)
    want = [gen.generate([p], 10).token_ids[0] for p in prompts]
    engine = Engine(*load_tiny(tiny_dir), max_batch=2, compile=False, prefill_chunk=16).start()
    got = run_concurrently(engine, [GenerationRequest(tuple(p), 10) for p in prompts])
    assert [r.token_ids for r in got] == want
    assert engine.stats().prompt_tokens == sum(map(len, prompts))
    engine.shutdown()


def test_a_long_prompt_does_not_stall_the_running_requests(tiny_dir):
    """While a 640-token prompt is prefilled 64 tokens at a time, the running request gets a
    decode step after every chunk: at least 9 steps before the long request's first token."""
    engine = Engine(*load_tiny(tiny_dir), max_batch=2, compile=False, prefill_chunk=64).start()
    steps_at: dict[str, int] = {}
    running = threading.Event()

    def short_sink(event) -> None:
        running.set()

    def long_sink(event) -> None:
        steps_at.setdefault("first", engine.decode_steps)

    engine.submit(GenerationRequest((5, 6, 7), 300), short_sink)
    assert running.wait(30)
    steps_at["submitted"] = engine.decode_steps
    engine.submit(GenerationRequest(tuple((i % 300) + 3 for i in range(640)), 2), long_sink)
    assert wait_until(lambda: "first" in steps_at, timeout=60)
    assert steps_at["first"] - steps_at["submitted"] >= 9
    engine.shutdown(timeout=0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_scheduler_computes_on_the_thread_count_of_the_thread_that_started_it(tiny_dir):
    """torch keeps one thread count per process that a new thread adopts: the one set last by
    any thread. Another thread's lower count (an earlier engine's that followed other work) must
    not become the scheduler's; the suite's 'follows other work' test failed so once."""
    seen: list[int] = []
    with threads_restored():
        torch.set_num_threads(2)
        other = threading.Thread(target=torch.set_num_threads, args=(1,))
        other.start()
        other.join()
        engine = Engine(*load_tiny(tiny_dir), max_batch=2, compile=False)
        engine._follow_other_work = lambda: seen.append(torch.get_num_threads())  # runs on the scheduler
        engine.start()
        engine.generate(GenerationRequest(tuple(PROMPTS[0]), 2))
        engine.shutdown()
    assert seen and set(seen) == {2}


@pytest.mark.alone
@needs_proc
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_the_scheduler_follows_other_work_that_starts_and_stops(tiny_dir, monkeypatch):
    """Busy loops beside a running server take a thread from its next step after they were
    measured; it comes back once they stop. The tokens stay the same."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(engine_module, "FOLLOW_OTHER_WORK_S", 0.5)
    skip_if_busy_beside()
    request = GenerationRequest(tuple(PROMPTS[0]), 8)
    messages: list[str] = []
    with threads_restored():
        engine = Engine(*load_tiny(tiny_dir), max_batch=2, compile=False)
        engine.follow_other_work(2, messages.append)
        engine.start()
        with busy_loop(count=2):
            time.sleep(0.6)
            beside = engine.generate(request)
        time.sleep(0.6)
        alone = engine.generate(request)
        engine.shutdown()
    assert beside.token_ids == alone.token_ids
    assert len(messages) == 2, messages
    assert re.fullmatch(r"genfast: other processes kept [\d.]+ CPUs busy: computing on 1 thread, not 2", messages[0])
    assert re.fullmatch(r"genfast: other processes kept [\d.]+ CPUs busy: computing on 2 threads, not 1", messages[1])
