"""The continuous-batching engine without HTTP: per-slot equality with single-request generation
as requests join and leave, per-row sampling, cancellation, shutdown, and no recompiles."""

from __future__ import annotations

import queue
import threading

import pytest

from genfast.llm.generate import Generator
from genfast.llm.sampling import SamplingParams
from genfast.serve.engine import Delta, Engine, EngineStopped, Finished, GenerationRequest
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


def test_sampled_neighbours_leave_greedy_rows_alone(tiny_dir):
    want = single_request_outputs(*load_tiny(tiny_dir), PROMPTS[:2], [16, 16])
    engine = Engine(*load_tiny(tiny_dir), max_batch=4, compile=False).start()
    hot = SamplingParams(temperature=1.5, top_p=0.95)
    requests = [GenerationRequest(tuple(PROMPTS[0]), 16), GenerationRequest(tuple(PROMPTS[3]), 16, hot, seed=1),
                GenerationRequest(tuple(PROMPTS[1]), 16), GenerationRequest(tuple(PROMPTS[3]), 16, hot, seed=1)]
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
    for request, message in [(GenerationRequest((), 4), "empty"), (GenerationRequest((1,), 0), "max_tokens"),
                             (GenerationRequest((1,) * 60, 8), "context holds 64"),
                             (GenerationRequest((1, 99999), 4), "token ids")]:
        with pytest.raises(UserError, match=message):
            engine.submit(request, lambda e: None)
    assert engine.stats().queued == 0
