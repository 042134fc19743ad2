"""SGLang's metric families (``sglang:...``, labelled ``model_name``) beside radixserve's own, so a Grafana dashboard
built for SGLang (its examples/monitoring dashboard: request latency, TTFT, running and queued requests, generation
throughput, cache hit rate, all selected by ``model_name``) shows a radixserve server unchanged.

Fed by ``Metrics`` (metrics.py) at the same events as radixserve's own families, never twice from the handlers.
What each means here:

- ``num_running_reqs`` / ``num_queue_reqs``: requests holding KV / waiting for admission (all --dp replicas);
- ``num_used_tokens``: KV slots held by requests (not free, not an evictable cached prefix);
  ``token_usage``: that over the pool's size;
- ``cache_hit_rate``: cached / prompt tokens of every finished request;
- ``gen_throughput``: generated tokens per second over the last ``THROUGHPUT_WINDOW_S`` seconds;
- counters ``prompt_tokens_total``, ``generation_tokens_total``, ``cached_tokens_total``, ``num_requests_total``;
- histograms ``time_to_first_token_seconds``, ``inter_token_latency_seconds``, ``e2e_request_latency_seconds``,
  ``time_per_output_token_seconds`` (a request's decode time over its tokens after the first, at its end).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# SGLang's own bucket edges, so its dashboards' heatmaps line up
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0,
                20.0, 25.0, 30.0)
E2E_BUCKETS = (0.1, 0.25, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5)
THROUGHPUT_WINDOW_S = 10.0


class SGLangFamilies:
    def __init__(self, registry: CollectorRegistry, model_name: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        r, label = registry, ["model_name"]
        self.clock = clock

        def gauge(name: str, what: str) -> Gauge:
            return Gauge(f"sglang:{name}", what, label, registry=r).labels(model_name)

        def counter(name: str, what: str) -> Counter:
            return Counter(f"sglang:{name}", what, label, registry=r).labels(model_name)

        def histogram(name: str, what: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"sglang:{name}", what, label, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_running_reqs", "The number of running requests")
        self.queued = gauge("num_queue_reqs", "The number of requests in the waiting queue")
        self.used_tokens = gauge("num_used_tokens", "The number of used tokens")
        self.token_usage = gauge("token_usage", "The token usage")
        self.hit_rate = gauge("cache_hit_rate", "The cache hit rate")
        self.throughput = gauge("gen_throughput", "The generate throughput (token/s)")
        self.throughput.set_function(self._throughput)
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("cached_tokens", "Number of cached prompt tokens.")
        self.requests = counter("num_requests", "Number of finished requests.")
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                             E2E_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Histogram of time per output token in seconds.",
                              TOKEN_BUCKETS)
        self._generated: deque[tuple[float, int]] = deque()  # (when, tokens) within the throughput window

    def tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)
        now = self.clock()
        self._generated.append((now, n))
        self._forget(now)

    def _forget(self, now: float) -> None:
        while self._generated and now - self._generated[0][0] > THROUGHPUT_WINDOW_S:
            self._generated.popleft()

    def _throughput(self) -> float:
        self._forget(self.clock())
        return sum(n for _, n in self._generated) / THROUGHPUT_WINDOW_S

    def finished(self, prompt: int, cached: int, e2e: float, ttft: float | None, output_tokens: int,
                 hit_rate: float) -> None:
        self.requests.inc()
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.e2e.observe(e2e)
        self.hit_rate.set(hit_rate)
        if ttft is not None and output_tokens > 1:
            self.tpot.observe((e2e - ttft) / (output_tokens - 1))

    def status(self, running: int, queued: int, used: int, capacity: int) -> None:
        self.running.set(running)
        self.queued.set(queued)
        self.used_tokens.set(used)
        self.token_usage.set(used / capacity if capacity else 0.0)
