"""Prometheus metrics of one server: its own CollectorRegistry, never the global one.

Every metric carries vLLM's `model_name` label, so dashboards built for vLLM select it the same
way. Engine-wide numbers (queue lengths, KV blocks, token counters) are read from the engine's
published `EngineStats` at scrape time, so a scrape costs no engine work. Latency histograms are
observed by the server as each request finishes, from the request's own timestamps: the
engine keeps only a rolling window of samples, which cannot back a monotonic histogram.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pjinfer.engine.metrics import EngineStats
from pjinfer.plugins import metrics_collectors
from pjinfer.server.admission import Admission
from pjinfer.server.protocol import Summary

PREFIX = "pjinfer:"
MODEL_LABEL = "model_name"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _EngineCollector(Collector):
    """Turns the latest EngineStats into gauges and counters at each scrape."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str,
                 max_lora: int | None = None):
        self._stats = stats
        self._model_name = model_name
        self._max_lora = max_lora  # None: LoRA off, no lora_requests_info

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = {
            "num_requests_running": ("Requests in the running batch.", s.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled.", s.num_waiting),
            "kv_cache_usage_perc": ("Fraction of KV blocks in use (1 = full).", s.kv_usage),
            "kv_blocks_total": ("KV cache blocks usable by requests.", s.num_kv_blocks),
            "kv_blocks_free": ("KV cache blocks free.", s.num_free_kv_blocks),
            "kv_blocks_used": ("KV cache blocks held by requests or the prefix cache.",
                               s.num_kv_blocks - s.num_free_kv_blocks),
            "prefix_cache_hit_rate": ("Prefix cache hits / queries, in tokens.",
                                      s.prefix_cache_hit_rate),
        }
        yield from self._families(GaugeMetricFamily, gauges)
        counters = {
            "prompt_tokens": ("Prompt tokens computed.", s.num_prompt_tokens),
            "generation_tokens": ("Tokens generated.", s.num_generation_tokens),
            "num_preemptions": ("Requests preempted for lack of KV blocks.", s.num_preemptions),
            "prefix_cache_queries": ("Tokens looked up in the prefix cache.",
                                     s.prefix_cache_queries),
            "prefix_cache_hits": ("Tokens found in the prefix cache.", s.prefix_cache_hits),
            "engine_requests_aborted": ("Requests aborted in the engine.", s.num_aborted),
            "engine_requests_rejected": ("Requests refused because the queue was full.",
                                         s.num_rejected),
        }
        yield from self._families(CounterMetricFamily, counters)
        if self._max_lora is not None:
            yield self._lora_info(s)

    def _lora_info(self, s: EngineStats) -> Metric:
        """vLLM's lora_requests_info: one sample whose labels list the adapters of running
        and waiting requests (comma-separated), its value the scrape time."""
        metric = GaugeMetricFamily(
            PREFIX + "lora_requests_info", "Running stats on LoRA requests.",
            labels=[MODEL_LABEL, "max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        metric.add_metric([self._model_name, str(self._max_lora),
                           ",".join(s.waiting_lora_adapters), ",".join(s.running_lora_adapters)],
                          time.time())
        return metric

    def _families(self, family: type, table: dict[str, tuple[str, float]]) -> Iterator[Metric]:
        """One metric family per (name: (doc, value)), labelled with the model name."""
        for name, (doc, value) in table.items():
            metric = family(PREFIX + name, doc, labels=[MODEL_LABEL])
            metric.add_metric([self._model_name], value)
            yield metric


class _PluginCollectors(Collector):
    """The collectors plugins registered (pjinfer.plugins), read at each scrape."""

    def collect(self) -> Iterator[Metric]:
        for collector in metrics_collectors():
            yield from collector.collect()


class ServerMetrics:
    """The metrics of one app; `render()` is the /metrics body."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str,
                 max_lora: int | None = None):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(stats, model_name, max_lora))
        self.registry.register(_PluginCollectors())
        self.http_requests = Counter(
            PREFIX + "http_requests", "HTTP requests by route and status code.",
            [MODEL_LABEL, "route", "status"], registry=self.registry)
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.",
            [MODEL_LABEL, "finished_reason"], registry=self.registry)
        self.ttft, self.tpot, self.e2e = (
            Histogram(PREFIX + name, doc, [MODEL_LABEL], buckets=buckets,
                      registry=self.registry).labels(model_name)
            for name, doc, buckets in (
                ("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS),
                ("time_per_output_token_seconds",
                 "Mean time between output tokens of a request.", _TPOT_BUCKETS),
                ("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)))

    def watch_admission(self, admission: Admission) -> None:
        """The counts the queue caps compare against (server.admission), read at scrape."""
        for name, doc, read in (
                ("server_queued_requests", "Requests admitted by the server, not finished.",
                 lambda: admission.queued_requests),
                ("server_queued_prompt_tokens", "Prompt tokens of those requests.",
                 lambda: admission.queued_tokens)):
            Gauge(PREFIX + name, doc, [MODEL_LABEL], registry=self.registry
                  ).labels(self.model_name).set_function(read)

    def observe_request(self, route: str, status: int) -> None:
        self.http_requests.labels(self.model_name, route, str(status)).inc()

    def observe_finished(self, done: Summary) -> None:
        """Latencies of one finished request (its first sequence stands for the group)."""
        for reason in done.finish_reasons:
            self.request_success.labels(self.model_name, reason or "unknown").inc()
        m = done.metrics
        if m is None or m.first_token_time is None:
            return
        self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            num_tokens = done.num_tokens[0] if done.num_tokens else 0
            if num_tokens > 1:
                self.tpot.observe((m.finished_time - m.first_token_time) / (num_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
