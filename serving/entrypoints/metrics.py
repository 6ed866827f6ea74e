"""Prometheus metrics of a serving process, on their own registry and HTTP port.

`ServerMetrics` owns the series (all named `hybrid_jax_*`):

  requests_total{finish_reason}      counter: finished requests (stop | length | abort | error)
  requests_rejected_total{code,reason}  counter: calls refused before the engine (gRPC code and
                                     why: invalid, unparsed, too_many_streams, queue_full,
                                     duplicate_id, shutting_down, unauthenticated, no_tokenizer)
  prompt_tokens_total                counter: prompt tokens of accepted requests
  generation_tokens_total            counter: output tokens streamed
  time_to_first_token_seconds        histogram: accept -> first token
  time_per_output_token_seconds      histogram: (last - first token) / (tokens - 1), per request
  e2e_request_latency_seconds        histogram: accept -> last message
  engine_step_seconds                histogram: one engine step (fed by EngineCore.on_step)
  num_requests_running / _waiting    gauges, read from the engine when scraped
  pages_in_use{group} / pages_total{group}, slots_in_use / slots_total   gauges, ditto
  weight_bytes{dtype}                gauge: parameter bytes held per device, by dtype
  with prefix caching on (read from stats() too):
  prefix_cache_hit_tokens_total      counter: prompt tokens not recomputed (cache hits)
  prefix_cache_query_tokens_total    counter: prompt tokens of admissions that looked up the cache
  prefix_cache_hit_rate              gauge: hit / query tokens since start-up
  pages_cached{group}                gauge: idle cached pages (evictable)
  prefix_cache_page_evictions_total{group}, prefix_state_checkpoint_evictions_total   counters
  prefix_state_checkpoints_in_use / _total, prefix_state_checkpoint_bytes   gauges
  with speculative decoding on (stats() too):
  spec_proposed_tokens_total, spec_accepted_tokens_total, spec_verify_steps_total,
  spec_draft_time_seconds_total, spec_verify_time_seconds_total   counters
  spec_acceptance_rate, spec_mean_accepted_length, spec_acceptance_per_position{position}   gauges

Pool gauges are computed at scrape time (a custom collector over `stats()`), so they
are never stale, e.g. right after a cancelled request freed its pages. This module
knows nothing of gRPC; the servicer calls `request_finished` once per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


@dataclass
class RequestTiming:
    """Wall-clock marks of one request (time.monotonic seconds) and its token counts."""

    accepted: float
    prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    output_tokens: int = 0

    def tokens(self, n: int, now: float) -> None:
        """Record `n` new output tokens arriving at `now`."""
        if n and self.first_token is None:
            self.first_token = now
        if n:
            self.last_token = now
        self.output_tokens += n


class _PoolCollector(Collector):
    """Gauges read from the engine's `stats()` at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, object]]):
        self.stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats()
        yield GaugeMetricFamily("hybrid_jax_num_requests_running", "Requests holding a slot",
                                value=s["num_running"])
        yield GaugeMetricFamily("hybrid_jax_num_requests_waiting", "Requests waiting for a slot",
                                value=s["num_waiting"])
        yield GaugeMetricFamily("hybrid_jax_slots_in_use", "State slots in use", value=s["slots_in_use"])
        yield GaugeMetricFamily("hybrid_jax_slots_total", "State slots", value=s["slots_total"])
        for name, key, doc in (("hybrid_jax_pages_in_use", "pages_in_use", "KV pages in use"),
                               ("hybrid_jax_pages_total", "pages_total", "KV pages")):
            g = GaugeMetricFamily(name, f"{doc}, per attention window group", labels=["group"])
            for group, value in s[key].items():
                g.add_metric([group], value)
            yield g
        if "weight_bytes_by_dtype" in s:
            g = GaugeMetricFamily("hybrid_jax_weight_bytes", "Parameter bytes held per device, by dtype",
                                  labels=["dtype"])
            for dtype, value in s["weight_bytes_by_dtype"].items():
                g.add_metric([dtype], value)
            yield g
        if "prefix_cache_hit_tokens" in s:
            yield from _prefix_metrics(s)
        if "spec_proposed_tokens" in s:
            yield from _spec_metrics(s)


def _spec_metrics(s: dict[str, object]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Speculative-decoding series from the engine's stats() (present when it is on)."""
    for name, key, doc in (("spec_proposed_tokens", "spec_proposed_tokens", "Drafted tokens verified"),
                           ("spec_accepted_tokens", "spec_accepted_tokens", "Drafted tokens accepted"),
                           ("spec_verify_steps", "spec_verify_steps", "Verification steps"),
                           ("spec_draft_time_seconds", "spec_draft_time_s", "Seconds spent drafting"),
                           ("spec_verify_time_seconds", "spec_verify_time_s",
                            "Seconds spent in verification steps")):
        yield CounterMetricFamily(f"hybrid_jax_{name}", doc, value=s[key])
    yield GaugeMetricFamily("hybrid_jax_spec_acceptance_rate", "Accepted / proposed drafted tokens",
                            value=s["spec_acceptance_rate"])
    yield GaugeMetricFamily("hybrid_jax_spec_mean_accepted_length",
                            "Tokens emitted per verified sequence (accepted drafts + 1)",
                            value=s["spec_mean_accepted_length"])
    g = GaugeMetricFamily("hybrid_jax_spec_acceptance_per_position",
                          "Acceptance rate of the j-th drafted token", labels=["position"])
    for j, rate in enumerate(s["spec_acceptance_per_position"]):
        g.add_metric([str(j)], rate)
    yield g


def _prefix_metrics(s: dict[str, object]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Prefix-cache series from the engine's stats() (present when caching is on)."""
    yield CounterMetricFamily("hybrid_jax_prefix_cache_hit_tokens", "Prompt tokens not recomputed",
                              value=s["prefix_cache_hit_tokens"])
    yield CounterMetricFamily("hybrid_jax_prefix_cache_query_tokens",
                              "Prompt tokens of admissions that looked up the prefix cache",
                              value=s["prefix_cache_query_tokens"])
    yield GaugeMetricFamily("hybrid_jax_prefix_cache_hit_rate", "Hit tokens / query tokens",
                            value=s["prefix_cache_hit_rate"])
    for name, key, doc, family in (
            ("hybrid_jax_pages_cached", "pages_cached", "Idle cached KV pages", GaugeMetricFamily),
            ("hybrid_jax_prefix_cache_page_evictions", "prefix_cache_page_evictions",
             "Cached KV pages evicted", CounterMetricFamily)):
        m = family(name, f"{doc}, per attention window group", labels=["group"])
        for group, value in s[key].items():
            m.add_metric([group], value)
        yield m
    yield CounterMetricFamily("hybrid_jax_prefix_state_checkpoint_evictions", "State checkpoints evicted",
                              value=s["prefix_state_checkpoint_evictions"])
    for key, doc in (("prefix_state_checkpoints_in_use", "State checkpoints cached or being written"),
                     ("prefix_state_checkpoints_total", "State checkpoints in the pool"),
                     ("prefix_state_checkpoint_bytes", "Bytes of the state checkpoint pool")):
        yield GaugeMetricFamily(f"hybrid_jax_{key}", doc, value=s[key])


class ServerMetrics:
    """The serving series on a private registry (several servers may live in one process)."""

    def __init__(self, stats: Callable[[], dict[str, object]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("hybrid_jax_requests", "Finished requests", ["finish_reason"], registry=r)
        self.rejected = Counter("hybrid_jax_requests_rejected", "Calls refused before the engine",
                                ["code", "reason"], registry=r)
        self.prompt_tokens = Counter("hybrid_jax_prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=r)
        self.generation_tokens = Counter("hybrid_jax_generation_tokens", "Output tokens streamed",
                                         registry=r)
        self.ttft = Histogram("hybrid_jax_time_to_first_token_seconds", "Accept to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("hybrid_jax_time_per_output_token_seconds",
                              "Mean gap between output tokens of a request", buckets=TOKEN_BUCKETS,
                              registry=r)
        self.e2e = Histogram("hybrid_jax_e2e_request_latency_seconds", "Accept to last message",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.step = Histogram("hybrid_jax_engine_step_seconds", "One engine step", buckets=STEP_BUCKETS,
                              registry=r)
        r.register(_PoolCollector(stats))
        for reason in ("stop", "length", "abort", "error"):  # expose zeros before the first request
            self.requests.labels(reason)
        self._http = None

    def on_step(self, deltas: list, seconds: float) -> None:
        """`EngineCore.on_step` callback: observe the step time."""
        self.step.observe(seconds)

    def request_accepted(self, timing: RequestTiming) -> None:
        self.prompt_tokens.inc(timing.prompt_tokens)

    def request_finished(self, timing: RequestTiming, finish_reason: str, now: float) -> None:
        """Count a finished request (any reason) and observe its latencies."""
        self.requests.labels(finish_reason).inc()
        self.e2e.observe(now - timing.accepted)
        if timing.first_token is not None:
            self.ttft.observe(timing.first_token - timing.accepted)
        if timing.output_tokens > 1 and timing.last_token is not None and timing.first_token is not None:
            self.tpot.observe((timing.last_token - timing.first_token) / (timing.output_tokens - 1))

    def start_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on `addr`:`port` (0: any free port); returns the bound port.

        `addr` is a host name or address, IPv6 with or without brackets ("[::]", "::").
        """
        self._http, _ = start_http_server(port, addr=addr.strip("[]"), registry=self.registry)
        return self._http.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
