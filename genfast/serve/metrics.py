"""Prometheus metrics of a serving engine, for GET /metrics (prometheus_client's text format).

Counted as requests run (the engine calls the `EngineObserver` methods from its thread):
finished requests by finish reason, prompt and generated tokens, time to first token,
inter-token latency and request duration. Read from the engine when scraped: running and
waiting requests, decode steps, the KV cache in use (tokens held over the slots' capacity),
prefix reuse (prompt tokens found in a slot's row or the prefix cache, and their share of all
prompt tokens) and the prefix cache's memory, budget and evictions.
Each app has its own registry, so several engines in one process (tests) never share counters.

The queue, running requests and KV-cache use also go out under vLLM's names
(`vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, and
`vllm:cache_config_info` with the prefix cache's block size): the names the Gateway API Inference
Extension's endpoint picker and llm-d scrape by default (their model server protocol), so a genfast
replica behind them needs no metric-name flags (docs/serving.md, "Behind a gateway").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from genfast.serve.prefix_cache import BLOCK_SIZE

if TYPE_CHECKING:
    from genfast.serve.engine import Engine

# Seconds. Decode steps take ~5-100 ms on a CPU; a first token waits for its prefill (and queue).
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
FIRST_TOKEN_BUCKETS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0)
DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServeMetrics:
    """The engine's observer and the registry /metrics renders."""

    def __init__(self, engine: Callable[[], Engine | None]) -> None:
        """`engine`: the engine served now, None while it loads (the gauges read from it are then left out)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("genfast_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("genfast_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("genfast_generation_tokens", "Tokens generated", registry=r)
        self.first_token = Histogram(
            "genfast_time_to_first_token_seconds", "From submission to the first generated token",
            buckets=FIRST_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.inter_token = Histogram(
            "genfast_inter_token_latency_seconds", "Between a request's consecutive tokens",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.duration = Histogram(
            "genfast_request_duration_seconds", "From submission to the last token (finished requests)",
            buckets=DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        r.register(_EngineState(engine))

    # EngineObserver: called on the engine's thread.
    def on_first_token(self, seconds: float) -> None:
        self.first_token.observe(seconds)
        self.generation_tokens.inc()

    def on_token(self, seconds: float) -> None:
        self.inter_token.observe(seconds)
        self.generation_tokens.inc()

    def on_finished(self, finish_reason: str, prompt_tokens: int, seconds: float) -> None:
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        if finish_reason in ("stop", "length"):
            self.duration.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineState(Collector):
    """Gauges read from the engine at scrape time (none while it loads)."""

    def __init__(self, engine: Callable[[], Engine | None]) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        engine = self.engine()
        if engine is None:
            return
        stats = engine.stats()
        yield GaugeMetricFamily("genfast_requests_running", "Requests in a KV-cache slot", value=stats.active)
        yield GaugeMetricFamily("genfast_requests_waiting", "Requests queued for a slot", value=stats.queued)
        yield GaugeMetricFamily("genfast_slots", "KV-cache slots (the largest decode batch)", value=stats.slots)
        capacity = stats.slots * stats.max_seq_len
        usage = stats.cached_tokens / capacity
        yield GaugeMetricFamily(
            "genfast_kv_cache_usage_ratio", "Tokens held in the KV cache over its capacity (slots x context)",
            value=usage,
        )  # fmt: skip
        # The model server protocol's gauges, under the names its scrapers look for (see above).
        yield GaugeMetricFamily("vllm:num_requests_waiting", "Requests queued for a slot", value=stats.queued)
        yield GaugeMetricFamily("vllm:num_requests_running", "Requests in a KV-cache slot", value=stats.active)
        yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache use, 1 = full (genfast_kv_cache_usage_ratio)",
                                value=usage)  # fmt: skip
        config = GaugeMetricFamily(
            "vllm:cache_config_info", "The KV cache's layout: prefix blocks of block_size tokens",
            labels=["block_size", "num_gpu_blocks"],
        )  # fmt: skip
        config.add_metric([str(BLOCK_SIZE), str(capacity // BLOCK_SIZE)], 1.0)
        yield config
        yield CounterMetricFamily("genfast_decode_steps", "Batched decode steps run", value=stats.decode_steps)
        yield CounterMetricFamily(
            "genfast_prompt_tokens_cached", "Prompt tokens found in the cache (not prefilled)",
            value=stats.reused_prompt_tokens,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "genfast_prefix_cache_hit_ratio", "Prompt tokens found in the cache over all prompt tokens prefilled",
            value=stats.reused_prompt_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "genfast_prefix_cache_bytes", "Memory held by the prefix cache's blocks", value=stats.prefix_cache_bytes
        )
        yield GaugeMetricFamily(
            "genfast_prefix_cache_budget_bytes", "The prefix cache's memory budget (0: none)",
            value=stats.prefix_cache_budget,
        )  # fmt: skip
        yield CounterMetricFamily(
            "genfast_prefix_cache_evicted_blocks", "Prefix-cache blocks evicted to make room",
            value=stats.prefix_cache_evicted,
        )  # fmt: skip
