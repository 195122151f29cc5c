"""Prometheus metrics of a server (``GET /metrics``, text format).

Counters of requests (by endpoint and HTTP status), finished generations (by
finish reason), prompt and generated tokens, decoding time, drafted and
accepted tokens, prefix-cache hits and misses; gauges of the queue depth,
the requests in flight and the slots (``--parallel``), the last
generation's tokens/s, the acceptance rate so far and the saved prefixes'
size; a histogram of the time to first token.  Each server has a registry of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from forerun.decoding.stats import acceptance_rate
from forerun.generation.result import GenerationResult


class Metrics:
    """The server's metrics.  ``queue_depth`` and ``in_flight`` are read when
    scraped; ``prefix_cache`` is the :class:`~.prefix_cache.PrefixCache`."""

    def __init__(self, *, queue_depth: Callable[[], int], in_flight: Callable[[], int],
                 prefix_cache, slots: int = 1) -> None:
        self._lock = threading.Lock()     # generations end on several slots' threads
        r = self.registry = CollectorRegistry()
        self.requests = Counter("forerun_requests", "HTTP requests answered, by endpoint "
                                "and status", ["endpoint", "status"], registry=r)
        self.generations = Counter("forerun_generations", "Generations that ended, by "
                                   "finish reason (stop, length, cancelled)",
                                   ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("forerun_prompt_tokens", "Prompt tokens of "
                                     "generations", registry=r)
        self.generated_tokens = Counter("forerun_generated_tokens", "Tokens generated",
                                        registry=r)
        self.decode_seconds = Counter("forerun_decode_seconds", "Seconds spent decoding "
                                      "after the prefill (generated_tokens / this = "
                                      "tokens/s)", registry=r)
        self.prefill_seconds = Counter("forerun_prefill_seconds", "Seconds spent on "
                                       "prefills", registry=r)
        self.drafted = Counter("forerun_drafted_tokens", "Tokens drafted by speculative "
                               "decoding", registry=r)
        self.accepted = Counter("forerun_accepted_tokens", "Drafted tokens the model "
                                "accepted", registry=r)
        self._drafted = self._accepted = 0
        self.tokens_per_second = Gauge("forerun_tokens_per_second", "Decoding speed of "
                                       "the last generation", registry=r)
        self.acceptance_rate = Gauge("forerun_acceptance_rate", "Accepted over drafted "
                                     "tokens, since the server started", registry=r)
        self.ttft = Histogram("forerun_time_to_first_token_seconds", "From a request's "
                              "arrival in the queue to its first token",
                              buckets=(.05, .1, .25, .5, 1, 2, 5, 10, 30, 60, 120),
                              registry=r)
        Gauge("forerun_queue_depth", "Requests waiting for the engine",
              registry=r).set_function(queue_depth)
        Gauge("forerun_requests_in_flight", "Requests the engine is running (the slots "
              "busy)", registry=r).set_function(in_flight)
        Gauge("forerun_slots", "Requests the engine decodes together at most (--parallel)",
              registry=r).set(slots)
        r.register(_PrefixCacheCollector(prefix_cache))

    def observe(self, result: GenerationResult, ttft: float | None) -> None:
        """Count one finished generation (from any thread)."""
        with self._lock:
            self._observe(result, ttft)

    def _observe(self, result: GenerationResult, ttft: float | None) -> None:
        s = result.stats
        self.generations.labels(result.finish_reason).inc()
        self.prompt_tokens.inc(s.prompt_tokens)
        self.generated_tokens.inc(s.new_tokens)
        self.decode_seconds.inc(s.decode_seconds)
        self.prefill_seconds.inc(s.prefill_seconds)
        if s.new_tokens and s.decode_seconds > 0:
            self.tokens_per_second.set(s.tokens_per_second)
        if s.drafted:
            self.drafted.inc(s.drafted)
            self.accepted.inc(s.accepted)
            self._drafted += s.drafted
            self._accepted += s.accepted
            self.acceptance_rate.set(acceptance_rate(self._accepted, self._drafted) or 0.0)
        if ttft is not None:
            self.ttft.observe(ttft)

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _PrefixCacheCollector(Collector):
    """The prefix cache's own counters, read when scraped."""

    def __init__(self, prefix_cache) -> None:
        self.pc = prefix_cache

    def collect(self):
        pc = self.pc
        hits = CounterMetricFamily("forerun_prefix_cache_hits", "Requests whose prefill "
                                   "reused a cached prefix, by source (the live cache or a "
                                   "saved prefix)", labels=["source"])
        for source, count in sorted(pc.hits.items()):
            hits.add_metric([source], count)
        yield hits
        yield CounterMetricFamily("forerun_prefix_cache_misses", "Requests that reused no "
                                  "cached prefix", value=pc.misses)
        yield CounterMetricFamily("forerun_prefix_cache_reused_tokens", "Prompt tokens not "
                                  "prefilled thanks to the prefix cache",
                                  value=pc.reused_tokens)
        yield GaugeMetricFamily("forerun_prefix_cache_bytes", "Bytes held by saved prefixes",
                                value=pc.bytes)
        yield GaugeMetricFamily("forerun_prefix_cache_limit_bytes", "The bound on the saved "
                                "prefixes' bytes (--prefix-cache-mb)", value=pc.limit_bytes)
        yield GaugeMetricFamily("forerun_prefix_cache_entries", "Saved prefixes",
                                value=pc.entries)
