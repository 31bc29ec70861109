"""`genfast serve` over real HTTP with the official openai client, on a tiny random model (eager)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading
import time

import openai
import pytest

from genfast.llm.decoding.generate import Generator
from tests.serve.conftest import load_tiny, wait_until, words

PROMPT = words(5, 17, 3, 99, 42)


@pytest.fixture
def reference(tiny_dir):
    """Single-request greedy output of `Generator.generate` (what `genfast generate` runs)."""
    model, tok = load_tiny(tiny_dir)
    gen = Generator(model, tok, max_seq_len=1024, compile=False)

    def complete(prompt: str, n: int):
        return gen.generate([gen.encode_prompt(prompt)], n)

    complete.tokenizer = tok
    return complete


def test_models_and_health(serve):
    server = serve(max_batch=2)
    models = server.client().models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].owned_by == "genfast"
    status, health = request(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["slots"] == 2 and health["active"] == 0


def test_ready_until_draining(serve):
    """/ready: 200 while serving; 503 "draining" once shutting down, while in-flight requests
    finish (a load balancer then sends no more), as /health's status says."""
    server = serve(max_batch=2)
    assert request(server, "GET", "/ready") == (200, {"status": "ready"})
    stream, _ = long_stream(server, max_tokens=900)
    drain = threading.Thread(target=server.engine.shutdown, args=(120,))
    try:
        assert wait_until(lambda: server.engine.stats().active == 1)
        drain.start()
        assert wait_until(lambda: server.engine.stopping)
        assert request(server, "GET", "/ready") == (503, {"status": "draining"})
        status, health = request(server, "GET", "/health")
        assert status == 503 and health["status"] == "shutting_down" and health["active"] == 1
    finally:
        stream.close()  # cancelled: the engine is idle and the drain ends
        if drain.is_alive():
            drain.join(timeout=60)


def test_completions_greedy_equal_single_request_generate(serve, reference):
    client = serve(max_batch=4).client()
    want = reference(PROMPT, 24)
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.texts[0]
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == 5 and got.usage.completion_tokens == 24 and got.usage.total_tokens == 29
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.texts[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices
    # Token ids in, as OpenAI allows.
    ids = reference.tokenizer.encode(PROMPT)
    assert (
        client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0).choices[0].text
        == want.texts[0]
    )


def test_chat_applies_the_template_streamed_or_not(serve, reference):
    client = serve(max_batch=2).client()
    messages = [{"role": "system", "content": words(7)}, {"role": "user", "content": words(8, 9)}]
    want = reference(reference.tokenizer.apply_chat_template(messages), 12)
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.texts[0]
    assert got.usage.prompt_tokens == want.prompt_tokens and got.usage.completion_tokens == 12
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=12, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.texts[0]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_strings_and_max_tokens(serve, reference):
    client = serve(max_batch=2).client()
    free = reference(PROMPT, 16).texts[0]
    stop = " ".join(free.split(" ")[4:6])
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "w999"])
    assert got.choices[0].text == free[: free.find(stop)] and got.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True
        )
    )
    assert streamed == free[: free.find(stop)]
    short = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


def test_seed_makes_sampling_reproducible(serve):
    client = serve(max_batch=4).client()

    def sample(seed: int) -> str:
        return (
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0, top_p=0.9, seed=seed)
            .choices[0]
            .text
        )

    first = sample(7)
    assert sample(7) == first
    # While other requests share the batch, the seeded row still draws the same tokens.
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(sample, [7, 8, 7, 9]))
    assert results[0] == results[2] == first
    assert len({first, results[1], results[3]}) > 1


@pytest.mark.parametrize(
    "body,message",
    [
        ('{"model": "tiny", "prompt": "w1", ', "not valid JSON"),
        ({"model": "tiny", "prompt": "w1", "max_tokens": "ten"}, "max_tokens"),
        ({"model": "tiny", "prompt": 5}, "prompt"),
        ({"model": "tiny", "prompt": "w1", "temprature": 0.5}, "temprature"),
        ({"model": "tiny", "prompt": "w1", "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "prompt": "w1", "max_tokens": 5000}, "context holds 1024"),
        ({"model": "tiny", "prompt": " ".join(["w1"] * 1100)}, "context holds 1024"),
        ({"model": "tiny", "prompt": "w1", "n": 2}, "n"),
        ({"model": "tiny", "prompt": "w1", "temperature": 3}, "temperature"),
        ({"model": "tiny", "prompt": "w1", "presence_penalty": 0.5}, "not supported"),
        ({"model": "tiny", "prompt": ["w1", "w2"]}, "one prompt per request"),
        ({"model": "tiny", "prompt": ""}, "empty"),
        ({"model": "tiny", "prompt": [1, 5000]}, "token ids"),
        ({"model": "gpt-4", "prompt": "w1"}, "does not exist"),
        ({"model": "tiny", "prompt": "w1", "logprobs": 21}, "logprobs"),
        ({"model": "tiny", "prompt": "w1", "temperature": 1, "seed": 2**64}, "seed"),  # torch takes 64 bits
    ],
)
def test_bad_requests_get_openai_errors(serve, body, message):
    server = serve(max_batch=1)
    status, answer = request(server, "POST", "/v1/completions", body)
    assert status == (404 if "gpt-4" in str(body) else 400), answer
    error = answer["error"]
    assert message in error["message"] and error["type"] and "code" in error and "param" in error
    assert server.engine.stats().active == 0


def test_bad_chat_requests(serve):
    client = serve(max_batch=1).client()
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "w1"}])
    with pytest.raises(openai.NotFoundError):
        client.with_options(base_url=client.base_url.join("/nothing")).models.list()
    one = [{"role": "user", "content": "w1"}]
    with pytest.raises(openai.BadRequestError, match="top_logprobs: Input should be less than or equal to 20"):
        client.chat.completions.create(model="tiny", messages=one, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model="tiny", messages=one, top_logprobs=2)


def test_api_key(serve):
    server = serve(max_batch=1, api_key="sekrit")
    with pytest.raises(openai.AuthenticationError, match="API key"):
        server.client("wrong").models.list()
    assert request(server, "POST", "/v1/completions", {"model": "tiny", "prompt": "w1"})[0] == 401
    assert (
        server.client("sekrit").completions.create(model="tiny", prompt="w1", max_tokens=2).usage.completion_tokens == 2
    )
    assert request(server, "GET", "/health")[0] == 200  # probes need no key
    assert "genfast_slots" in scrape(server)  # nor does Prometheus


def request(
    server, method: str, path: str, body: dict | str | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict]:
    """A raw HTTP request (no client-side validation): status and JSON answer."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    content = body if isinstance(body, str | None) else json.dumps(body)
    conn.request(method, path, body=content, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    try:
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def long_stream(server, max_tokens: int = 1000) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """Open a streamed completion that runs for a long while and read its first event; closing
    the returned connection is a client disconnect."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        headers={"Content-Type": "application/json"},
        body=json.dumps(
            {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        ),
    )
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: {")
    return conn, response


def test_full_queue_answers_429_and_memory_stays_bounded(serve):
    server = serve(max_batch=1, max_queue=1)
    running, _ = long_stream(server)  # takes the only slot
    client = server.client()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        queued = pool.submit(client.completions.create, model="tiny", prompt=PROMPT, max_tokens=2)
        assert wait_until(lambda: server.engine.stats().queued == 1)
        with pytest.raises(openai.RateLimitError, match="retry later"):
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
        running.close()  # the slot frees, the queued request runs
        assert queued.result(timeout=30).usage.completion_tokens == 2


def test_client_disconnect_cancels_and_frees_the_slot(serve):
    server = serve(max_batch=2)
    conn, _ = long_stream(server)
    assert server.engine.stats().active == 1
    conn.close()
    assert wait_until(lambda: server.engine.stats().active == 0, timeout=5)
    stats = server.engine.stats()
    assert stats.cancelled == 1 and stats.generated_tokens < 1000


def test_client_leaving_a_non_streamed_request_cancels_it(serve):
    server = serve(max_batch=2)
    step = server.engine._step

    def slow_step() -> None:  # 1000 tokens must outlast the disconnect's detection, however fast a step
        time.sleep(0.005)
        step()

    server.engine._step = slow_step
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        headers={"Content-Type": "application/json"},
        body=json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 1000, "temperature": 0}),
    )
    assert wait_until(lambda: server.engine.stats().generated_tokens > 0)
    conn.close()
    assert wait_until(lambda: server.engine.stats().active == 0, timeout=5)
    assert server.engine.stats().cancelled == 1


def test_16_concurrent_streams_equal_their_single_request_outputs(serve, reference):
    server = serve(max_batch=8, max_queue=16)
    prompts = [words(*range(i, i + 2 + i % 7)) for i in range(16)]
    want = [reference(p, 64).texts[0] for p in prompts]
    client = server.client()

    def stream(prompt: str) -> tuple[str, str | None]:
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=64, temperature=0, stream=True))
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(stream, prompts))
    assert [text for text, _ in got] == want
    assert all(reason == "length" for _, reason in got)
    stats = server.engine.stats()
    assert stats.generated_tokens == 16 * 64 and stats.active == stats.queued == 0
    assert stats.decode_steps < 16 * 63  # the requests shared decode steps


def scrape(server) -> dict[str, float]:
    """GET /metrics parsed as Prometheus text: sample name (with labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/plain")
    text = response.read().decode()
    conn.close()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def test_metrics_parse_as_prometheus_text_and_move_as_requests_run(serve):
    server = serve(max_batch=2)
    before = scrape(server)
    assert before["genfast_requests_running"] == 0 and before["genfast_slots"] == 2
    assert before["genfast_generation_tokens_total"] == 0 and before["genfast_kv_cache_usage_ratio"] == 0
    # The model server protocol's gauges under vLLM's names (the gateway's endpoint picker scrapes them).
    assert before["vllm:num_requests_running"] == before["vllm:num_requests_waiting"] == 0
    assert before["vllm:kv_cache_usage_perc"] == 0
    [layout] = [key for key in before if key.startswith("vllm:cache_config_info")]
    assert layout == f"vllm:cache_config_info{{block_size=16,num_gpu_blocks={2 * server.engine.max_seq_len // 16}}}"
    client = server.client()
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    for _ in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, stream=True):
        pass
    stream, _ = long_stream(server, max_tokens=900)  # running while scraped
    try:
        assert wait_until(lambda: scrape(server)["genfast_requests_running"] == 1)
        during = scrape(server)
        assert 0 < during["genfast_kv_cache_usage_ratio"] <= 1
        assert during["vllm:kv_cache_usage_perc"] == during["genfast_kv_cache_usage_ratio"]
        assert during["vllm:num_requests_running"] == 1
    finally:
        stream.close()
    assert wait_until(lambda: scrape(server).get("genfast_requests_total{finish_reason=cancelled}") == 1)
    after = scrape(server)
    assert after["genfast_requests_total{finish_reason=length}"] == 2
    assert after["genfast_prompt_tokens_total"] >= 2 * 5
    assert after["genfast_time_to_first_token_seconds_count"] == 3  # the cancelled one had its first token
    assert after["genfast_inter_token_latency_seconds_count"] == after["genfast_generation_tokens_total"] - 3
    assert after["genfast_request_duration_seconds_count"] == 2 and after["genfast_decode_steps_total"] > 0


def model_log_softmax(tiny_dir, prompt_ids: list[int], generated: list[int], temperature: float = 1.0):
    """log-softmax of the eager model's logits (over temperature) before each generated token."""
    import torch

    model, _ = load_tiny(tiny_dir)
    ids = torch.tensor([prompt_ids + generated])
    with torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1]), all_logits=True)[0, len(prompt_ids) - 1 : -1]
    return (logits / temperature).log_softmax(-1)


def test_logprobs_are_the_log_softmax_of_the_models_logits(serve, reference, tiny_dir):
    """Greedy: each token's logprob and its top alternatives are the model's log-softmax; the
    same in both APIs' shapes, streamed or not; sampled: under the temperature-scaled distribution."""
    tok = reference.tokenizer
    want_ids = reference(PROMPT, 8).token_ids[0]
    expected = model_log_softmax(tiny_dir, tok.encode(PROMPT), want_ids)
    client = serve(max_batch=2).client()

    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    lp = done.choices[0].logprobs
    assert [tok.encode(t) for t in lp.tokens] == [[i] for i in want_ids]
    assert "".join(lp.tokens) == done.choices[0].text and lp.text_offset[0] == 0
    for row, token, logprob, top in zip(expected, want_ids, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert abs(logprob - float(row[token])) < 1e-4
        values, ids = row.topk(3)
        assert [tok.encode(t) for t in top] == [[int(i)] for i in ids]  # most likely first
        assert all(abs(a - float(b)) < 1e-4 for a, b in zip(top.values(), values, strict=True))
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                           stream=True)
        if c.choices[0].logprobs is not None
    ]  # fmt: skip
    streamed_logprobs = [x for c in streamed for x in c.token_logprobs]
    assert all(abs(a - b) < 1e-4 for a, b in zip(streamed_logprobs, lp.token_logprobs, strict=True))
    assert [x for c in streamed for x in c.text_offset] == lp.text_offset

    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob  # greedy: the argmax
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob and c.bytes == list(c.token.encode())
    chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)  # fmt: skip
    streamed_chat = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # The same tokens; the values within rounding (this request reuses the first one's cached prompt).
    assert [c.token for c in streamed_chat] == [c.token for c in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed_chat, content, strict=True))
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None

    sampled = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.7, seed=3, logprobs=0)
    tokens = [tok.encode(t)[0] for t in sampled.choices[0].logprobs.tokens]
    scaled = model_log_softmax(tiny_dir, tok.encode(PROMPT), tokens, temperature=0.7)
    got = sampled.choices[0].logprobs.token_logprobs
    assert all(abs(g - float(row[t])) < 1e-4 for g, row, t in zip(got, scaled, tokens, strict=True))
    assert sampled.choices[0].logprobs.top_logprobs == [{}] * 8


def test_a_conversation_resent_with_a_new_turn_reports_its_cached_tokens(serve, reference):
    server = serve(max_batch=2)
    client = server.client()
    messages = [{"role": "system", "content": words(*range(10, 90))}, {"role": "user", "content": PROMPT}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": words(7, 8, 9)}]  # fmt: skip
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # At least the first prompt (this tiny template puts a word before the reply, a real one the
    # same header the first prompt ended with).
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    tok = reference.tokenizer  # greedy tokens as without the cache
    want = reference(tok.apply_chat_template(messages), 8)
    assert second.choices[0].message.content == want.texts[0]
    metrics = scrape(server)
    assert metrics["genfast_prompt_tokens_cached_total"] == cached
    total = first.usage.prompt_tokens + second.usage.prompt_tokens
    assert abs(metrics["genfast_prefix_cache_hit_ratio"] - cached / total) < 1e-9


def test_a_client_sharing_a_system_prompt_with_a_running_one_reuses_its_blocks(serve, reference):
    """Two clients with one system prompt: the second arrives while the first still streams in
    the other slot, so its own row holds nothing; it copies the shared prefix from the blocks the
    first stored after its prefill (whole 16-token blocks of its prompt), says so in its usage,
    and replies as without the cache."""
    server = serve(max_batch=2, prefix_block=16)
    client = server.client()
    system = {"role": "system", "content": words(*range(10, 90))}
    first = [system, {"role": "user", "content": PROMPT}]
    second = [system, {"role": "user", "content": words(7, 8, 9)}]
    stream = client.chat.completions.create(model="tiny", messages=first, max_tokens=600, temperature=0, stream=True)
    try:
        # The first client is decoding once text comes; the role chunk before it comes before the
        # prefill (under load the second request then prefilled before the first stored its prompt).
        next(chunk for chunk in stream if chunk.choices and chunk.choices[0].delta.content)
        reply = client.chat.completions.create(model="tiny", messages=second, max_tokens=8, temperature=0)
        assert scrape(server)["genfast_requests_running"] == 1
    finally:
        stream.close()
    tok = reference.tokenizer
    text = tok.apply_chat_template(second)
    a, b = tok.encode(tok.apply_chat_template(first)), tok.encode(text)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common > 64 and reply.usage.prompt_tokens_details.cached_tokens == min(common, len(a) // 16 * 16)
    assert reply.choices[0].message.content == reference(text, 8).texts[0]
    metrics = scrape(server)
    assert 0 < metrics["genfast_prefix_cache_bytes"] <= metrics["genfast_prefix_cache_budget_bytes"]


def test_a_small_prefix_cache_evicts_and_what_is_left_is_still_reused(serve, reference, tiny_dir):
    """A prefix cache of four 16-token blocks and one slot: conversation A stores three blocks,
    B's three evict A's last two, so A resent finds only its first block (its row holds B) and
    replies as without the cache; /metrics counts the evictions."""
    from genfast.serve.engine import Engine

    args = Engine(*load_tiny(tiny_dir), compile=False, max_seq_len=64).model.args
    block = args.n_layers * 2 * args.n_kv_heads * 16 * args.head_dim * 4  # fp32 keys and values
    server = serve(max_batch=1, prefix_block=16, prefix_cache_mib=4 * block / 2**20)
    client = server.client()

    def chat(first_word: int):
        messages = [{"role": "system", "content": words(*range(first_word, first_word + 48))},
                    {"role": "user", "content": PROMPT}]  # fmt: skip
        return messages, client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)

    _, a = chat(10)
    _, b = chat(100)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert b.usage.prompt_tokens_details.cached_tokens == 1  # the role word A's row began with too
    metrics = scrape(server)
    assert metrics["genfast_prefix_cache_evicted_blocks_total"] == 2
    assert metrics["genfast_prefix_cache_bytes"] == metrics["genfast_prefix_cache_budget_bytes"] == 4 * block
    messages, again = chat(10)
    assert again.usage.prompt_tokens_details.cached_tokens == 16
    text = reference.tokenizer.apply_chat_template(messages)
    assert again.choices[0].message.content == a.choices[0].message.content == reference(text, 8).texts[0]
