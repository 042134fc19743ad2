"""Prometheus metrics of the api process (prometheus_client), in a registry of its own (no globals): radixserve's
families, and SGLang's beside them (sglang_metrics.py) for dashboards built for SGLang."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixserve.actors.api.sglang_metrics import SGLangFamilies
from radixserve.wire.messages import Status

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, model_name: str = "default") -> None:
        """``model_name``: the label of SGLang's families (the first served model name)."""
        r = self.registry = CollectorRegistry()
        self.sglang = SGLangFamilies(r, model_name)
        self.requests = Counter("radixserve_requests", "finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("radixserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("radixserve_cached_tokens", "prompt tokens reused from the radix cache",
                                     registry=r)
        self.generation_tokens = Counter("radixserve_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram("radixserve_time_to_first_token_seconds", "time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("radixserve_inter_token_latency_seconds", "time between streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("radixserve_e2e_request_latency_seconds", "request latency, arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.hit_rate = Gauge("radixserve_cache_hit_rate", "cached / prompt tokens, all finished requests",
                              registry=r)
        self.hit_rate.set_function(lambda: self._cached_total / self._prompt_total if self._prompt_total else 0.0)
        self._prompt_total = self._cached_total = 0
        self.running = Gauge("radixserve_num_running_requests", "requests holding KV (decoding or mid-prefill)",
                             registry=r)
        self.queued = Gauge("radixserve_num_queued_requests", "requests waiting for admission", registry=r)
        self.kv_usage = Gauge("radixserve_kv_pool_usage", "fraction of KV slots not free (cached + in use)",
                              registry=r)
        self.kv_tokens = Gauge("radixserve_kv_pool_tokens", "KV slots by state", ["state"], registry=r)
        self.rejections = Counter("radixserve_rejected_requests", "requests refused or failed, by reason (the "
                                  "error code: queue_full, too_many_sequences, draining, queue_timeout, "
                                  "rid_in_use, internal_error, invalid_request_error, ...)", ["reason"], registry=r)
        self.retractions = Gauge("radixserve_retractions", "requests retracted since start", registry=r)
        self.evicted = Gauge("radixserve_evicted_tokens", "cached tokens evicted since start", registry=r)
        labels = ["eviction", "schedule"]  # one series per policy pair; its last epoch's figures
        self.policy_requests = Gauge("radixserve_policy_requests", "requests finished under the policies",
                                     labels, registry=r)
        self.policy_prompt = Gauge("radixserve_policy_prompt_tokens", "prompt tokens under the policies", labels,
                                   registry=r)
        self.policy_cached = Gauge("radixserve_policy_cached_tokens", "cached tokens under the policies", labels,
                                   registry=r)
        self.policy_hit_rate = Gauge("radixserve_policy_cache_hit_rate", "hit rate under the policies", labels,
                                     registry=r)
        self.policy_evicted = Gauge("radixserve_policy_evicted_tokens", "tokens evicted under the policies",
                                    labels, registry=r)

    def shadow(self, report: dict) -> None:
        """--shadow-policies: each shadow pair's windowed figures, labelled by pair."""
        if not hasattr(self, "shadow_gauges"):
            r, labels = self.registry, ["eviction", "schedule"]
            self.shadow_gauges = {
                key: Gauge(f"radixserve_shadow_{name}", what, labels, registry=r) for key, name, what in (
                    ("hit_rate", "cache_hit_rate", "hit rate the pair would have had, over the shadow window"),
                    ("evicted_tokens", "evicted_tokens", "tokens the pair would have evicted in the window"),
                    ("requests", "requests", "requests the pair finished in the window"),
                    ("ttft_p50_s", "ttft_p50_seconds", "the pair's estimated TTFT p50 in the window"),
                    ("ttft_p99_s", "ttft_p99_seconds", "the pair's estimated TTFT p99 in the window"),
                    ("cold_ttft_p99_s", "cold_ttft_p99_seconds", "estimated TTFT p99 of requests with no hit"),
                    ("max_queue_wait_s", "max_queue_wait_seconds", "the longest estimated queue wait"),
                    ("slowest5_ttft_share", "slowest5_ttft_share", "share of all TTFT spent by the slowest 5%"),
                )}
            self.shadow_lag = Gauge("radixserve_shadow_lag_seconds", "how far the shadow trails the live trace",
                                    registry=r)
            self.shadow_switches = Gauge("radixserve_auto_policy_switches", "switches made by --auto-policy",
                                         registry=r)
        for row in report.get("pairs", ()):
            for key, gauge in self.shadow_gauges.items():  # NaN: nothing to measure in the window now
                value = row.get(key)
                gauge.labels(row["eviction"], row["schedule"]).set(float("nan") if value is None else value)
        self.shadow_lag.set(report.get("lag_s", 0.0))
        self.shadow_switches.set(len(report.get("switches", ())))

    def replica_status(self, s: Status) -> None:
        """One --dp replica's own numbers beside the totals."""
        if not hasattr(self, "replica_gauges"):
            r, label = self.registry, ["replica"]
            self.replica_gauges = {
                "running": Gauge("radixserve_replica_num_running_requests", "requests holding KV, per replica",
                                 label, registry=r),
                "waiting": Gauge("radixserve_replica_num_queued_requests", "requests waiting, per replica", label,
                                 registry=r),
                "usage": Gauge("radixserve_replica_kv_pool_usage", "fraction of KV slots not free, per replica",
                               label, registry=r),
                "hit": Gauge("radixserve_replica_cache_hit_rate", "cached / prompt tokens under the current "
                             "policies, per replica", label, registry=r),
            }
        g, i = self.replica_gauges, str(s.replica)
        g["running"].labels(i).set(s.running)
        g["waiting"].labels(i).set(s.waiting)
        g["usage"].labels(i).set(1 - s.free / s.capacity if s.capacity else 0)
        g["hit"].labels(i).set(s.epoch_cached_tokens / s.epoch_prompt_tokens if s.epoch_prompt_tokens else 0.0)

    def ranks(self, by_node: dict[int, list[dict]]) -> None:
        """The tensor-parallel runner ranks up, per node (set once all are ready; the server ends if one dies)."""
        gauge = Gauge("radixserve_tp_ranks", "tensor-parallel runner ranks running, per node", ["node"],
                      registry=self.registry)
        for node, ranks in by_node.items():
            gauge.labels(str(node)).set(len(ranks))

    def first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)
        self.sglang.ttft.observe(ttft)

    def next_tokens(self, gap: float, tokens: int = 1) -> None:
        """``tokens`` more tokens ``gap`` seconds after the last ones: as many inter-token gaps of their mean (a
        run of them came in one delta: a verified draft, or a whole result's tokens held back)."""
        for _ in range(tokens):
            self.itl.observe(gap / tokens)
            self.sglang.itl.observe(gap / tokens)

    def generated(self, tokens: int) -> None:
        self.generation_tokens.inc(tokens)
        self.sglang.tokens(tokens)

    def finished(self, reason: str, prompt: int, cached: int, e2e: float, ttft: float | None = None,
                 output_tokens: int = 0) -> None:
        """A request ended: ``ttft`` (None: no token) and ``output_tokens`` give SGLang's time per output token."""
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self._prompt_total += prompt
        self._cached_total += cached
        self.e2e.observe(e2e)
        self.sglang.finished(prompt, cached, e2e, ttft, output_tokens,
                             self._cached_total / self._prompt_total if self._prompt_total else 0.0)

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def status(self, s: Status) -> None:
        self.sglang.status(s.running, s.waiting, s.capacity - s.free - s.evictable, s.capacity)
        self.running.set(s.running)
        self.queued.set(s.waiting)
        self.kv_usage.set(1 - s.free / s.capacity if s.capacity else 0)
        for state in ("free", "evictable", "protected"):
            self.kv_tokens.labels(state).set(getattr(s, state))
        self.retractions.set(s.retractions)
        self.evicted.set(s.evicted_tokens)
        pair = (s.eviction, s.schedule)
        self.policy_requests.labels(*pair).set(s.epoch_requests)
        self.policy_prompt.labels(*pair).set(s.epoch_prompt_tokens)
        self.policy_cached.labels(*pair).set(s.epoch_cached_tokens)
        self.policy_hit_rate.labels(*pair).set(s.epoch_cached_tokens / s.epoch_prompt_tokens
                                               if s.epoch_prompt_tokens else 0.0)
        self.policy_evicted.labels(*pair).set(s.epoch_evicted_tokens)
        if s.tiers:
            self.tiers(s.tiers)
        if s.speculative:
            self.speculative(s.speculative)

    def speculative(self, info: dict) -> None:
        """--speculative-algorithm: drafts and acceptance, by draft policy (each policy's totals since it was
        switched to)."""
        if not hasattr(self, "spec_gauges"):
            r = self.registry
            self.spec_gauges = {
                "drafted": Gauge("radixserve_speculative_draft_tokens", "draft tokens verified", ["policy"],
                                 registry=r),
                "accepted": Gauge("radixserve_speculative_accepted_tokens", "draft tokens the model agreed with",
                                  ["policy"], registry=r),
                "acceptance_rate": Gauge("radixserve_speculative_acceptance_rate", "accepted / drafted tokens",
                                         ["policy"], registry=r),
                "mean_accepted": Gauge("radixserve_speculative_mean_accepted_length", "draft tokens accepted per "
                                       "verified draft", ["policy"], registry=r),
                "steps": Gauge("radixserve_speculative_verify_steps", "decode steps that verified drafts",
                               ["policy"], registry=r),
            }
        for key, gauge in self.spec_gauges.items():
            gauge.labels(info["draft_policy"]).set(info.get(key, 0.0))

    def tiers(self, t: dict[str, float]) -> None:
        """--enable-hierarchical-cache: per-tier hits, bytes moved, read-back latency, damaged pages."""
        if not hasattr(self, "tier_gauges"):
            r = self.registry
            self.tier_gauges = {
                "hits": Gauge("radixserve_kv_tier_hit_tokens", "prompt tokens reused, by the tier they came from "
                              "(L1 the pool, L2 host memory, L3 storage)", ["tier"], registry=r),
                "rate": Gauge("radixserve_kv_tier_hit_rate", "reused / prompt tokens of admitted requests, by tier",
                              ["tier"], registry=r),
                "bytes": Gauge("radixserve_kv_tier_bytes", "bytes moved to and from storage (L3) since start",
                               ["direction"], registry=r),
                "host": Gauge("radixserve_kv_tier_host_bytes", "bytes of pages held in host memory (L2)", registry=r),
                "load": Gauge("radixserve_kv_tier_load_back_seconds_mean", "mean time from asking for a waiting "
                              "request's pages to having them back", registry=r),
                "damaged": Gauge("radixserve_kv_tier_damaged_pages", "stored pages found damaged (checksum, size, "
                                 "another model's), dropped and recomputed", registry=r),
                "errors": Gauge("radixserve_kv_tier_storage_errors", "storage reads and writes that failed",
                                registry=r),
            }
        g, prompt = self.tier_gauges, t.get("prompt_tokens", 0.0)
        for tier in ("L1", "L2", "L3"):
            g["hits"].labels(tier).set(t.get(f"hit_{tier}", 0.0))
            g["rate"].labels(tier).set(t.get(f"hit_{tier}", 0.0) / prompt if prompt else 0.0)
        g["bytes"].labels("read").set(t.get("l3_bytes_read", 0.0))
        g["bytes"].labels("written").set(t.get("l3_bytes_written", 0.0))
        g["host"].set(t.get("l2_bytes", 0.0))
        answered = t.get("prefetches_answered", 0.0)
        g["load"].set(t.get("prefetch_seconds", 0.0) / answered if answered else 0.0)
        g["damaged"].set(t.get("l3_pages_damaged", 0.0))
        g["errors"].set(t.get("l3_errors", 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
